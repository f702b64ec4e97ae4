"""Reading a source's ordinals and transforming them: in the worker pool, or in a thread of this process when
there is none (or no transform). Kept apart from the loader, which decides what to read and what to hold.

Reads run one at a time, in a thread (they block on files); transforms in the pool run concurrently.
"""

from __future__ import annotations

import asyncio
import time
from typing import TYPE_CHECKING

import numpy as np

from ..sources.base import BadSample, Source
from ..sources.order import stable_seed
from ..transforms import load_transform, parse_transform_name, run_transform

if TYPE_CHECKING:
    from ..pool import WorkerPool

__all__ = ["SampleReader", "probe"]


class SampleReader:
    """Reads and transforms ordinals of one source; the caller owns the source and the pool."""

    def __init__(self, source: Source, pool: WorkerPool | None, transform: str | None, seed: int):
        self.source = source
        self.pool = pool
        self.transform = transform
        # With a pool the transform is imported only in the workers (it may import heavy libraries the server
        # must not load, such as torch); without one it runs here, so import it now for a clear error.
        self._fn = load_transform(transform) if pool is None or transform is None else None
        if transform is not None:
            parse_transform_name(transform)
        self._tseed = stable_seed(seed, source.name, "transform")
        self._lock: asyncio.Lock | None = None
        self.read_s = 0.0  # seconds spent reading records (in the reading thread), for the source's profile

    async def read(self, ords: np.ndarray) -> tuple[list, list, int]:
        """(records, transformed samples, bytes read) of ordinals."""
        loop = asyncio.get_running_loop()
        executor = self.source.read_executor()  # remote sources: the storage threads (latency, not CPU)
        if self.pool is None or self.transform is None:
            async with self._read_lock():
                return await loop.run_in_executor(executor, self._read_transform, ords)
        async with self._read_lock():
            records, nbytes, ids = await loop.run_in_executor(executor, self._read, ords)
        results = await self.pool.transform(
            self.transform, records, seed=self._tseed, sample_ids=ids, source=self.source.name
        )
        return records, results, nbytes

    async def transform_once(self, ords: np.ndarray) -> list:
        """The transformed samples of ordinals, read again."""
        return (await self.read(ords))[1]

    def _read_lock(self) -> asyncio.Lock:
        if self._lock is None:
            self._lock = asyncio.Lock()
        return self._lock

    def _read(self, ords: np.ndarray) -> tuple[list, int, np.ndarray]:
        t0 = time.perf_counter()
        rr = self.source.read_batch(ords)
        ids = self.source.sample_ids(ords)
        self.read_s += time.perf_counter() - t0
        return rr.records, rr.nbytes, ids

    def _read_transform(self, ords: np.ndarray) -> tuple[list, list, int]:
        records, nbytes, ids = self._read(ords)
        fn = self._fn if self._fn is not None else load_transform(self.transform)  # the pool has no workers
        return records, run_transform(fn, records, seed=self._tseed, sample_ids=ids), nbytes


def probe(source: Source, transform: str | None, seed: int, count: int = 8) -> list[tuple[int, object]]:
    """The first ``count`` ordinals of a source read and transformed here, as the loader would (``validate
    --job``): (ordinal, sample or BadSample, located in the source's files)."""
    ords = np.arange(min(count, source.num_samples), dtype=np.int64)
    if not ords.size:
        return []
    reader = SampleReader(source, None, transform, seed)
    records, results, _ = reader._read_transform(ords)
    out: list[tuple[int, object]] = []
    for o, rec, r in zip(ords.tolist(), records, results):
        if isinstance(r, BadSample) and r is not rec:  # found by the transform: say where in the files
            r = BadSample(r.reason, source.location(o), r.detail)
        out.append((o, r))
    return out
