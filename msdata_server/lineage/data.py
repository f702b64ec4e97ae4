"""A job's sources opened for lineage: the lengths a replay reads, and the files its rows name.

Its own loaders (never the running job's: a lineage query must not disturb the read-ahead, the held payloads or
the partitions of a run), reading exactly what is asked and releasing it at once. Transforms run in the node's
worker pool when one is given (the server stays free of whatever a transform imports), else in a thread here
(the offline CLI).
"""

from __future__ import annotations

import asyncio
import logging

import numpy as np

from msdata_client.spec import JobSpec

from ..job.images import source_transform
from ..loader import SourceLoader
from ..sources import Source, open_source

__all__ = ["DataView"]

log = logging.getLogger(__name__)


class DataView:
    """Lengths (and images) by ordinal for a replay, and ``Locate`` for its rows; ``aclose()`` when done."""

    def __init__(self, sources: list[Source], loaders: list[SourceLoader], *, vision: bool):
        self.sources = sources
        self.loaders = loaders
        self._vision = vision  # the vlm cost reads images after lengths: release then

    @classmethod
    async def open(cls, spec: JobSpec, pool=None, *, vision: bool = False) -> DataView:
        """Open ``spec``'s sources (in a thread: many files must not stall the loop)."""
        sources = await asyncio.to_thread(
            lambda: [open_source(s, seed=spec.seed, on_read_error=spec.on_read_error) for s in spec.sources]
        )
        loaders = [
            SourceLoader(src, pool, transform=source_transform(spec, s), seed=spec.seed, readahead=0)
            for src, s in zip(sources, spec.sources)
        ]
        return cls(sources, loaders, vision=vision)

    def sizes(self) -> list[int]:
        """Samples per epoch of each source."""
        return [src.num_samples for src in self.sources]

    async def lengths(self, source: int, start: int, count: int) -> np.ndarray:
        out = await self.loaders[source].lengths(start, count)
        if not self._vision:
            self.loaders[source].release(np.arange(start, start + count, dtype=np.int64))
        return out

    async def vision(self, source: int, start: int, count: int) -> tuple[np.ndarray, np.ndarray]:
        out = await self.loaders[source].vision(start, count)
        self.loaders[source].release(np.arange(start, start + count, dtype=np.int64))
        return out

    def locate(self, source: int, ordinals: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        return self.sources[source].locate_many(ordinals)

    def files(self, source: int) -> list[str]:
        src = self.sources[source]
        paths = getattr(src, "paths", None)
        return list(paths) if paths else [f"<{src.format}:{src.name}>"]

    async def aclose(self) -> None:
        for ld in self.loaders:
            try:
                await ld.aclose()
            finally:
                ld.source.close()
