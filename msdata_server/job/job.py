"""One training job on a node server: its ranks, source loaders, planner loop and data constructors.

Data path per step: the planner (in a thread) turns loader metadata into a StepPlan; each receiving group's
constructor builds its micro-batches once, in place, in a slot of its ring, and sends a small notice to every
reader of that group (TP ranks share the slot; CP ranks read their own zig-zag slice; PP stages see their
fields). Buffers are bounded: group queues hold at most ``prefetch_steps`` steps, rings ``ring_slots`` slots,
loaders their read-ahead; a full ring makes the constructor wait for releases, never drop or overwrite.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import logging
import threading
import time
import uuid
from collections import deque
from dataclasses import dataclass, field

import numpy as np

from msdata_client.graph import JobSpec
from msdata_client.ring import HEADER_SIZE, FieldLayout, SlotTable, layout_fields

from .constructor import MicroBatchPieces, build_micro_batch, count_segments, field_specs
from .errors import CheckpointError, ClosedError, ConfigError, MsdataError, RingFullError
from .checkpoint import StateStore, start_from_states
from .loader import SourceLoader
from .pieces import PieceRefs, hold_figures
from .planner import Mixture, Planner, PlannerConfig
from .shm import Segment, create_segment
from .sources import open_source
from .tasks import TaskSet

__all__ = ["BATCH_FIELDS", "Job", "RankPosition"]

BATCH_FIELDS = ("tokens", "labels", "loss_mask", "position_ids", "cu_seqlens", "sample_ids", "source_ids", "step",
                "micro")

log = logging.getLogger(__name__)

_THREAD_BUILD_BYTES = 4 << 20  # build larger micro-batches in a thread so the loop keeps serving


@dataclass(frozen=True, slots=True, order=True)
class RankPosition:
    """The next micro-batch a rank expects: (step, micro)."""

    step: int = 0
    micro: int = 0


class ServerRing:
    """One segment of fixed-size slots and the bookkeeping of who still reads which slot."""

    def __init__(self, rid: int, seg: Segment, slots: int, slot_size: int):
        self.id = rid
        self.seg = seg
        self.slot_size = slot_size
        self.table = SlotTable(slots)
        self.freed = asyncio.Event()
        self.buf = np.frombuffer(seg.mm, dtype=np.uint8)

    def describe(self) -> dict:
        return {"id": self.id, "slots": self.table.slots, "slot_size": self.slot_size, "base": HEADER_SIZE}

    def offset(self, slot: int) -> int:
        return HEADER_SIZE + slot * self.slot_size

    def views(self, slot: int, layouts: list[FieldLayout]) -> dict[str, np.ndarray]:
        base = self.offset(slot)
        out = {}
        for f in layouts:
            a = self.buf[base + f.offset : base + f.offset + f.nbytes].view(np.dtype(f.dtype))
            out[f.name] = a.reshape(f.shape)
        return out

    def close(self) -> None:
        self.buf = None
        self.seg.close()


def _round_slot(nbytes: int) -> int:
    """Slot sizes are powers of two of at least 64 KiB (page multiples, few distinct sizes)."""
    return max(1 << 16, 1 << (max(nbytes, 1) - 1).bit_length())


class StepQueue:
    """Bounded FIFO of step plans for one group: at most ``maxsize`` plans wait; a mixture change can drop
    the plans of steps it re-plans. One producer (the plan loop) and one consumer (the constructor)."""

    def __init__(self, maxsize: int):
        self.maxsize = maxsize
        self.items: deque = deque()
        self._space = asyncio.Event()
        self._data = asyncio.Event()

    async def put(self, plan, wanted) -> bool:
        """Append when there is room; False (nothing appended) once ``wanted()`` says the plan was dropped."""
        while len(self.items) >= self.maxsize and wanted():
            self._space.clear()
            await self._space.wait()
        if not wanted():
            return False
        self.items.append(plan)
        self._data.set()
        return True

    async def get(self):
        while not self.items:
            self._data.clear()
            await self._data.wait()
        plan = self.items.popleft()
        self._space.set()
        return plan

    def drop_from(self, step: int) -> list:
        dropped = [p for p in self.items if p.step >= step]
        self.items = deque(p for p in self.items if p.step < step)
        self._space.set()  # also wakes a producer whose plan was dropped
        return dropped


@dataclass
class Group:
    """A receiving rank group: one distinct data stream, its ring(s) and its bounded queue of steps."""

    index: int
    readers: tuple[int, ...]
    queue: StepQueue
    committed: int = -1  # the newest step this group's constructor has taken up (never re-planned)
    rings: dict[int, ServerRing] = field(default_factory=dict)
    current: ServerRing | None = None
    published: int = 0
    bytes_published: int = 0


class Job:
    """A registered job. Starts when every rank of its mesh has registered (the start barrier)."""

    def __init__(self, node, spec: JobSpec, digest: str, *, hold: bool = False):
        self.node = node
        self.spec = spec
        self.digest = digest
        self.mesh = spec.mesh
        self.name = spec.name
        self.conns: dict[int, object] = {}  # rank -> ClientConn
        self.positions: dict[int, RankPosition] = {}
        self.state = "waiting"  # waiting -> running -> closed
        self.error: str | None = None
        self.tasks = TaskSet(f"job {spec.name}", on_error=self._task_failed)
        self.groups: list[Group] = []
        self.loaders: list[SourceLoader] = []
        self.planner: Planner | None = None
        self._ring_ids = 0
        self.refs = PieceRefs()  # payloads held for planned pieces not yet built
        self.started_at: float | None = None
        self.plan_stats: list = []  # recent per-step statistics (bounded)
        self.steps_planned = 0
        self._totals = {"imbalance": 0.0, "padding": 0.0, "plan_ms": 0.0}
        self._tokens: dict[str, int] = {}
        self._start_lock = asyncio.Lock()
        self._view: _LoaderView | None = None
        self._cp = 1
        self._selectors: dict[int, tuple[set, str]] = {}  # rank -> (fields it reads, its CP index)
        self.states: dict[int, dict | None] = {}  # rank -> the state it brought (load_state_dict), if any
        self.resuming: dict[int, bool] = {}  # rank -> it reconnects mid-run (continue where it was)
        self.snapshots: dict[int, dict] = {}  # step -> planner state at the start of that step (recent steps)
        self.store = StateStore(node.config.node.state_path, spec.name, digest)
        self._plan_lock = asyncio.Lock()  # the planner is touched by one coroutine (or its thread) at a time
        self._inflight = None  # the plan being handed to the groups
        self._cut = None  # plans of steps >= cut were dropped by a mixture change
        self._started = asyncio.Event()
        self._may_start = asyncio.Event()  # a new run waits here until the previous run of the job has left
        if not hold:
            self._may_start.set()
        self._pcfg: PlannerConfig | None = None
        self.start_step = 0
        self.remote = None  # cluster mode: the Run (msdata_server.cluster.jobs) that brings the leader's plans
        self.inst = uuid.uuid4().hex[:16]  # this registration of the job on this node (the leader tells runs apart)

    # ---- ranks --------------------------------------------------------------------------------------
    @property
    def connected(self) -> int:
        return sum(1 for c in self.conns.values() if not c.closed)

    def live_ranks(self) -> list[int]:
        """Ranks whose client is still there (a client that hung up but whose EOF is unread is not)."""
        return [r for r, c in self.conns.items() if not c.gone()]

    def may_start(self) -> None:
        self._may_start.set()

    def check_rank(self, rank: int, world_size: int) -> None:
        ws = self.mesh.world_size
        if world_size != ws:
            raise ConfigError(f"rank {rank} says world_size={world_size} but job {self.name!r} has a mesh of {ws} ranks "
                              f"({self.mesh.to_dict()}); make WORLD_SIZE and the [mesh] agree")
        if not 0 <= rank < ws:
            raise ConfigError(f"rank {rank} is outside the world of job {self.name!r} (world_size={ws}); ranks are 0..{ws - 1}")
        old = self.conns.get(rank)
        if old is not None and not old.gone():
            raise ConfigError(f"rank {rank} of job {self.name!r} is already connected (pid {old.pid}); "
                              "two trainer processes claim the same RANK (for a new run, stop the old one first)")

    def check_state(self, state: dict | None) -> None:
        """A state a rank brings must belong to this job's data identity (any layout)."""
        if state is None:
            return
        if not isinstance(state, dict) or not isinstance(state.get("planner"), dict):
            raise CheckpointError("the state has no planner position; it is truncated or not an msdata state")
        if state.get("data_digest") != self.spec.data_digest():
            raise CheckpointError(f"the state belongs to another data identity than job {self.name!r} (name, seed, "
                                  "sources, transforms, mixture or cost differ); restore it into the job that saved it")

    async def attach(self, conn, rank: int, position: RankPosition, state: dict | None = None,
                     resume: bool = False) -> None:
        """Register a rank; when the mesh is complete, start (or resume) the job."""
        self.conns[rank] = conn
        self.positions[rank] = position
        self.states[rank] = state
        self.resuming[rank] = resume
        conn.job, conn.rank = self, rank
        if self.state == "running":
            self._welcome(rank)
            return
        if self.node.cluster_jobs is not None:  # cluster: the leader starts the job once the whole mesh is in
            self.node.cluster_jobs.changed()
            return
        if len(self.conns) == self.mesh.world_size and all(not c.closed for c in self.conns.values()):
            await self._may_start.wait()
            async with self._start_lock:
                if self.state == "waiting":
                    try:
                        await self._start()
                    except MsdataError as e:  # e.g. ranks brought disagreeing states: tell every rank
                        self.fail(str(e), kind=type(e).__name__)

    def detach(self, conn) -> None:
        """A rank's socket closed: free every slot it held so the other readers never stall."""
        rank = conn.rank
        if rank is None or self.conns.get(rank) is not conn:
            return
        for g in self.groups:
            for ring in list(g.rings.values()):
                if ring.table.drop_reader(rank):
                    ring.freed.set()
        if self.node.cluster_jobs is not None:
            self.node.cluster_jobs.changed()
        log.info("job %s: rank %d disconnected (%d of %d still connected)", self.name, rank, self.connected, self.mesh.world_size)

    # ---- start ---------------------------------------------------------------------------------------
    def _layout(self) -> dict:
        return {"mesh": self.mesh.to_dict(), "micro_batches": self.spec.micro_batches, "rows": self.spec.rows}

    def _start_state(self) -> dict | None:
        """Where the job starts: a state the ranks brought (all that bring one must agree), else the node's own
        checkpoint when ranks reconnect after a restart, else the beginning. Sets every rank's position."""
        if any(st is not None for st in self.states.values()):
            planner, positions = start_from_states({r: self.states.get(r) for r in self.positions}, self._layout())
            self.positions.update({r: RankPosition(*p) for r, p in positions.items()})
            self.store.clear()
            return planner
        if any(self.resuming.values()):
            resumed = [p for r, p in self.positions.items() if self.resuming[r]]
            low = min(resumed)
            for r in self.positions:
                if not self.resuming[r]:
                    self.positions[r] = RankPosition(low.step, 0)
            found = self.store.load_at_or_before(low.step)
            if found is not None:
                log.info("job %s: continuing from the node's checkpoint of step %d (ranks at step %d)", self.name,
                         found[0], low.step)
                return found[1]
            log.warning("job %s: no checkpoint at or before step %d; replaying from the beginning", self.name, low.step)
            return None
        self.store.clear()  # a new run: whatever the node remembers of an old one does not apply
        for r in self.positions:
            self.positions[r] = RankPosition(0, 0)
        return None

    async def _start(self, cluster=None) -> None:
        spec = self.spec
        cfg = self.node.config.node
        if cluster is not None:  # the leader decided the start; its plans arrive over the peer links
            state, self.remote, self.loaders = None, cluster, cluster.loaders
            self.positions.update({r: p for r, p in cluster.positions.items() if r in self.positions})
        else:
            state = self._start_state()
        start = min(self.positions.values())
        if cluster is None:
            # sources open in a thread: opening many files must not stall the loop
            sources = await asyncio.to_thread(lambda: [open_source(s, seed=spec.seed) for s in spec.sources])
            self.loaders = [
                SourceLoader(src, self.node.pool, transform=s.transform, seed=spec.seed)
                for src, s in zip(sources, spec.sources)
            ]
            cursor = (state or {}).get("cursor") or [0] * len(self.loaders)
            for ld, at in zip(self.loaders, cursor):
                ld.seek(int(at))  # a resumed job reads on from its position (carried pieces: on demand)
                await ld.start()
        ngroups = self.mesh.data_groups(spec.distribute)
        if spec.mix.schedule:
            mixture = Mixture.schedule([(st, dict(w)) for st, w in spec.mix.schedule], interpolate=spec.mix.interpolate)
        else:
            mixture = Mixture.constant(dict(spec.mix.weights))
        self._pcfg = PlannerConfig(
            sources=spec.source_names(), seq_len=spec.seq_len, dp=ngroups, micro_batches=spec.micro_batches,
            rows=spec.rows, method=spec.balance.method, alpha=spec.balance.alpha, beta=spec.balance.beta,
            cost_fn=None if spec.balance.cost == "attention" else spec.balance.cost,
            long_docs=spec.long_docs, mixture=mixture)
        if cluster is None:
            self.planner = Planner(self._pcfg, state=state)
            self.start_step = self.planner.step
        else:
            self.start_step = cluster.start_step
        cp = self.mesh.cp if spec.distribute != "world" else 1
        self._cp = cp
        est = _estimate_slot(spec, cp)
        for g in range(ngroups):
            grp = Group(index=g, readers=self.mesh.readers(g, spec.distribute),
                        queue=StepQueue(spec.prefetch_steps), committed=self.start_step - 1)
            if cluster is None or any(r in self.conns for r in grp.readers):  # cluster: groups read here
                grp.current = await self._new_ring(grp, est)
            self.groups.append(grp)
        self.state = "running"
        self.started_at = time.monotonic()
        log.info("job %s started: %d ranks, %d groups, ring %d x %.1f MiB, from step %d micro %d", self.name,
                 self.mesh.world_size, ngroups, cfg.ring_slots, est / 2**20, start.step, start.micro)
        for rank in sorted(self.conns):
            self._welcome(rank)
        self._started.set()
        if cluster is None:
            self.tasks.spawn(self._plan_loop(), name=f"{self.name}-planner")
        else:
            self.node.cluster_jobs.started(cluster, self)
        for grp in self.groups:
            if grp.current is not None:
                self.tasks.spawn(self._construct_loop(grp), name=f"{self.name}-constructor-{grp.index}")

    async def _new_ring(self, grp: Group, slot_size: int) -> ServerRing:
        cfg = self.node.config.node
        if slot_size > cfg.max_slot_mib << 20:
            raise RingFullError(f"a micro-batch of job {self.name!r} needs {slot_size / 2**20:.1f} MiB, more than "
                                f"max_slot_mib={cfg.max_slot_mib}; lower rows/seq_len or raise [node] max_slot_mib")
        self._ring_ids += 1
        seg = await asyncio.to_thread(create_segment, cfg.shm_prefix, "ring", cfg.ring_slots * slot_size,
                                      info={"job": self.name, "group": grp.index})
        ring = ServerRing(self._ring_ids, seg, cfg.ring_slots, slot_size)
        grp.rings[ring.id] = ring
        return ring

    def _welcome(self, rank: int) -> None:
        conn = self.conns[rank]
        grp = self.groups[self.mesh.group_of(rank, self.spec.distribute)]
        rings = [r for r in grp.rings.values()]
        conn.send({"t": "welcome", "node": self.node.config.node.id, "job": self.name, "rank": rank,
                   "group": grp.index, "rings": [r.describe() for r in rings], "fds": len(rings)},
                  fds=[r.seg.fd for r in rings])

    # ---- planning -------------------------------------------------------------------------------------
    async def _plan_loop(self) -> None:
        view = self._view = _LoaderView(self.loaders, asyncio.get_running_loop())
        keep = max(64, self.spec.prefetch_steps + self.node.config.node.ring_slots + 4)
        while True:
            async with self._plan_lock:
                planner = self.planner
                step = planner.step
                snap = planner.state_dict()
                self.snapshots[step] = snap
                for old in [s for s in self.snapshots if s <= step - keep]:
                    del self.snapshots[old]
                await asyncio.to_thread(self.store.save, step, snap)  # small; a SIGKILL loses nothing
                plan = await asyncio.to_thread(planner.plan_step, view)
                self._inflight = plan
            self.steps_planned += 1
            self._record_stats(plan)
            self._count_pieces(plan)
            for grp in self.groups:
                if not await grp.queue.put(plan, lambda: self._inflight is plan):
                    break  # a mixture change re-plans this step
            self._inflight = None

    async def set_mixture(self, weights: dict) -> int:
        """Use these weights from the first step not yet published to any rank (returned); steps planned past
        it are re-planned. Recorded in the planner state (and the node's checkpoint) before returning."""
        await self._started.wait()
        if self.remote is not None:  # cluster: the leader cuts at the first step no node has taken up
            return await self.node.cluster_jobs.set_mixture(self.remote, weights)
        async with self._plan_lock:
            cut = max(g.committed for g in self.groups) + 1
            base = self.planner.state_dict() if cut == self.planner.step else self.snapshots.get(cut)
            if base is None:
                raise CheckpointError(f"no planner state for step {cut} (internal: snapshots {sorted(self.snapshots)})")
            planner = Planner(self._pcfg, state=base)
            planner.set_mixture(cut, weights)  # ConfigError for unknown sources or bad weights: nothing changed
            dropped = {}
            for grp in self.groups:
                for p in grp.queue.drop_from(cut):
                    dropped[id(p)] = p
            if self._inflight is not None and self._inflight.step >= cut:
                dropped[id(self._inflight)] = self._inflight
                self._inflight = None
            for p in dropped.values():
                self._uncount_pieces(p)
            self.planner = planner
            for s in [s for s in self.snapshots if s > cut]:
                del self.snapshots[s]
            self.snapshots[cut] = planner.state_dict()
            await asyncio.to_thread(self.store.save, cut, self.snapshots[cut])
        log.info("job %s: mixture %s from step %d (%d planned steps re-planned)", self.name, weights, cut, len(dropped))
        return cut

    async def state_at(self, step: int) -> dict:
        """The planner state at the start of ``step`` (for a rank's state_dict)."""
        await self._started.wait()
        if self.remote is not None:
            return await self.remote.state_at(step)
        async with self._plan_lock:
            if step == self.planner.step:
                return self.planner.state_dict()
            snap = self.snapshots.get(step)
        if snap is None:
            raise CheckpointError(f"the server no longer holds the state of step {step} (it keeps recent steps "
                                  f"{min(self.snapshots, default=0)}..{self.planner.step}); call state_dict() at the "
                                  "position you checkpoint")
        return snap

    def _record_stats(self, plan) -> None:
        st = plan.stats
        self.plan_stats.append(st)
        del self.plan_stats[:-64]
        self._totals["imbalance"] += st.imbalance
        self._totals["padding"] += st.padding_fraction
        self._totals["plan_ms"] += st.plan_ms
        for name, n in st.tokens.items():
            self._tokens[name] = self._tokens.get(name, 0) + int(n)

    def _count_pieces(self, plan) -> None:
        self._free(self.refs.plan(plan.source, plan.ordinal, plan.last))

    def _done_pieces(self, sources: np.ndarray, ordinals: np.ndarray) -> None:
        self._free(self.refs.done(sources, ordinals))

    def _free(self, docs: list[tuple[int, int]]) -> None:
        for s, ords in self.refs.by_source(docs).items():
            self.loaders[s].release(ords)

    def _uncount_pieces(self, plan) -> None:
        """A dropped plan's pieces will be planned again: forget them without freeing their payloads."""
        self.refs.unplan(plan.source, plan.ordinal, plan.last)

    # ---- constructing ---------------------------------------------------------------------------------
    async def _construct_loop(self, grp: Group) -> None:
        if self.remote is not None:
            return await self._construct_remote(grp)
        scratch: dict = {}
        while True:
            plan = await grp.queue.get()
            grp.committed = plan.step  # from here on this step is built as planned, whatever happens
            for m, sl in self._micro_slices(grp, plan):
                src, ords = plan.source[sl], plan.ordinal[sl]
                readers = self._readers(grp, RankPosition(plan.step, m))
                if not readers:
                    self._done_pieces(src, ords)
                    continue
                toks = []
                for s, o, a, n in zip(src.tolist(), ords.tolist(), plan.offset[sl].tolist(), plan.length[sl].tolist()):
                    doc = await self.loaders[s].tokens(o)
                    toks.append(doc[a : a + n])
                await self._build_one(grp, plan, m, sl, toks, readers, scratch)

    async def _construct_remote(self, grp: Group) -> None:
        """Cluster: a step's payloads are fetched (one request per owning node) while the step before is built."""
        staged: asyncio.Queue = asyncio.Queue(1)

        async def fetcher():
            while True:
                plan = await grp.queue.get()
                if not await self.remote.take(plan):
                    continue  # a mixture change cut this step while it waited at the gate
                grp.committed = plan.step  # from here on this step is built as planned, whatever happens
                want, skip = [], []
                for m, sl in self._micro_slices(grp, plan):
                    (want if self._readers(grp, RankPosition(plan.step, m)) else skip).append((m, sl))
                if skip:
                    src = np.concatenate([plan.source[sl] for _, sl in skip])
                    ords = np.concatenate([plan.ordinal[sl] for _, sl in skip])
                    await self.loaders.skip(src, ords)
                    self._done_pieces(src, ords)
                toks = []
                if want:
                    cat = [np.concatenate([getattr(plan, k)[sl] for _, sl in want])
                           for k in ("source", "ordinal", "offset", "length")]
                    toks = await self.loaders.fetch(*cat)
                await staged.put((plan, want, toks))

        feeding = self.tasks.spawn(fetcher(), name=f"{self.name}-fetch-{grp.index}")
        scratch: dict = {}
        try:
            while True:
                plan, want, toks = await staged.get()
                at = 0
                for m, sl in want:
                    n = sl.stop - sl.start
                    part, at = toks[at : at + n], at + n
                    readers = self._readers(grp, RankPosition(plan.step, m))
                    if readers:
                        await self._build_one(grp, plan, m, sl, part, readers, scratch)
                    else:  # its readers left meanwhile
                        self._done_pieces(plan.source[sl], plan.ordinal[sl])
        finally:
            feeding.cancel()

    def _micro_slices(self, grp: Group, plan):
        """(micro-batch, slice of the plan) of this group's micro-batches of a step, in order."""
        mb = self.spec.micro_batches
        key = plan.dp.astype(np.int64) * mb + plan.micro
        for m in range(mb):
            lo, hi = np.searchsorted(key, [grp.index * mb + m, grp.index * mb + m + 1])
            yield m, slice(int(lo), int(hi))

    def _readers(self, grp: Group, pos: RankPosition) -> list[int]:
        """The group's ranks that read the micro-batch at pos (connected, and not resuming past it)."""
        return [r for r in grp.readers if (c := self.conns.get(r)) is not None and not c.closed and self.positions[r] <= pos]

    async def _build_one(self, grp: Group, plan, m: int, sl: slice, toks: list, readers: list[int],
                         scratch: dict) -> None:
        spec = self.spec
        pos = RankPosition(plan.step, m)
        src, ords = plan.source[sl], plan.ordinal[sl]
        sids = np.empty(len(src), dtype=np.int64)
        for s in np.unique(src).tolist():
            sel = src == s
            sids[sel] = self.loaders[s].sample_ids(ords[sel])
        pieces = MicroBatchPieces(row=plan.row[sl], tokens=toks, sample_ids=sids, source_ids=src.astype(np.int64))
        nseg = count_segments(pieces, spec.rows, spec.seq_len)
        layouts, nbytes = layout_fields(field_specs(rows=spec.rows, seq_len=spec.seq_len, n_pieces=len(toks),
                                                    n_segments=nseg, cp=self._cp))
        ring, slot = await self._acquire(grp, nbytes)
        try:
            out = ring.views(slot, layouts)
            kw = dict(rows=spec.rows, seq_len=spec.seq_len, pad_id=spec.pad_id, cp=self._cp, step=pos.step,
                      micro=pos.micro, scratch=scratch)
            if nbytes >= _THREAD_BUILD_BYTES:
                await asyncio.to_thread(build_micro_batch, out, pieces, **kw)
            else:
                build_micro_batch(out, pieces, **kw)
            del out
        except BaseException:
            ring.table.abandon(slot)
            raise
        self._done_pieces(src, ords)
        self._publish(grp, ring, slot, pos, layouts, readers, nbytes)

    async def _acquire(self, grp: Group, nbytes: int) -> tuple[ServerRing, int]:
        """A free slot big enough for nbytes; a larger ring replaces the current one when needed."""
        if nbytes > grp.current.slot_size:
            old = grp.current
            grp.current = await self._new_ring(grp, _round_slot(nbytes))
            log.info("job %s group %d: ring grown to %d KiB slots", self.name, grp.index, grp.current.slot_size >> 10)
            self._announce_ring(grp, grp.current)
            self._retire(grp, old)
        ring = grp.current
        while (slot := ring.table.acquire()) is None:
            ring.freed.clear()
            await ring.freed.wait()
        return ring, slot

    def _announce_ring(self, grp: Group, ring: ServerRing) -> None:
        for r in grp.readers:
            c = self.conns.get(r)
            if c is not None and not c.closed:
                c.send({"t": "ring", "ring": ring.describe(), "fds": 1}, fds=[ring.seg.fd])

    def _retire(self, grp: Group, ring: ServerRing) -> None:
        if ring is not grp.current and ring.table.in_use == 0:
            grp.rings.pop(ring.id, None)
            ring.close()
            for r in grp.readers:
                c = self.conns.get(r)
                if c is not None and not c.closed:
                    c.send({"t": "unring", "ring": ring.id})

    def _publish(self, grp: Group, ring: ServerRing, slot: int, pos: RankPosition, layouts, readers, nbytes) -> None:
        live = [r for r in readers if not self.conns[r].closed]
        ring.table.publish(slot, live)
        if not live:
            ring.freed.set()
        base = ring.offset(slot)
        for r in live:
            fields = self._reader_fields(r, layouts)
            self.conns[r].send({"t": "batch", "ring": ring.id, "slot": slot, "base": base, "step": pos.step,
                                "micro": pos.micro, "fields": fields})
        grp.published += 1
        grp.bytes_published += nbytes

    def _reader_fields(self, rank: int, layouts: list[FieldLayout]) -> list:
        """The wire layout of the fields this rank reads (its PP stage's fields, its own CP slice)."""
        sel = self._selectors.get(rank)
        if sel is None:
            wanted = set(self.mesh.fields(rank, BATCH_FIELDS, self.spec.pp_fields))
            cp = str(self.mesh.coord(rank).cp)
            sel = self._selectors[rank] = (wanted, cp)
        wanted, cp = sel
        out = []
        for f in layouts:
            name, _, part = f.name.partition("@")
            if name in wanted and (not part or part == cp):
                out.append([name, f.dtype, f.shape, f.offset])
        return out

    def release(self, conn, ring_id: int, slot: int) -> None:
        for grp in self.groups:
            ring = grp.rings.get(ring_id)
            if ring is None:
                continue
            if ring.table.release(slot, conn.rank):
                ring.freed.set()
                if ring is not grp.current:
                    self._retire(grp, ring)
            return

    # ---- failure and shutdown ---------------------------------------------------------------------------
    def _task_failed(self, task, exc) -> None:
        log.error("job %s: %s failed: %s", self.name, task.get_name(), exc, exc_info=exc)
        self.fail(f"{type(exc).__name__}: {exc}", kind=type(exc).__name__)

    def fail(self, message: str, kind: str = "MsdataError") -> None:
        """Tell every rank why the job stopped, then close it; other jobs are unaffected."""
        if self.state == "closed":
            return
        self.error = message
        for c in self.conns.values():
            c.send({"t": "error", "kind": kind, "message": f"job {self.name!r} stopped: {message}"})
        self.node.forget(self)
        asyncio.get_running_loop().create_task(self.aclose())

    async def aclose(self) -> None:
        """Cancel the job's tasks, close its rings and loaders. Idempotent."""
        if self.state == "closed":
            return
        self.state = "closed"
        if self._view is not None:
            self._view.close()  # wakes a planner thread blocked on metadata
        await self.tasks.cancel_all(f"job {self.name} closing")
        for ld in self.loaders:
            try:
                await ld.aclose()
            except Exception:
                log.exception("job %s: closing a loader failed", self.name)
            finally:
                ld.source.close()
        for grp in self.groups:
            for ring in grp.rings.values():
                ring.close()
            grp.rings.clear()

    # ---- status -----------------------------------------------------------------------------------------
    def status(self) -> dict:
        elapsed = (time.monotonic() - self.started_at) if self.started_at else 0.0
        published = sum(g.published for g in self.groups)
        nbytes = sum(g.bytes_published for g in self.groups)
        n = max(self.steps_planned, 1)
        last = self.plan_stats[-1] if self.plan_stats else None
        return {
            "name": self.name,
            "digest": self.digest[:16],
            "state": self.state,
            "error": self.error,
            "world_size": self.mesh.world_size,
            "mesh": self.mesh.to_dict(),
            "ranks": sorted(r for r, c in self.conns.items() if not c.closed),
            "steps_planned": self.steps_planned,
            "micro_batches_published": published,
            "micro_batches_per_s": published / elapsed if elapsed else 0.0,
            "bytes_per_s": nbytes / elapsed if elapsed else 0.0,
            "imbalance": self._totals["imbalance"] / n if self.steps_planned else None,
            "padding_fraction": self._totals["padding"] / n if self.steps_planned else None,
            "plan_ms": self._totals["plan_ms"] / n if self.steps_planned else None,
            "last_step": last.to_dict() if last is not None else None,
            "tokens_per_source": dict(self._tokens),
            "rings": [{"group": g.index, "ring": r.id, "slots": r.table.slots, "in_use": r.table.in_use,
                       "slot_size": r.slot_size} for g in self.groups for r in g.rings.values()],
            "sources": {ld.source.name: self._source_status(s, ld) for s, ld in enumerate(self.loaders)},
        }

    def _source_status(self, s: int, ld) -> dict:
        if self.remote is not None:  # cluster: the shard reports its partitions
            return _stats_dict(ld.statistics())
        newest = self.snapshots[max(self.snapshots)] if self.snapshots else None
        return {**_stats_dict(ld.statistics()), **hold_figures(s, [ld], self.refs, newest)}


def _stats_dict(st) -> dict:
    from dataclasses import asdict, is_dataclass

    if is_dataclass(st):
        return {k: v for k, v in asdict(st).items() if isinstance(v, (int, float, str, dict, type(None)))}
    return dict(st) if isinstance(st, dict) else {}


def _estimate_slot(spec: JobSpec, cp: int) -> int:
    """Slot size for a typical micro-batch: row fields exactly, per-document ids for docs of >= 64 tokens."""
    tokens = spec.rows * spec.seq_len
    docs = tokens // 64 + spec.rows + 1
    _, nbytes = layout_fields(field_specs(rows=spec.rows, seq_len=spec.seq_len, n_pieces=docs, n_segments=docs + spec.rows, cp=cp))
    return _round_slot(nbytes)


class _LoaderView:
    """The planner's MetadataView: blocking length look-ups from the planner thread into the loop's loaders.

    ``close()`` cancels the look-ups in flight, so a planner thread never outlives its job.
    """

    def __init__(self, loaders: list[SourceLoader], loop: asyncio.AbstractEventLoop):
        self.loaders = loaders
        self.loop = loop
        self._pending: set = set()
        self._closed = False
        self._lock = threading.Lock()

    def lengths(self, source: int, start: int, count: int) -> np.ndarray:
        with self._lock:
            if self._closed:
                raise ClosedError("job closed while planning")
            fut = asyncio.run_coroutine_threadsafe(self.loaders[source].lengths(start, count), self.loop)
            self._pending.add(fut)
        try:
            return fut.result()
        except concurrent.futures.CancelledError:
            raise ClosedError("job closed while planning") from None
        finally:
            with self._lock:
                self._pending.discard(fut)

    def close(self) -> None:
        with self._lock:
            self._closed = True
            pending = list(self._pending)
        for fut in pending:
            fut.cancel()
