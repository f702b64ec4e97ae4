"""Reading a batch of rows of Arrow-column files (Parquet row groups, Arrow IPC record batches) in one gather
across files: the mixed order puts rows of `lanes` files in every read batch, a couple of rows per file, and
turning rows into records has a fixed cost per call (an Arrow take, the null/size checks, the conversion to
Python values), so the rows of all the units a batch touches are gathered into one array first (a one-row
slice per row of a unit giving few rows, a take for a unit giving many) and turned into records once."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np
import pyarrow as pa

from ._arrow import selected_records
from .base import FileSource

__all__ = ["UnitColumnsSource"]

# a unit giving at most this many rows of a batch contributes one-row slices (~0.3 us each), more a take (~8 us)
_SLICE_MAX = 8


class UnitColumnsSource(FileSource):
    """A FileSource whose files are units (``unit_cum[f]``: each unit's first row) of Arrow columns;
    subclasses implement ``_unit(f, u)``: the unit's selected columns (``columns`` order, or the one
    ``column``) or the exception that reading them raised (its rows become bad samples)."""

    def __init__(self, spec: Any, *, seed: int):
        super().__init__(spec, seed=seed)
        # every unit of every file in one increasing array of source-wide first rows (files in path order),
        # so that one searchsorted finds the units of a batch's rows whatever files they are in
        self._file_first = self._order.fixed_starts()
        firsts = [cum[:-1] + int(base) for cum, base in zip(self.unit_cum, self._file_first.tolist())]
        self._unit_file = np.repeat(np.arange(len(firsts), dtype=np.int64), [len(u) for u in firsts])
        self._unit_first = np.concatenate(firsts) if firsts else np.zeros(0, np.int64)
        self._unit_base = np.zeros(len(firsts) + 1, dtype=np.int64)  # each file's first unit in those arrays
        np.cumsum([len(u) for u in firsts], out=self._unit_base[1:])

    def _index_bytes(self) -> int:
        extra = self._file_first.nbytes + self._unit_file.nbytes + self._unit_first.nbytes + self._unit_base.nbytes
        return super()._index_bytes() + extra

    def _unit(self, f: int, u: int) -> list[pa.Array] | Exception:
        raise NotImplementedError

    def _prefetch_units(self, pairs: list[tuple[int, int]]) -> None:
        """Fetch units that ``_unit`` will be asked for next, with their latency overlapped (remote files)."""

    def _unit_name(self) -> str:
        """What a unit is called in bad-sample messages ("row group", "record batch")."""
        return "unit"

    def _read_rows(self, files: np.ndarray, rows: np.ndarray) -> tuple[list, int]:
        out: list = [None] * len(rows)
        at = rows + self._file_first[files]  # source-wide rows
        g = np.searchsorted(self._unit_first, at, side="right") - 1  # (an empty unit starts where the next does)
        local = at - self._unit_first[g]  # the row in its unit
        keys, inverse = np.unique(g, return_inverse=True)
        good: list[list[pa.Array]] = []
        slot = np.full(len(keys), -1, dtype=np.int64)  # each unit's place in `good`, -1 for a bad unit
        kf = self._unit_file[keys]
        pairs = list(zip(kf.tolist(), (keys - self._unit_base[kf]).tolist()))
        self._prefetch_units(pairs)
        for i, (f, u) in enumerate(pairs):
            got = self._unit(f, u)
            if isinstance(got, Exception):
                name, reason = self._unit_name(), self.error_reason(got)
                scope = f"{self.paths[f]} {name} {u}"
                for k in np.flatnonzero(inverse == i).tolist():
                    out[k] = self.bad_sample(f, int(rows[k]), reason, f"{name} {u}: {got}", scope)
                continue
            slot[i] = len(good)
            good.append(got)
        which = slot[inverse]
        place = np.flatnonzero(which >= 0)  # the batch's rows in readable units, in batch order
        if len(place) == 0:
            return out, 0
        if len(good) == 1:  # the file-local order's usual batch: one take does it
            return out, self._records(good[0], local[place], place, files, rows, out)
        try:
            cols, idx = gather(good, which[place], local[place])
        except (pa.ArrowInvalid, pa.ArrowTypeError, pa.ArrowNotImplementedError):  # files of differing types
            nbytes = 0
            for s in np.unique(which[place]).tolist():  # a call per unit
                part = place[which[place] == s]
                nbytes += self._records(good[s], local[part], part, files, rows, out)
            return out, nbytes
        return out, self._records(cols, idx, place, files, rows, out)

    def _records(
        self,
        cols: Sequence[pa.Array],
        idx: np.ndarray,
        place: np.ndarray,
        files: np.ndarray,
        rows: np.ndarray,
        out: list,
    ) -> int:
        """Records of rows ``idx`` of ``cols`` into ``out[place]`` (``files``, ``rows``: where each row of the
        batch lies, for bad-sample messages); the bytes they hold."""

        def bad(k: int, reason: str, detail: str) -> object:
            p = int(place[k])
            return self.bad_sample(int(files[p]), int(rows[p]), reason, detail)

        recs, nb = selected_records(cols, self.columns, idx, max_bytes=self.max_bytes, bad=bad)
        for p, rec in zip(place.tolist(), recs):
            out[p] = rec
        return nb


def gather(
    units: Sequence[Sequence[pa.Array]], which: np.ndarray, local: np.ndarray
) -> tuple[list[pa.Array], np.ndarray]:
    """The rows (``local[k]`` of unit ``which[k]``) gathered into one array per column, unit by unit, and the
    index that puts them back in the order of k (rows of a unit giving many rows come from one take, the rows of
    one giving few from one-row slices). ArrowInvalid (or another Arrow error) when the units' types differ."""
    order = np.argsort(which, kind="stable")
    bounds = np.searchsorted(which[order], np.arange(len(units) + 1))
    cols: list[pa.Array] = []
    for c in range(len(units[0])):
        parts: list[pa.Array] = []
        for s in range(len(units)):
            lo, hi = int(bounds[s]), int(bounds[s + 1])
            if hi == lo:
                continue
            arr = units[s][c]
            got = local[order[lo:hi]]
            if hi - lo <= _SLICE_MAX:
                cut = arr.slice
                parts.extend([cut(r, 1) for r in got.tolist()])
            else:
                parts.append(arr.take(pa.array(got, type=pa.int64())))
        cols.append(parts[0] if len(parts) == 1 else pa.concat_arrays(parts))
    back = np.empty(len(which), dtype=np.int64)
    back[order] = np.arange(len(which))  # row k of the batch sits at back[k] in the gathered arrays
    return cols, back
