"""Piece reference counts: when a document's payload may be freed.

A document longer than ``seq_len`` is split into pieces, and the planner may place some pieces in one step
and carry the others over to later steps. So a payload is freed only when both hold:

- every piece planned so far was built (or skipped): its count of outstanding references is zero, and
- the document's last piece was planned (``StepPlan.last``): no piece of it is still carried over.

One class for both places that hold payloads: a node's job (one reference per planned piece it builds) and a
cluster shard (one reference per planned piece and building node). Counts may go below zero for a while when
a piece is served before its plan is counted (a remote builder can be faster than the plan reaching the
owner); the plan's count brings it back. Plans cut by a mixture change are taken back with ``unplan``.

Invariant: ``len(self)`` documents are pinned, each by a planned piece not yet built or by a planned piece
whose document still has carried pieces; nothing else.
"""

from __future__ import annotations

from collections.abc import Iterable

import numpy as np

__all__ = ["PieceRefs"]


class PieceRefs:
    """Outstanding piece references per document ``(source, ordinal)``; see the module docstring."""

    __slots__ = ("_count", "_final")

    def __init__(self) -> None:
        self._count: dict[tuple[int, int], int] = {}
        self._final: set[tuple[int, int]] = set()  # documents whose last piece was planned

    def __len__(self) -> int:
        return len(self._count.keys() | self._final)

    def pinned(self, source: int) -> int:
        """Documents of ``source`` held for planned pieces (see the invariant)."""
        return sum(1 for s, _ in self._count.keys() | self._final if s == source)

    def plan(
        self, source: np.ndarray, ordinal: np.ndarray, last: np.ndarray, weight: Iterable[int] | None = None
    ) -> list[tuple[int, int]]:
        """Count a plan's pieces (``weight`` references each, default 1); returns documents now free (a piece
        served before its plan was counted)."""
        return self._add(source, ordinal, last, weight, +1)

    def unplan(
        self, source: np.ndarray, ordinal: np.ndarray, last: np.ndarray, weight: Iterable[int] | None = None
    ) -> None:
        """Take back a plan that will never be built (a mixture change re-plans its step)."""
        self._add(source, ordinal, last, weight, -1)

    def done(self, source: np.ndarray, ordinal: np.ndarray) -> list[tuple[int, int]]:
        """Pieces built or skipped (one reference each); returns the documents that are now free."""
        free = []
        for key in zip(np.asarray(source).tolist(), np.asarray(ordinal).tolist()):
            if self._step(key, -1):
                free.append(key)
        return free

    def _add(self, source, ordinal, last, weight, sign: int) -> list[tuple[int, int]]:
        src, ords, fin = np.asarray(source).tolist(), np.asarray(ordinal).tolist(), np.asarray(last).tolist()
        ws = [1] * len(src) if weight is None else list(weight)
        free = []
        for key, f, w in zip(zip(src, ords), fin, ws):
            if f:
                if sign > 0:
                    self._final.add(key)
                else:
                    self._final.discard(key)
            if self._step(key, sign * w) and sign > 0:  # w == 0 (nobody builds it): free once final
                free.append(key)
        return free

    def _step(self, key: tuple[int, int], delta: int) -> bool:
        """Move a count; True when the document became free (count zero and its last piece planned)."""
        n = self._count.get(key, 0) + delta
        if n != 0:
            self._count[key] = n
            return False
        self._count.pop(key, None)
        if key in self._final:
            self._final.discard(key)
            return True
        return False

    def by_source(self, free: list[tuple[int, int]]) -> dict[int, np.ndarray]:
        """Free documents grouped by source: {source: int64 ordinals}."""
        out: dict[int, list[int]] = {}
        for s, o in free:
            out.setdefault(s, []).append(o)
        return {s: np.asarray(o, dtype=np.int64) for s, o in out.items()}


def hold_figures(source: int, loaders: list, refs: PieceRefs, state: dict | None) -> dict[str, int]:
    """Payloads this node holds for ``source`` and the bound they must stay within (the loader invariant).

    ``loaders`` are the source's partition loaders on this node; ``state`` the planner state at the start of
    the newest step planned (or received) here. Every payload held is either read ahead of what was asked
    (at most each loader's ``readahead``) or pinned: by planned pieces not yet built (``refs``), by pieces the
    planner carries over (in ``state``), or looked ahead by the planner (lengths asked from its cursor on).
    """
    cursor = int(state["cursor"][source]) if state else 0
    carry = state["carry"] if state else {"source": [], "ordinal": []}
    carried = {o for s, o in zip(carry["source"], carry["ordinal"]) if s == source}
    mine = [o for o in carried if any(ld.owns(o) for ld in loaders)]
    pinned = refs.pinned(source) + len(mine) + sum(ld.asked_from(cursor) for ld in loaders)
    readahead = sum(ld.readahead for ld in loaders)
    return {"held": sum(ld.ready for ld in loaders), "held_bound": readahead + pinned, "held_pinned": pinned}
