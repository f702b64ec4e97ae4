"""Open file handles, bounded node-wide: one LRU over every source's handles ([node] open_files, default 256).

A Parquet handle holds its decoded footer (~23 KiB in memory for 8 row groups of one column) and a descriptor;
1,024 sources of 16 files each kept 16,384 of them open while they were indexed. Each source also keeps its own
bound (``SourceHandles.max_items``: the files its order reads at once, + 4). Reads of one source run one at a
time under the source's lock, so a handle is closed for another source's sake only when its owner's lock can be
taken without waiting (its owner is not reading); one that cannot is passed over, and the bound may be exceeded
until the next open (by at most the number of sources reading at that moment).
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from collections.abc import Callable
from typing import Any

__all__ = ["DEFAULT_OPEN_FILES", "HandleLru", "SourceHandles", "node_handles"]

DEFAULT_OPEN_FILES = 256


class HandleLru:
    """The node's open handles, least recently used first, at most ``limit`` (see the module docstring)."""

    def __init__(self, limit: int = DEFAULT_OPEN_FILES):
        self.limit = int(limit)
        self._lock = threading.Lock()
        self._items: OrderedDict[tuple[int, int], tuple[SourceHandles, Any]] = OrderedDict()
        self._next_owner = 0
        self.evictions = 0  # handles closed for the bound (node-wide or per source), cumulative

    def __len__(self) -> int:
        return len(self._items)

    def _owner_id(self) -> int:
        with self._lock:
            self._next_owner += 1
            return self._next_owner

    def figures(self) -> dict:
        return {"open": len(self._items), "limit": self.limit, "evictions": self.evictions}


class SourceHandles:
    """One source's part of the node's LRU: ``get``/``put``/``clear`` by file index, like a per-source cache.
    ``lock`` is the owner source's (re-entrant) read lock; ``close`` closes one handle."""

    def __init__(self, lru: HandleLru, lock: Any, close: Callable[[Any], None], max_items: int):
        self.lru = lru
        self.max_items = max_items
        self._id = lru._owner_id()
        self._lock = lock
        self._close = close
        self._mine: OrderedDict[int, None] = OrderedDict()  # this source's files open, least recent first

    def __len__(self) -> int:
        return len(self._mine)

    def get(self, f: int) -> Any:
        lru = self.lru
        with lru._lock:
            got = lru._items.get((self._id, f))
            if got is None:
                return None
            lru._items.move_to_end((self._id, f))
            self._mine.move_to_end(f)
            return got[1]

    def values(self) -> list[Any]:
        with self.lru._lock:
            return [self.lru._items[(self._id, f)][1] for f in self._mine]

    def put(self, f: int, handle: Any) -> None:
        """Hold a handle just opened (the caller holds this source's lock, or no one else can read it yet)."""
        lru = self.lru
        doomed: list[tuple[SourceHandles, Any, bool]] = []  # (owner, handle, whether its lock is to release)
        with lru._lock:
            old = lru._items.pop((self._id, f), None)
            if old is not None:
                doomed.append((self, old[1], False))
            lru._items[(self._id, f)] = (self, handle)
            self._mine[f] = None
            self._mine.move_to_end(f)
            while len(self._mine) > max(1, self.max_items):  # this source's own bound: its oldest
                g = next(iter(self._mine))
                doomed.append((self, self._pop(g), False))
            over = len(lru._items) - max(1, lru.limit)
            for key in list(lru._items) if over > 0 else ():
                if over <= 0:
                    break
                owner, h = lru._items[key]
                if owner is self:
                    if key[1] == f:
                        continue  # the one just opened stays
                    doomed.append((self, owner._pop(key[1]), False))
                elif owner._lock.acquire(blocking=False):  # its owner is not reading: safe to close
                    doomed.append((owner, owner._pop(key[1]), True))
                else:
                    continue
                over -= 1
            lru.evictions += len(doomed) - (old is not None)
        for owner, h, locked in doomed:
            try:
                owner._close(h)
            finally:
                if locked:
                    owner._lock.release()

    def _pop(self, f: int) -> Any:
        """Forget file f's entry (the LRU's lock held); its handle, to close."""
        del self._mine[f]
        return self.lru._items.pop((self._id, f))[1]

    def clear(self) -> None:
        """Close every handle of this source (the caller holds this source's lock)."""
        with self.lru._lock:
            doomed = [self._pop(f) for f in list(self._mine)]
        for h in doomed:
            self._close(h)


_NODE = HandleLru()


def node_handles() -> HandleLru:
    """This process's LRU of open handles (the node server sets its limit from [node] open_files)."""
    return _NODE
