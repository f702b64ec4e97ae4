"""The node's read-ahead budget: one bound on what every loader here reads ahead, shared among them.

A loader built without its own ``readahead`` (the node's jobs) reads ahead ``samples // loaders`` samples and
``bytes // loaders`` bytes of payloads, within [floor, ceiling]: up to 64 sources that is the 64 samples (and
256 MiB) a loader always read ahead; at 1,024 sources, 8 (less than a read batch: a source nobody asked for yet
holds nothing), so the node's total stays about ``samples`` whatever the number of sources.
Every loader (each partition of a source) counts once. When a loader leaves, the others' shares grow and they
are woken to read on; when one joins, the others' shares shrink (what they hold stays until released).
Within ``changes()`` the shares change once, at its end: a job's 1,024 loaders closing one after another woke
every loader left at each leave (~500,000 wakes, a second of CPU).
"""

from __future__ import annotations

import weakref
from collections import deque
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass

__all__ = ["DEFAULT_BYTES", "DEFAULT_SAMPLES", "MIN_BYTES", "MIN_SAMPLES", "ReadAheadBudget", "node_budget"]

DEFAULT_SAMPLES = 4096  # 64 loaders x 64 samples: what 64 sources read ahead before the budget was shared
DEFAULT_BYTES = 1 << 30  # payload bytes past the highest ordinal asked for, all loaders together
MIN_SAMPLES, MAX_SAMPLES = 8, 64  # per loader: the floor, and the ceiling (what one loader always read ahead)
MIN_BYTES, MAX_BYTES = 1 << 20, 256 << 20
WARM_READS = 16  # first batches read ahead of the planner's first step at once, node-wide (``warm``)


@dataclass(frozen=True, slots=True)
class Share:
    samples: int
    bytes: int


class ReadAheadBudget:
    """Shares ``samples`` and ``bytes`` of read-ahead among the loaders registered (weakly held: a loader that
    is dropped without ``leave`` stops counting when it is collected). Used from the event loop only."""

    def __init__(self, samples: int = DEFAULT_SAMPLES, nbytes: int = DEFAULT_BYTES):
        self.samples = samples
        self.bytes = nbytes
        self._members: weakref.WeakSet = weakref.WeakSet()
        self._share = self._compute()
        self._held = 0  # ``changes()`` entered and not left
        self._warm_queue: deque = deque()  # loaders waiting to read their first batch (``warm``)
        self._warming = 0

    def configure(self, samples: int, nbytes: int) -> None:
        """New totals ([node] readahead_samples, readahead_mib); loaders see them at their next schedule."""
        self.samples, self.bytes = int(samples), int(nbytes)
        self._changed()

    @property
    def loaders(self) -> int:
        return len(self._members)

    def share(self) -> Share:
        """What one loader may read ahead now."""
        return self._share

    def join(self, member: object) -> None:
        """Count a loader; its ``budget_grew()`` is called when the shares grow (it may read on)."""
        self._members.add(member)
        self._changed()

    def leave(self, member: object) -> None:
        if member in self._members:
            self._members.discard(member)
            self._changed()

    @contextmanager
    def changes(self) -> Iterator[None]:
        """Joins and leaves within change the shares once, when the outermost exits (one wake of the loaders
        left for a job's loaders closing together, not one per loader); ``share()`` is the one before until then."""
        self._held += 1
        try:
            yield
        finally:
            self._held -= 1
            if not self._held:
                self._changed()

    def warm(self, member: object) -> None:
        """Queue a loader's first read (its ``warm_read()`` starts it and says whether it did): at most
        WARM_READS at once, in the order asked (the planner's), so what is read ahead of the planner's first
        step stays bounded (1,024 sources read at once held every record waiting for the transforms)."""
        self._warm_queue.append(weakref.ref(member))
        self._start_warm()

    def warm_done(self) -> None:
        self._warming -= 1
        self._start_warm()

    def _start_warm(self) -> None:
        while self._warming < WARM_READS and self._warm_queue:
            member = self._warm_queue.popleft()()
            if member is not None and member.warm_read():
                self._warming += 1

    def _compute(self) -> Share:
        n = max(1, len(self._members))
        samples = min(MAX_SAMPLES, max(MIN_SAMPLES, self.samples // n))
        return Share(samples, min(MAX_BYTES, max(MIN_BYTES, self.bytes // n)))

    def _changed(self) -> None:
        if self._held:
            return
        old, self._share = self._share, self._compute()
        if self._share.samples > old.samples or self._share.bytes > old.bytes:
            for member in list(self._members):
                member.budget_grew()

    def figures(self) -> dict:
        """For status: the totals, the loaders sharing them and each one's share."""
        s = self._share
        return {
            "samples": self.samples,
            "bytes": self.bytes,
            "loaders": self.loaders,
            "per_loader_samples": s.samples,
            "per_loader_bytes": s.bytes,
        }


_NODE = ReadAheadBudget()


def node_budget() -> ReadAheadBudget:
    """This process's budget (the node server configures it from [node] at start)."""
    return _NODE
