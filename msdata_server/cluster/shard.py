"""A job's source partitions on one node, and the view of all partitions that its constructors build from.

Each source is split into ``nparts`` loader partitions by block (``SourceLoader(partition=(k, n))``); the
partition -> node map is ``place_sources`` over the live members. A node serves any partition it is asked for
(opening its loader on first use), so nodes that briefly disagree on placement still get every payload. The
owner frees a payload once every planned occurrence of it was fetched or skipped (counted per building node).
"""

from __future__ import annotations

import asyncio
import logging

import numpy as np

from ..errors import (
    BadSampleError,
    CheckpointError,
    ConfigError,
    MsdataError,
    PeerLostError,
    ProtocolError,
    RemoteError,
)
from ..job.images import source_transform
from ..job.payloads import loader_figures
from ..job.pieces import PieceRefs, hold_figures
from ..loader import SourceLoader
from ..sources import Source, open_source
from ..transforms import cut_piece
from .docwire import pack_docs, split_docs
from .placement import partition_costs, place_sources

__all__ = ["BLOCK", "JobShard", "ShardPayloads", "pack_docs", "split_docs"]

log = logging.getLogger(__name__)

BLOCK = 64  # SourceLoader's default batch: the unit partitions are dealt in


class JobShard:
    """Loaders of the partitions this node hosts for one job run, and batched access to all partitions."""

    def __init__(self, jobs, spec, digest: str, nparts: int, run: str):
        self.jobs = jobs  # the node's ClusterJobs (rpc, members, pool)
        self.spec = spec
        self.digest = digest
        self.run = run  # the run id peers' requests name
        self.nparts = nparts
        self.loaders: dict[tuple[int, int], SourceLoader] = {}
        self._sources: dict[tuple[int, int], Source] = {}
        self._ids_src: dict[int, Source] = {}  # one opened source per source for sample ids
        self._opening: dict[tuple[int, int], asyncio.Task] = {}
        self.refs = PieceRefs()  # payloads of partitions here held for planned pieces (per building node)
        self.cursor: list[int] | None = None  # where new loaders seek to (a recent planner position)
        self.state: dict | None = None  # the planner state at the start of the newest step received
        self.costs = partition_costs(spec.mix, spec.source_names(), nparts)
        self.closed = False

    # ---- placement --------------------------------------------------------------------------------------
    def part(self, ordinal: int) -> int:
        return (int(ordinal) // BLOCK) % self.nparts

    def placement(self) -> list[list[str]]:
        return place_sources([self.nparts] * len(self.spec.sources), self.jobs.live_nodes(), self.costs)

    def owner(self, s: int, k: int) -> str:
        return self.placement()[s][k]

    async def rebalance(self) -> None:
        """Open the loaders of the partitions placed here; close those placed elsewhere."""
        me = self.jobs.node_id
        pl = self.placement()
        for s, row in enumerate(pl):
            for k, nid in enumerate(row):
                if nid == me:
                    await self.loader(s, k)
        for s, k in list(self.loaders):
            if pl[s][k] != me:
                ld = self.loaders.pop((s, k))
                src = self._sources.pop((s, k))
                await ld.aclose()
                src.close()

    async def loader(self, s: int, k: int) -> SourceLoader:
        ld = self.loaders.get((s, k))
        if ld is not None:
            return ld
        t = self._opening.get((s, k))
        if t is None:
            t = self._opening[(s, k)] = asyncio.ensure_future(self._open(s, k))
        try:
            return await asyncio.shield(t)
        finally:
            if t.done():
                self._opening.pop((s, k), None)

    async def _open(self, s: int, k: int) -> SourceLoader:
        sp = self.spec.sources[s]
        src = await asyncio.to_thread(open_source, sp, seed=self.spec.seed)
        ld = SourceLoader(
            src,
            self.jobs.pool,
            transform=source_transform(self.spec, sp),
            seed=self.spec.seed,
            batch=BLOCK,
            partition=(k, self.nparts),
        )
        if self.cursor is not None and self.cursor[s] > 0:
            ld.seek(int(self.cursor[s]))
        await ld.start()
        if self.closed:
            await ld.aclose()
            src.close()
            raise PeerLostError("job shard closed")
        self.loaders[(s, k)] = ld
        self._sources[(s, k)] = src
        log.debug("node %s: opened partition %d/%d of %s", self.jobs.node_id, k, self.nparts, sp.name)
        return ld

    def sample_ids(self, s: int, ordinals) -> np.ndarray:
        src = self._ids_src.get(s)
        if src is None:
            src = self._ids_src[s] = open_source(self.spec.sources[s], seed=self.spec.seed)
        return src.sample_ids(np.asarray(ordinals, dtype=np.int64))

    # ---- serving (the owner side) -------------------------------------------------------------------------
    async def serve_lengths(self, s: int, start: int, count: int) -> np.ndarray:
        """Lengths of [start, start+count): any span; each block from its partition's loader."""
        out = np.empty(count, dtype=np.int64)
        end = start + count
        pos = start
        while pos < end:
            hi = min(end, (pos // BLOCK + 1) * BLOCK)
            ld = await self.loader(s, self.part(pos))
            out[pos - start : hi - start] = await ld.lengths(pos, hi - pos)
            pos = hi
        return out

    async def serve_tokens(self, src: np.ndarray, ords: np.ndarray) -> list[np.ndarray]:
        """Whole documents of these (source, ordinal) occurrences; each served occurrence drops one reference."""
        out = []
        for s, o in zip(src.tolist(), ords.tolist()):
            ld = await self.loader(s, self.part(o))
            try:
                out.append(await ld.tokens(o))
            except BadSampleError:
                out.append(np.zeros(0, dtype=np.int64))
        self.unref(src, ords)
        return out

    def _owned(self, plan, group_nodes: dict[int, tuple[str, ...]]) -> tuple[np.ndarray, list[int]]:
        """Indices of a plan's pieces owned here, and how many nodes build each."""
        me = self.jobs.node_id
        pl = self.placement()
        idx = [
            i for i, (s, o) in enumerate(zip(plan.source.tolist(), plan.ordinal.tolist())) if pl[s][self.part(o)] == me
        ]
        return np.asarray(idx, dtype=np.int64), [len(group_nodes.get(int(g), ())) for g in plan.group[idx].tolist()]

    def add_refs(self, plan, group_nodes: dict[int, tuple[str, ...]]) -> None:
        """A new plan: each occurrence of a piece owned here is fetched (or skipped) once per building node."""
        idx, n = self._owned(plan, group_nodes)
        self._free(self.refs.plan(plan.source[idx], plan.ordinal[idx], plan.last[idx], n))

    def drop_refs(self, plan, group_nodes: dict[int, tuple[str, ...]]) -> None:
        """A plan cut by a mixture change (never built): take back what add_refs counted for it."""
        idx, n = self._owned(plan, group_nodes)
        self.refs.unplan(plan.source[idx], plan.ordinal[idx], plan.last[idx], n)

    def unref(self, src, ords) -> None:
        """Occurrences fetched or skipped (one reference each)."""
        self._free(self.refs.done(src, ords))

    def _free(self, docs: list[tuple[int, int]]) -> None:
        for s, o in docs:
            ld = self.loaders.get((s, self.part(o)))
            if ld is not None:
                ld.release(np.array([o], dtype=np.int64))

    # ---- fetching (the builder side) ----------------------------------------------------------------------
    async def fetch(self, src: np.ndarray, ords: np.ndarray, offs: np.ndarray, lens: np.ndarray) -> list:
        """Pieces (token slices, or picture pieces) of a micro-batch: one request per owning node, local ones here."""
        n = len(src)
        docs: list = [None] * n
        while True:
            pl = self.placement()
            by: dict[str, list[int]] = {}
            for i, (s, o) in enumerate(zip(src.tolist(), ords.tolist())):
                if docs[i] is None:
                    by.setdefault(pl[s][self.part(o)], []).append(i)
            if not by:
                break
            results = await asyncio.gather(
                *(self._fetch_from(nid, idx, src, ords) for nid, idx in by.items()), return_exceptions=True
            )
            lost = None
            for idx, r in zip(by.values(), results):
                if retryable(r):
                    lost = r
                    continue
                if isinstance(r, BaseException):
                    raise r
                for i, d in zip(idx, r):
                    docs[i] = d
            if lost is not None:
                log.info("node %s: fetching payloads: %s; retrying after placement settles", self.jobs.node_id, lost)
                await self.jobs.members_settle()
        return [cut_piece(d, a, m) for d, a, m in zip(docs, offs.tolist(), lens.tolist())]

    async def _fetch_from(self, nid: str, idx: list[int], src: np.ndarray, ords: np.ndarray) -> list[np.ndarray]:
        s_sel, o_sel = src[idx].astype(np.int64), ords[idx].astype(np.int64)
        if nid == self.jobs.node_id:
            return await self.serve_tokens(s_sel, o_sel)
        head, payload = await self.jobs.rpc.request(
            nid, {"t": "fetch", "digest": self.digest, "run": self.run, "s": s_sel.tolist(), "o": o_sel.tolist()}
        )
        return split_docs(head, payload)

    async def skip(self, src: np.ndarray, ords: np.ndarray) -> None:
        """Occurrences this node was to build but will not (no reader at that position): drop their references."""
        pl = self.placement()
        by: dict[str, list[int]] = {}
        for i, (s, o) in enumerate(zip(src.tolist(), ords.tolist())):
            by.setdefault(pl[s][self.part(o)], []).append(i)
        for nid, idx in by.items():
            if nid == self.jobs.node_id:
                self.unref(src[idx], ords[idx])
            else:
                try:
                    await self.jobs.rpc.send(
                        nid,
                        {
                            "t": "skip",
                            "digest": self.digest,
                            "run": self.run,
                            "s": src[idx].tolist(),
                            "o": ords[idx].tolist(),
                        },
                    )
                except PeerLostError:
                    pass  # the owner is gone: its payloads went with it

    async def serve_vision(self, s: int, start: int, count: int) -> tuple[np.ndarray, np.ndarray]:
        """(images per sample, patches per image) of [start, start+count), as serve_lengths asks its loaders."""
        images, patches = [], []
        pos, end = start, start + count
        while pos < end:
            hi = min(end, (pos // BLOCK + 1) * BLOCK)
            ld = await self.loader(s, self.part(pos))
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
            pl = self.placement()
            spans: dict[str, list[list[int]]] = {}
            pos, end = start, start + count
            while pos < end:
                hi = min(end, (pos // BLOCK + 1) * BLOCK)
                spans.setdefault(pl[s][self.part(pos)], []).append([pos, hi - pos])
                pos = hi
            try:
                res = await asyncio.gather(*(self._ask_from(nid, s, sp, vision) for nid, sp in spans.items()))
            except Exception as e:
                if not retryable(e):
                    raise
                log.info("node %s: asking lengths: %s; retrying after placement settles", self.jobs.node_id, e)
                await self.jobs.members_settle()
                continue
            return _in_order(start, count, list(spans.values()), res, vision)

    async def _ask_from(self, nid: str, s: int, spans: list, vision: bool) -> tuple[np.ndarray, ...]:
        """(lengths,) or (images, patches) of the spans from node nid (this node: its loaders)."""
        asked = sum(n for _, n in spans)
        if nid == self.jobs.node_id:
            if not vision:
                return (np.concatenate([await self.serve_lengths(s, a, n) for a, n in spans]),)
            got = [await self.serve_vision(s, a, n) for a, n in spans]
            return np.concatenate([g[0] for g in got]), np.concatenate([g[1] for g in got])
        kind = "vis" if vision else "len"
        _, body = await self.jobs.rpc.request(
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

    def status(self, newest_state: dict | None) -> dict[str, dict]:
        """Per source: the partitions read here, their loaders' figures summed, and the held-payload bound."""
        out = {}
        for s, sp in enumerate(self.spec.sources):
            lds = [ld for (si, _), ld in sorted(self.loaders.items()) if si == s]
            figs = [loader_figures(ld) for ld in lds]
            summed = {k: sum(f[k] for f in figs) for k in ("samples_done", "bytes_read", "errors", "inflight")}
            out[sp.name] = {
                "partitions_here": len(lds),
                "nparts": self.nparts,
                **(summed if figs else {}),
                **hold_figures(s, lds, self.refs, newest_state),
            }
        return out

    async def aclose(self) -> None:
        self.closed = True
        for t in self._opening.values():
            t.cancel()
        for key, ld in list(self.loaders.items()):
            await ld.aclose()
            self._sources.pop(key).close()
        self.loaders.clear()
        for src in self._ids_src.values():
            src.close()
        self._ids_src.clear()


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


class ShardPayloads:
    """The cluster PayloadSource of a job: its run's shard. The run owns the shard (a node may serve data of a
    run after its own ranks left), so closing the job leaves the shard to the run's end."""

    def __init__(self, shard: JobShard):
        self.shard = shard
        self.fetch = shard.fetch
        self.skip = shard.skip
        self.sample_ids = shard.sample_ids
        self.status = shard.status

    async def aclose(self) -> None:
        """Nothing to close here: ``ClusterJobs`` closes the shard when the run ends."""
