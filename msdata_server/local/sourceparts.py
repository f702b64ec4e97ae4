"""One source's loaders on this node, split into partitions and merged back live (source auto-partitioning).

Partition (k, n) of a source reads the batches b with ``b % n == k`` (``loader``), each loader from its own
opened Source (its own files, its own reading thread), so n partitions read n batches at once; what a batch
holds never depends on n. A change to n' starts a new *generation* of n' loaders at the boundary batch B past
everything the current loaders scheduled or hold: batches >= B go to the new loaders, batches < B stay with
the generation that read them (their payloads are held there) and that generation reads no further (its
loaders ``stop_at`` B). An old generation is closed once it holds nothing; a batch below B asked for after
that is read again by the newest generation (reads are deterministic). Each partition reads ahead its own
``readahead`` samples (each a share of the node's budget, ``loader/budget.py``), so n partitions hold up to n
times the read-ahead of one. How far the plans reach (``planned_to``) is passed to every loader of the source.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Iterator
from dataclasses import dataclass

import numpy as np

from ..loader import SourceLoader
from ..sources import open_source

__all__ = ["SourceParts"]

log = logging.getLogger(__name__)

MAX_PARTITIONS = 16


@dataclass(slots=True)
class _Generation:
    start: int  # first global batch it reads
    loaders: list[SourceLoader]
    end: int | None = None  # the batch the next generation starts at (None: the newest reads on)

    def covers(self, b: int) -> bool:
        return self.start <= b and (self.end is None or b < self.end)

    def owner(self, b: int) -> SourceLoader:
        return self.loaders[b % len(self.loaders)]


class SourceParts:
    """The partitions of one source here (see the module docstring). Owns and closes its loaders and their
    sources."""

    def __init__(self, first: SourceLoader):
        if first.partition != (0, 1):
            raise ValueError(f"SourceParts starts from a whole source's loader, got partition {first.partition}")
        self.name = first.name
        self.batch = first.batch
        self._proto = first
        self._gens: list[_Generation] = [_Generation(0, [first])]
        self._closing: set[asyncio.Task] = set()
        self._lock = asyncio.Lock()
        self._planned: int | None = None  # the highest ordinal planned (None: plans not followed)

    @property
    def partitions(self) -> int:
        return len(self._gens[-1].loaders)

    def loaders(self) -> list[SourceLoader]:
        """Every open loader, oldest generation first."""
        return [ld for g in self._gens for ld in g.loaders]

    # ---- routing ----
    def _owner(self, b: int) -> SourceLoader:
        for g in self._gens:
            if g.covers(b):
                return g.owner(b)
        return self._gens[-1].owner(b)  # its generation was closed: the newest reads it again

    def _groups(self, ords: np.ndarray) -> Iterator[tuple[SourceLoader, np.ndarray]]:
        """Ordinals grouped by the loader that serves them (order kept within a group)."""
        owners = [self._owner(int(b)) for b in (ords // self.batch).tolist()]
        for ld in dict.fromkeys(owners):
            yield ld, ords[np.fromiter((o is ld for o in owners), dtype=bool, count=len(owners))]

    def _spans(self, start: int, count: int) -> Iterator[tuple[SourceLoader, int, int]]:
        """[start, start+count) cut at batch edges: (loader, first ordinal, count) in order."""
        at, end = start, start + count
        while at < end:
            stop = min(end, (at // self.batch + 1) * self.batch)
            yield self._owner(at // self.batch), at, stop - at
            at = stop

    # ---- what LocalPayloads asks ----
    async def tokens(self, ordinal: int) -> np.ndarray:
        return await self._owner(int(ordinal) // self.batch).tokens(ordinal)

    async def lengths(self, start: int, count: int) -> np.ndarray:
        parts = [await ld.lengths(a, n) for ld, a, n in self._spans(start, count)]
        return np.concatenate(parts) if parts else np.zeros(0, dtype=np.int64)

    async def vision(self, start: int, count: int) -> tuple[np.ndarray, np.ndarray]:
        got = [await ld.vision(a, n) for ld, a, n in self._spans(start, count)]
        if not got:
            return np.zeros(0, dtype=np.int64), np.zeros(0, dtype=np.int64)
        return np.concatenate([g[0] for g in got]), np.concatenate([g[1] for g in got])

    def release(self, ordinals) -> None:
        ords = np.asarray(ordinals, dtype=np.int64).reshape(-1)
        for ld, mine in self._groups(ords):
            ld.release(mine)
        self._retire_drained()

    def sample_ids(self, ordinals) -> np.ndarray:
        return self._proto.sample_ids(ordinals)

    def follow_plans(self) -> None:
        """Loaders keep payloads only up to their read-ahead past what is planned (``SourceLoader.planned_to``)."""
        if self._planned is None:
            self._planned = -1
            for ld in self.loaders():
                ld.follow_plans()

    def planned_to(self, ordinal: int) -> None:
        if self._planned is not None and ordinal > self._planned:
            self._planned = int(ordinal)
            for ld in self.loaders():
                ld.planned_to(self._planned)

    # ---- splitting and merging ----
    async def set_partitions(self, n: int) -> tuple[int, int] | None:
        """Read on with ``n`` partitions from the boundary batch (returns (boundary, n)); None if unchanged."""
        if isinstance(n, bool) or not isinstance(n, int) or not 1 <= n <= MAX_PARTITIONS:
            raise ValueError(f"partitions {n=} must be an integer in [1, {MAX_PARTITIONS}]")
        async with self._lock:
            cur = self._gens[-1]
            if n == len(cur.loaders):
                return None
            boundary = max([cur.start] + [ld.frontier() for g in self._gens for ld in g.loaders])
            for ld in cur.loaders:  # at once: no read-ahead may pass the boundary while the sources open
                ld.stop_at(boundary)
            p = self._proto
            spec, seed, policy = p.source.spec, p.source.seed, p.source.on_read_error
            sources = await asyncio.to_thread(
                lambda: [open_source(spec, seed=seed, on_read_error=policy) for _ in range(n)]
            )
            loaders = [
                SourceLoader(
                    src,
                    p.pool,
                    transform=p.transform,
                    seed=p.seed,
                    readahead=p.own_readahead[0],
                    batch=p.batch,
                    partition=(k, n),
                    readahead_bytes=p.own_readahead[1],
                )
                for k, src in enumerate(sources)
            ]
            for ld in loaders:
                if self._planned is not None:
                    ld.follow_plans()
                    ld.planned_to(self._planned)
                ld.seek(boundary * self.batch)
                await ld.start()
            cur.end = boundary
            self._gens.append(_Generation(boundary, loaders))
            log.info("source %s: %d -> %d partitions from batch %d", self.name, len(cur.loaders), n, boundary)
            self._retire_drained()
            return boundary, n

    def _retire_drained(self) -> None:
        """Close old generations that hold nothing (the newest stays; a re-read goes to it)."""
        if len(self._gens) < 2:
            return
        keep = []
        for g in self._gens[:-1]:
            stats = [ld.statistics() for ld in g.loaders]
            if any(st.ready or st.inflight for st in stats):
                keep.append(g)
                continue
            t = asyncio.get_running_loop().create_task(self._close(g.loaders), name=f"msdata-parts-{self.name}")
            self._closing.add(t)
            t.add_done_callback(self._closing.discard)
        self._gens = [*keep, self._gens[-1]]

    @staticmethod
    async def _close(loaders: list[SourceLoader]) -> None:
        for ld in loaders:
            try:
                await ld.aclose()
            finally:
                ld.source.close()

    async def aclose(self) -> None:
        """Close every loader and source (and wait for retiring ones). Idempotent."""
        gens, self._gens = self._gens, self._gens[-1:]
        if self._closing:
            await asyncio.gather(*list(self._closing), return_exceptions=True)
        for g in gens:
            await self._close(g.loaders)
        self._gens = []
