"""The metadata side of a job run's shard: the lengths (and, for ``cost = "vlm"``, the images and patches) of any
span of a source's order, for the leader's planner view. The owner of each block answers from its partition's
loader; a builder asks the owners, one request per owner, and puts the answers back in order.

It reads the run's partition layout and opens a partition's loader through the callable it is given
(``JobShard.loader``); the node (id, RPC, placement settling) through its ``ClusterContext``.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable
from typing import TYPE_CHECKING

import numpy as np

from ..errors import CheckpointError, ConfigError, MsdataError, ProtocolError, RemoteError
from ..loader import SourceLoader
from .parts import BLOCK
from .placement import PartitionLayout

if TYPE_CHECKING:
    from .context import ClusterContext

__all__ = ["BLOCK", "ShardMetadata", "retryable"]

log = logging.getLogger(__name__)


class ShardMetadata:
    """Lengths and vision figures of one run's sources (``JobShard.meta``)."""

    def __init__(
        self,
        ctx: ClusterContext,
        where: PartitionLayout,
        loader: Callable[[int, int], Awaitable[SourceLoader]],
        *,
        digest: str,
        run: str,
    ) -> None:
        self.ctx = ctx
        self.where = where  # the owner of each partition (the run's, updated in place)
        self._loader = loader  # the loader of partition (s, k) here, opened on first use
        self.digest = digest
        self.run = run  # the run id peers' requests name

    def _part(self, s: int, ordinal: int) -> int:
        return self.where.table.part(s, ordinal)

    async def serve_lengths(self, s: int, start: int, count: int) -> np.ndarray:
        """Lengths of [start, start+count): any span; each block from its partition's loader."""
        out = np.empty(count, dtype=np.int64)
        end = start + count
        pos = start
        while pos < end:
            hi = min(end, (pos // BLOCK + 1) * BLOCK)
            ld = await self._loader(s, self._part(s, pos))
            out[pos - start : hi - start] = await ld.lengths(pos, hi - pos)
            pos = hi
        return out

    async def serve_vision(self, s: int, start: int, count: int) -> tuple[np.ndarray, np.ndarray]:
        """(images per sample, patches per image) of [start, start+count), as serve_lengths asks its loaders."""
        images, patches = [], []
        pos, end = start, start + count
        while pos < end:
            hi = min(end, (pos // BLOCK + 1) * BLOCK)
            ld = await self._loader(s, self._part(s, pos))
            im, p = await ld.vision(pos, hi - pos)
            images.append(im)
            patches.append(p)
            pos = hi
        empty = np.zeros(0, np.int64)
        return (np.concatenate(images) if images else empty), (np.concatenate(patches) if patches else empty)

    async def lengths(self, s: int, start: int, count: int) -> np.ndarray:
        """Lengths of [start, start+count) of source s, asked of the nodes that own the blocks (retrying)."""
        return (await self._ask(s, start, count, vision=False))[0]

    async def vision(self, s: int, start: int, count: int) -> tuple[np.ndarray, np.ndarray]:
        """(images per sample, patches per image) of [start, start+count) of source s (the planner's
        VisionView, cost = "vlm"), asked of the nodes that own the blocks (retrying)."""
        images, patches = await self._ask(s, start, count, vision=True)
        return images, patches

    async def _ask(self, s: int, start: int, count: int, *, vision: bool) -> tuple[np.ndarray, ...]:
        """Lengths, or images and patches with ``vision``, of [start, start+count), block by block from the
        owners (one request per owner), in order."""
        while True:
            pl = self.where.placement()
            spans: dict[str, list[list[int]]] = {}
            pos, end = start, start + count
            while pos < end:
                hi = min(end, (pos // BLOCK + 1) * BLOCK)
                spans.setdefault(pl[s][self._part(s, pos)], []).append([pos, hi - pos])
                pos = hi
            try:
                res = await asyncio.gather(*(self._ask_from(nid, s, sp, vision) for nid, sp in spans.items()))
            except Exception as e:
                if not retryable(e):
                    raise
                log.info("node %s: asking lengths: %s; retrying after placement settles", self.ctx.node_id, e)
                if self.where.placement() == pl:
                    await self.ctx.members_settle()
                continue
            return _in_order(start, count, list(spans.values()), res, vision)

    async def _ask_from(self, nid: str, s: int, spans: list[list[int]], vision: bool) -> tuple[np.ndarray, ...]:
        """(lengths,) or (images, patches) of the spans from node nid (this node: its loaders)."""
        asked = sum(n for _, n in spans)
        if nid == self.ctx.node_id:
            if not vision:
                return (np.concatenate([await self.serve_lengths(s, a, n) for a, n in spans]),)
            got = [await self.serve_vision(s, a, n) for a, n in spans]
            return np.concatenate([g[0] for g in got]), np.concatenate([g[1] for g in got])
        kind = "vis" if vision else "len"
        _, body = await self.ctx.rpc.request(
            nid, {"t": kind, "digest": self.digest, "run": self.run, "s": s, "spans": spans}
        )
        a = np.frombuffer(body or b"", dtype="<i8")
        if not vision:
            if len(a) != asked:
                raise ProtocolError(f"lengths reply of {len(a)} values for {asked} asked")
            return (a,)
        images = a[:asked]
        if len(images) != asked or len(a) != asked + int(images.sum()):
            raise ProtocolError(f"vision reply of {len(a)} values does not hold {asked} image counts and their patches")
        return images, a[asked:]


def _in_order(start: int, count: int, spans: list[list[list[int]]], res: list, vision: bool) -> tuple[np.ndarray, ...]:
    """The owners' answers for their spans put back in ordinal order: (lengths,) or (images, patches)."""
    if not vision:
        out = np.empty(count, dtype=np.int64)
        for sp, (arr,) in zip(spans, res):
            off = 0
            for a, n in sp:
                out[a - start : a - start + n] = arr[off : off + n]
                off += n
        return (out,)
    pieces: list[tuple[int, np.ndarray, np.ndarray]] = []  # (first ordinal, images, patches) per span
    for sp, (images, patches) in zip(spans, res):
        off = poff = 0
        for a, n in sp:
            im = images[off : off + n]
            k = int(im.sum())
            pieces.append((a, im, patches[poff : poff + k]))
            off, poff = off + n, poff + k
    pieces.sort(key=lambda t: t[0])
    return np.concatenate([p[1] for p in pieces]).astype(np.int64), np.concatenate([p[2] for p in pieces]).astype(
        np.int64
    )


def retryable(e: object) -> bool:
    """Whether a failed request for payloads or lengths is worth sending again once placement settles: the
    owner is gone or not ready (it closed a loader, its run had not started), the reply was garbled, or a
    read failed (transient errors are retried; ARCHITECTURE §4.5). A peer that failed on our request (RemoteError)
    or a job that does not fit (config, checkpoint) is not: the job fails with the peer's message."""
    return isinstance(e, (MsdataError, TimeoutError)) and not isinstance(e, (RemoteError, ConfigError, CheckpointError))
