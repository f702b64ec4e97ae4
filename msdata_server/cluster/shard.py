"""A job's source partitions on one node, and the view of all partitions that its constructors build from.

Each source is split into ``nparts`` loader partitions by block (``SourceLoader(partition=(k, n))``); the
partition -> node map is ``place_sources`` over the live members. A node serves any partition it is asked for
(opening its loader on first use), so nodes that briefly disagree on placement still get every payload. The
owner frees a payload once every planned occurrence of it was fetched or skipped (counted per building node).

Shadow loaders (``[job] shadow_loaders = N``): a node that stands by for a partition (``place_shadows``) opens
its source and builds its loader but reads nothing, and counts the partition's payload references from the
plans like its owner. When the owner's node is gone (our link to it broke, or its lease was lost, whichever
comes first: ``node_down``) the partition goes to its first live standby (``fail_over``), which seeks its
loader to the newest planner cursor it saw and serves. With shadows, the layout sticks: a node that leaves moves
only its own partitions; a node that joins (or comes back) re-deals every partition as without shadows.

Splits and merges (``parts``): the leader's partition table comes with its plans; ``repartition`` applies it
(loaders of an ended generation read ahead no further and drop what they read past its end), ``rebalance``
opens the new generation's partitions placed here, and ``retire`` closes ended ones once they hold nothing.

A shard uses the node through its ``ClusterContext`` (id, pool, live members, RPC); its reference counts
(``shardrefs.ShardRefs``) and metadata (``shardmeta.ShardMetadata``) get the layout and loaders they read.
"""

from __future__ import annotations

import asyncio
import logging
from contextlib import suppress

import numpy as np

from msdata_client.spec import JobSpec

from ..document import cut_piece
from ..errors import BadSampleError, PeerLostError
from ..job.images import source_transform
from ..job.pieces import hold_figures
from ..loader import SourceLoader
from ..planner import StepPlan
from ..sources import Source, open_source
from .context import ClusterContext
from .docwire import pack_docs, split_docs
from .placement import PartitionLayout, partition_costs
from .shardmeta import BLOCK, ShardMetadata, retryable
from .shardrefs import ShardRefs

__all__ = ["BLOCK", "JobShard", "ShardPayloads", "answer", "pack_docs", "repartition", "retire", "split_docs"]

log = logging.getLogger(__name__)


class JobShard:
    """Loaders of the partitions this node hosts for one job run, and batched access to all partitions."""

    def __init__(self, ctx: ClusterContext, spec: JobSpec, digest: str, nparts: int, run: str) -> None:
        self.ctx = ctx
        self.spec = spec
        self.digest = digest
        self.run = run  # the run id peers' requests name
        self.nparts = nparts
        self.loaders: dict[tuple[int, int], SourceLoader] = {}
        self._sources: dict[tuple[int, int], Source] = {}
        self._ids_src: dict[int, Source] = {}  # one opened source per source for sample ids
        self._opening: dict[tuple[int, int], asyncio.Task] = {}
        self.cursor: list[int] | None = None  # where new loaders seek to (a recent planner position)
        self.state: dict | None = None  # the planner state at the start of the newest step received
        self.where = PartitionLayout(  # who owns (and stands by for) each partition
            spec.name,
            len(spec.sources),
            nparts,
            int(spec.shadow_loaders),
            partition_costs(spec.mix, spec.source_names(), nparts),
            ctx.live_nodes,
            ctx.node_id,
        )
        self.closed = False
        self.n_shadows = int(spec.shadow_loaders)
        self.shadows: dict[tuple[int, int], SourceLoader] = {}  # standbys here: built, not started
        self._standing: dict[tuple[int, int], asyncio.Task] = {}
        self.takeovers = 0  # partitions taken over by a standby here
        # references to this node's (and its stood-by) partitions' payloads
        self.counts = ShardRefs(
            ctx.node_id, self.where, self.loaders, prefetch_steps=int(spec.prefetch_steps), n_shadows=self.n_shadows
        )
        self.refs = self.counts.refs  # payloads of partitions here held for planned pieces (per building node)
        # lengths and vision figures of any partition, for the planner
        self.meta = ShardMetadata(ctx, self.where, self.loader, digest=digest, run=run)

    # ---- placement --------------------------------------------------------------------------------------
    def part(self, s: int, ordinal: int) -> int:
        return self.where.table.part(s, ordinal)

    def placement(self) -> list[list[str]]:
        return self.where.placement()

    @property
    def costs(self) -> list[float]:
        return self.where.costs

    @costs.setter
    def costs(self, costs: list[float]) -> None:
        self.where.costs = costs

    async def rebalance(self) -> None:
        """Open the loaders of the partitions placed here (a standby here takes over first), build the standbys
        placed here; close those placed elsewhere."""
        me = self.ctx.node_id
        if self.n_shadows:
            pl, sh = self.where.layout()
        else:
            pl, sh = self.placement(), [[() for _ in row] for row in self.placement()]
        for s, k in [(s, k) for s, k in self.shadows if pl[s][k] == me]:
            await self.loader(s, k)  # a takeover: no open, no index build
        for s, row in enumerate(pl):
            for k, nid in enumerate(row):
                if nid == me:
                    await self.loader(s, k)
        for s, k in list(self.loaders):
            if pl[s][k] != me:
                await self.close_loader(self.loaders.pop((s, k)), (s, k))
        for s, standbys in enumerate(sh):
            for k, nids in enumerate(standbys):
                if me in nids and (s, k) not in self.loaders:
                    await self.standby(s, k)
        for s, k in list(self.shadows):
            if me not in sh[s][k]:
                await self.close_loader(self.shadows.pop((s, k)), (s, k))

    async def close_loader(self, ld: SourceLoader, key: tuple[int, int]) -> None:
        src = self._sources.pop(key)
        await ld.aclose()
        src.close()

    async def standby(self, s: int, k: int) -> None:
        """Stand by for partition (s, k): its source open, its loader built, nothing read."""
        if (s, k) in self.shadows or (s, k) in self.loaders:
            return
        t = self._standing.get((s, k))
        if t is None:
            t = self._standing[(s, k)] = asyncio.ensure_future(self._build(s, k))
        try:
            src, ld = await asyncio.shield(t)
        finally:
            if t.done():
                self._standing.pop((s, k), None)
        if self.closed or (s, k) in self.loaders or (s, k) in self.shadows:
            await ld.aclose()  # the partition was opened here meanwhile (a takeover came first)
            src.close()
            return
        self.shadows[(s, k)] = ld
        self._sources[(s, k)] = src
        log.debug("node %s: standing by for partition %d/%d of %s", self.ctx.node_id, k, self.nparts, src.name)

    async def _take_over(self, s: int, k: int) -> SourceLoader:
        """A standby here becomes the partition's loader: it seeks to the newest planner cursor seen, reads."""
        ld = self.shadows.pop((s, k))
        if self.cursor is not None and self.cursor[s] > 0:
            ld.seek(int(self.cursor[s]))
        self.loaders[(s, k)] = ld
        self.takeovers += 1
        await ld.start()
        log.info(
            "node %s: took over partition %d/%d of %s (standby, seek to %s)",
            self.ctx.node_id,
            k,
            self.nparts,
            ld.name,
            None if self.cursor is None else self.cursor[s],
        )
        return ld

    async def loader(self, s: int, k: int) -> SourceLoader:
        ld = self.loaders.get((s, k))
        if ld is not None:
            return ld
        if (s, k) in self.shadows:
            return await self._take_over(s, k)
        t = self._opening.get((s, k))
        if t is None:
            t = self._opening[(s, k)] = asyncio.ensure_future(self._open(s, k))
        try:
            return await asyncio.shield(t)
        finally:
            if t.done():
                self._opening.pop((s, k), None)

    async def _build(self, s: int, k: int) -> tuple[Source, SourceLoader]:
        """Partition (s, k)'s source opened (files, indexes) and its loader built, not started (one of an
        ended generation reads ahead no further than its end)."""
        sp = self.spec.sources[s]
        gen, kk, end = self.where.table.slot(s, k)
        src = await asyncio.to_thread(open_source, sp, seed=self.spec.seed, on_read_error=self.spec.on_read_error)
        ld = SourceLoader(
            src,
            self.ctx.pool,
            transform=source_transform(self.spec, sp),
            seed=self.spec.seed,
            batch=BLOCK,
            partition=(kk, gen.n),
        )
        if end is not None:
            ld.stop_at(end)
        return src, ld

    async def _open(self, s: int, k: int) -> SourceLoader:
        sp = self.spec.sources[s]
        src, ld = await self._build(s, k)
        at = max(0 if self.cursor is None else int(self.cursor[s]), self.where.table.slot(s, k)[0].start * BLOCK)
        if at > 0:
            ld.seek(at)
        await ld.start()
        if self.closed:
            await ld.aclose()
            src.close()
            raise PeerLostError("job shard closed")
        self.loaders[(s, k)] = ld
        self._sources[(s, k)] = src
        log.debug("node %s: opened partition %d/%d of %s", self.ctx.node_id, k, self.nparts, sp.name)
        return ld

    def sample_ids(self, s: int, ordinals: np.ndarray) -> np.ndarray:
        src = self._ids_src.get(s)
        if src is None:
            src = self._ids_src[s] = open_source(self.spec.sources[s], seed=self.spec.seed)
        return src.sample_ids(np.asarray(ordinals, dtype=np.int64))

    # ---- serving (the owner side) -------------------------------------------------------------------------
    async def serve_lengths(self, s: int, start: int, count: int) -> np.ndarray:
        return await self.meta.serve_lengths(s, start, count)

    async def serve_vision(self, s: int, start: int, count: int) -> tuple[np.ndarray, np.ndarray]:
        return await self.meta.serve_vision(s, start, count)

    async def lengths(self, s: int, start: int, count: int) -> np.ndarray:
        return await self.meta.lengths(s, start, count)

    async def vision(self, s: int, start: int, count: int) -> tuple[np.ndarray, np.ndarray]:
        return await self.meta.vision(s, start, count)

    async def serve_tokens(self, src: np.ndarray, ords: np.ndarray) -> list[np.ndarray]:
        """Whole documents of these (source, ordinal) occurrences; each served occurrence drops one reference."""
        out = []
        for s, o in zip(src.tolist(), ords.tolist()):
            ld = await self.loader(s, self.part(s, o))
            try:
                out.append(await ld.tokens(o))
            except BadSampleError:
                out.append(np.zeros(0, dtype=np.int64))
        self.unref(src, ords)
        return out

    def add_refs(self, plan: StepPlan, group_nodes: dict[int, tuple[str, ...]]) -> None:
        self.counts.add(plan, group_nodes)

    def skip_refs(self, plan: StepPlan) -> None:
        self.counts.skipped(plan)

    def drop_refs(self, plan: StepPlan, group_nodes: dict[int, tuple[str, ...]]) -> None:
        self.counts.drop(plan, group_nodes)

    def unref(self, src: np.ndarray, ords: np.ndarray) -> None:
        self.counts.done(src, ords)

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
                    by.setdefault(pl[s][self.part(s, o)], []).append(i)
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
                log.info("node %s: fetching payloads: %s; retrying after placement settles", self.ctx.node_id, lost)
                if self.placement() == pl:  # a standby may have taken over already: then at once
                    await self.ctx.members_settle()
        return [cut_piece(d, a, m) for d, a, m in zip(docs, offs.tolist(), lens.tolist())]

    async def _fetch_from(self, nid: str, idx: list[int], src: np.ndarray, ords: np.ndarray) -> list[np.ndarray]:
        s_sel, o_sel = src[idx].astype(np.int64), ords[idx].astype(np.int64)
        if nid == self.ctx.node_id:
            return await self.serve_tokens(s_sel, o_sel)
        head, payload = await self.ctx.rpc.request(
            nid, {"t": "fetch", "digest": self.digest, "run": self.run, "s": s_sel.tolist(), "o": o_sel.tolist()}
        )
        return split_docs(head, payload)

    async def skip(self, src: np.ndarray, ords: np.ndarray) -> None:
        """Occurrences this node was to build but will not (no reader at that position): drop their references."""
        pl = self.placement()
        by: dict[str, list[int]] = {}
        for i, (s, o) in enumerate(zip(src.tolist(), ords.tolist())):
            by.setdefault(pl[s][self.part(s, o)], []).append(i)
        for nid, idx in by.items():
            if nid == self.ctx.node_id:
                self.unref(src[idx], ords[idx])
            else:
                with suppress(PeerLostError):  # the owner is gone: its payloads went with it
                    await self.ctx.rpc.send(
                        nid,
                        {
                            "t": "skip",
                            "digest": self.digest,
                            "run": self.run,
                            "s": src[idx].tolist(),
                            "o": ords[idx].tolist(),
                        },
                    )

    def status(self, newest_state: dict | None) -> dict[str, dict]:
        """Per source: the partitions read here, their loaders' figures summed, and the held-payload bound."""
        out = {}
        for s, sp in enumerate(self.spec.sources):
            lds = [ld for (si, _), ld in sorted(self.loaders.items()) if si == s]
            figs = [ld.statistics().figures() for ld in lds]
            keys = ("samples_done", "bytes_read", "tokens_read", "read_s", "errors", "inflight")  # read_s..: autoscale
            summed = {k: sum(f[k] for f in figs) for k in keys}
            out[sp.name] = {
                "partitions_here": len(lds),
                "shadows_here": sum(1 for si, _ in self.shadows if si == s),
                "nparts": self.nparts,
                "partitions": self.where.table.partitions(s),  # the run's, over all nodes (splits and merges)
                **(summed if figs else {}),
                **hold_figures(s, lds, self.refs, newest_state),
            }
        return out

    async def aclose(self) -> None:
        self.closed = True
        for t in [*self._opening.values(), *self._standing.values()]:
            t.cancel()
        for key, ld in [*self.loaders.items(), *self.shadows.items()]:
            await ld.aclose()
            self._sources.pop(key).close()
        self.loaders.clear()
        self.shadows.clear()
        for src in self._ids_src.values():
            src.close()
        self._ids_src.clear()


def repartition(shard: JobShard, wire: object) -> bool:
    """Apply the leader's partition table (``parts``; ValueError if malformed); True when it changed: the
    caller then rebalances. Loaders of a generation that ended read ahead no further (and drop what they read
    past its end: the new generation reads it)."""
    table = shard.where.table.applied(wire)
    if table == shard.where.table:
        return False
    shard.where.table = table
    for (s, k), ld in [*shard.loaders.items(), *shard.shadows.items()]:
        end = table.slot(s, k)[2]
        if end is not None:
            ld.stop_at(end)
    return True


def retire(shard: JobShard) -> None:
    """Close the loaders here of ended generations that hold nothing and that the planner passed (a piece
    asked for later opens one again: it reads that sample once more, uncached)."""
    for (s, k), ld in list(shard.loaders.items()):
        end, st = shard.where.table.slot(s, k)[2], ld.statistics()
        passed = shard.cursor is not None and end is not None and int(shard.cursor[s]) >= end * BLOCK
        if passed and not (st.ready or st.inflight):
            shard.ctx.tasks.spawn(shard.close_loader(shard.loaders.pop((s, k)), (s, k)), name="shard-retire")


async def answer(shard: JobShard, frame: dict) -> tuple[dict, bytes]:
    """A peer's data request answered from this node's partitions: ``len`` (lengths of spans), ``vis`` (images
    per sample of the spans, then the patches of each image) or ``fetch`` (whole documents, packed)."""
    if frame["t"] == "len":
        s = int(frame["s"])
        parts = [await shard.serve_lengths(s, int(a), int(n)) for a, n in frame["spans"]]
        lengths = np.concatenate(parts) if parts else np.zeros(0, np.int64)
        return {}, lengths.astype("<i8", copy=False).tobytes()
    if frame["t"] == "vis":
        got = [await shard.serve_vision(int(frame["s"]), int(a), int(n)) for a, n in frame["spans"]]
        body = [g[0] for g in got] + [g[1] for g in got]
        return {}, np.concatenate([np.zeros(0, "<i8"), *body]).astype("<i8").tobytes()
    docs = await shard.serve_tokens(np.asarray(frame["s"], np.int64), np.asarray(frame["o"], np.int64))
    return pack_docs(docs)


class ShardPayloads:
    """The cluster PayloadSource of a job: its run's shard. The run owns the shard (a node may serve data of a
    run after its own ranks left), so closing the job leaves the shard to the run's end."""

    def __init__(self, shard: JobShard) -> None:
        self.shard = shard
        self.fetch = shard.fetch
        self.skip = shard.skip
        self.sample_ids = shard.sample_ids
        self.status = shard.status

    async def repartition(self, source: str, n: int) -> bool:
        return False  # the leader splits and merges a run's partitions (``Scaler.repartition``)

    async def aclose(self) -> None:
        """Nothing to close here: ``ClusterJobs`` closes the shard when the run ends."""
