"""Parquet reader: files kept open, a numpy row-group index, only the needed row groups and columns read,
a small LRU of decoded row groups (windows follow row groups, so a window's reads hit the cache; the mixed
order reads a window in each of its lanes at once, so the LRU keeps the groups of lanes windows, within
cache_bytes)."""

from __future__ import annotations

from typing import Any, ClassVar

import numpy as np
import pyarrow.parquet as pq

from ._arrow import check_selected, selected_records
from .base import FileSource, _Lru

__all__ = ["ParquetSource"]


class ParquetSource(FileSource):
    """Rows of one column (or a dict of several ``columns``) of Parquet files."""

    format = "parquet"
    extensions = (".parquet", ".parq", ".pq")
    # decoded row groups kept, within cache_bytes; None: lanes * (most row groups in a window) + 8
    cache_groups: ClassVar[int | None] = None
    cache_bytes: ClassVar[int] = 256 << 20

    def __init__(self, spec: Any, *, seed: int):
        self._groups = _Lru(max_items=self.cache_groups or 8, max_bytes=self.cache_bytes)
        super().__init__(spec, seed=seed)
        self._groups.max_items = self.cache_groups or self._order.lanes * self._groups_per_window() + 8

    def _groups_per_window(self) -> int:
        """The most row groups one window spans (small row groups merge into one window, whose rows are read
        in shuffled order: the LRU must hold all of a window's groups for each lane, or they are read again)."""
        order, most = self._order, 1
        for f, cum in enumerate(self.unit_cum):
            lo, hi = int(order.offsets[f]), int(order.offsets[f + 1])
            if hi > lo:
                bounds = np.append(order.starts[lo:hi], cum[-1])
                first = np.searchsorted(cum, bounds[:-1], side="right")
                last = np.searchsorted(cum, bounds[1:] - 1, side="right")
                most = max(most, int((last - first).max()) + 1)
        return most

    def _open(self, path: str) -> pq.ParquetFile:
        return pq.ParquetFile(path, page_checksum_verification=True)

    def _scan(self, i: int, path: str) -> np.ndarray:
        pf = self._open(path)
        try:
            check_selected(self.name, path, pf.schema_arrow, self.column, self.columns)
            md = pf.metadata
            units = np.array([md.row_group(g).num_rows for g in range(md.num_row_groups)], dtype=np.int64)
        except BaseException:
            pf.close()
            raise
        self.keep_open(i, pf)
        return units

    def _group(self, f: int, g: int):
        """The decoded columns (a list, in ``columns`` order) of row group g of file f, or the exception that
        reading them raised."""
        key = (f, g)
        got = self._groups.get(key)
        if got is None:
            names = list(self.columns) if self.columns is not None else [self.column]
            try:
                table = self._retry(lambda: self.handle(f).read_row_group(g, columns=names))
                got = [table.column(c).combine_chunks() for c in names]
                size = sum(c.nbytes for c in got)
            except Exception as e:
                if self.error_reason(e) == "read_error":
                    return e  # persistent I/O trouble: try again next time
                got, size = e, 0  # cached too: a corrupt row group is not decoded again for every batch
            self._groups.put(key, got, size)
        return got

    def _read_file(self, f: int, rows: np.ndarray) -> tuple[list, int]:
        cum = self.unit_cum[f]
        groups = np.searchsorted(cum, rows, side="right") - 1
        out: list = [None] * len(rows)
        nbytes = 0
        for g in np.unique(groups).tolist():
            sel = np.flatnonzero(groups == g)
            col = self._group(f, g)
            frows = rows[sel]
            if isinstance(col, Exception):
                reason = self.error_reason(col)
                scope = f"{self.paths[f]} row group {g}"
                for k, r in zip(sel.tolist(), frows.tolist()):
                    out[k] = self.bad_sample(f, r, reason, f"row group {g}: {col}", scope)
                continue

            def bad(k: int, reason: str, detail: str, _rows=frows) -> object:
                return self.bad_sample(f, int(_rows[k]), reason, detail)

            recs, nb = selected_records(col, self.columns, frows - cum[g], max_bytes=self.max_bytes, bad=bad)
            nbytes += nb
            for k, rec in zip(sel.tolist(), recs):
                out[k] = rec
        return out, nbytes

    def _trim_locked(self) -> None:
        self._groups.clear()  # a source read rarely would hold its decoded window for nothing
        super()._trim_locked()

    def close(self) -> None:
        with self._lock:
            self._groups.clear()
        super().close()
