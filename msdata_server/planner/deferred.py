"""Pieces deferred by ``loader.skip(steps=k, defer=True)``: delivered after the rest of their source's epoch.

The planner keeps reading each source as one stream of *virtual* ordinals. Without deferrals virtual and real
ordinals are the same. A deferral inserts, at a virtual position ``at`` (the end of the source's current epoch),
one virtual document per deferred piece: its length is the piece's, and it maps back to the piece's real
(ordinal, offset). Virtual ordinals past an insert map to the real ones ``len(insert)`` lower. The planner's
state (cursor, carry) stays virtual; ``view`` wraps the lengths it reads and ``translate`` turns a plan back into
real ordinals and offsets, so everything after the planner (payloads, sample ids, lineage) sees real ones.
A pure value, part of the planner state (``state.K_DEFERRED``); absent, nothing changes.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, replace

import numpy as np

from msdata_server.errors import CheckpointError

from .lengths import MetadataView

__all__ = ["Deferred", "Insert"]


@dataclass(frozen=True, slots=True, kw_only=True, eq=False)
class Insert:
    """Deferred pieces of one source, read at virtual ordinals [at, at + len)."""

    source: int
    at: int
    ordinal: np.ndarray  # int64 real ordinal of each piece's document
    offset: np.ndarray  # int64 first token of the piece in its document
    length: np.ndarray  # int64 tokens of the piece

    def __len__(self) -> int:
        return int(self.ordinal.size)

    def to_dict(self) -> dict:
        return {
            "source": self.source,
            "at": self.at,
            "ordinal": self.ordinal.tolist(),
            "offset": self.offset.tolist(),
            "length": self.length.tolist(),
        }


@dataclass(frozen=True, slots=True, eq=False)
class Deferred:
    """Every insert, by source in order of ``at`` (see the module docstring)."""

    inserts: tuple[Insert, ...] = ()

    def __bool__(self) -> bool:
        return bool(self.inserts)

    def of(self, source: int) -> list[Insert]:
        return sorted((i for i in self.inserts if i.source == source), key=lambda i: i.at)

    def to_list(self) -> list[dict]:
        return [i.to_dict() for i in self.inserts]

    @classmethod
    def from_list(cls, raw: object, n_sources: int) -> Deferred:
        if not isinstance(raw, list):
            raise CheckpointError(f"planner state 'deferred' must be a list of inserts, got {raw!r}")
        out = []
        for d in raw:
            try:
                if not isinstance(d, Mapping):
                    raise TypeError("not an object")
                cols = [np.asarray(d[k], dtype=np.int64) for k in ("ordinal", "offset", "length")]
                s, at = d["source"], d["at"]
                ok = isinstance(s, int) and 0 <= s < n_sources and isinstance(at, int) and at >= 0
                if not ok or len({c.size for c in cols}) != 1 or any(c.ndim != 1 for c in cols):
                    raise ValueError("bad source, position or columns")
                if cols[0].size and (cols[0].min() < 0 or cols[1].min() < 0 or cols[2].min() < 1):
                    raise ValueError("negative ordinal or offset, or an empty piece")
            except (KeyError, TypeError, ValueError) as e:
                raise CheckpointError(f"planner state 'deferred' holds a malformed insert {d!r}: {e}") from None
            out.append(Insert(source=s, at=at, ordinal=cols[0], offset=cols[1], length=cols[2]))
        return cls(tuple(out))

    # ---- the mapping ----
    def real(self, source: int, virtual: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """(real ordinal, offset base, piece length or -1 for a whole document) of virtual ordinals."""
        v = np.asarray(virtual, dtype=np.int64)
        ords, base, lens = v.copy(), np.zeros_like(v), np.full_like(v, -1)
        for ins in self.of(source):  # in order of `at`: a later insert overwrites what an earlier one shifted
            n = len(ins)
            inside = (v >= ins.at) & (v < ins.at + n)
            k = v[inside] - ins.at
            ords[inside], base[inside], lens[inside] = ins.ordinal[k], ins.offset[k], ins.length[k]
            ords[v >= ins.at + n] -= n
        return ords, base, lens

    def virtual(self, source: int, real: int) -> int:
        """The virtual position where the real ordinal ``real`` is read (after any insert placed there)."""
        v = int(real)
        for ins in self.of(source):
            if ins.at <= v:
                v += len(ins)
        return v

    def real_cursor(self, source: int, virtual: int) -> int:
        """The real ordinal the stream reads next at a virtual cursor (past an insert it is in: the one after)."""
        r = int(virtual)
        for ins in self.of(source):
            if ins.at < virtual:
                r -= min(len(ins), virtual - ins.at)
        return r

    def with_insert(self, ins: Insert) -> Deferred:
        return Deferred((*self.inserts, ins))

    def view(self, view: MetadataView) -> MetadataView:
        return _DeferredView(self, view)

    def translate(self, plan):
        """A StepPlan with real ordinals and offsets."""
        ords, offs = plan.ordinal.copy(), plan.offset.astype(np.int64)
        for s in np.unique(plan.source).tolist():
            m = plan.source == s
            r, base, _ = self.real(s, plan.ordinal[m])
            ords[m], offs[m] = r, offs[m] + base
        return replace(plan, ordinal=ords, offset=offs.astype(np.int32))


class _DeferredView:
    """Lengths of virtual ordinals: a deferred piece's length, or the real document's from the wrapped view."""

    def __init__(self, deferred: Deferred, view: MetadataView):
        self._d, self._view = deferred, view

    def lengths(self, source: int, start: int, count: int) -> np.ndarray:
        ords, _, lens = self._d.real(source, np.arange(start, start + count, dtype=np.int64))
        out = lens.copy()
        whole = np.flatnonzero(lens < 0)
        if whole.size:
            r = ords[whole]
            cuts = np.flatnonzero(np.diff(r) != 1) + 1  # runs of consecutive real ordinals
            for idx in np.split(np.arange(whole.size), cuts):
                got = np.asarray(self._view.lengths(source, int(r[idx[0]]), int(idx.size)), dtype=np.int64)
                out[whole[idx]] = got
        return out


def pieces_of(plans: Sequence, n_sources: int) -> list[tuple[np.ndarray, np.ndarray, np.ndarray]]:
    """Per source, the (ordinal, offset, length) of every piece of ``plans``, sorted by ordinal then offset."""
    out = []
    for s in range(n_sources):
        cols = [np.concatenate([getattr(p, k)[p.source == s] for p in plans]).astype(np.int64)
                for k in ("ordinal", "offset", "length")]  # fmt: skip
        order = np.lexsort((cols[1], cols[0]))
        out.append((cols[0][order], cols[1][order], cols[2][order]))
    return out
