"""One training job on a node server: its ranks, groups, rings and constructors, fed by a PlanFeed and a
PayloadSource (``job.seams``), the same pipeline on one node and in a cluster.

Data path per step: the feed hands out plans in step order; the job queues each in every group read here
(at most ``prefetch_steps`` per group: the queues push back on planning); each group's constructor builds its
micro-batches once in a ring slot and tells the readers. Who starts a job, and with which feed, is the
starter's business (``job.local.LocalStarter`` on one node, ``cluster.jobs.ClusterJobs`` in a cluster).
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import time
import uuid
from collections.abc import Awaitable, Callable
from functools import partial

from msdata_client.mix import check_mixture_change
from msdata_client.spec import JobSpec

from ..errors import BadSourceError, MsdataError, StorageError
from ..ops.waits import WaitStats
from ..planner import StepPlan
from ..reclaim import collect_soon
from ..sources.base import dominant_reason
from ..statedir import StateStore
from ..tasks import TaskSet
from .constructor import Constructor, estimate_slot
from .late import LateGroups, history_depth
from .ranks import RECONNECT_GRACE, RankPosition, RankRegistry
from .rings import RingConfig, RingSet
from .seams import PayloadSource, PlanFeed
from .status import PlanLog, job_status
from .steps import Group, StepQueue
from .summary import run_summary, summary_text

__all__ = ["Job"]

log = logging.getLogger(__name__)

Prepare = Callable[[], Awaitable[tuple[PlanFeed, PayloadSource, dict[int, tuple[int, int]]]]]


class Job:
    """A registered job: waiting (for its start) -> running -> closed."""

    def __init__(
        self,
        spec: JobSpec,
        digest: str,
        *,
        node_id: str,
        rings: RingConfig,
        forget: Callable[[Job], None],
        hold: bool = False,
        reconnect_grace: float = RECONNECT_GRACE,
        on_idle: Callable[[Job], object] | None = None,
    ):
        self.spec = spec
        self.digest = digest
        self.name = spec.name
        self.mesh = spec.mesh
        self.node_id = node_id
        self.ranks = RankRegistry(spec, grace=reconnect_grace)
        self.state = "waiting"
        self.error: str | None = None
        self.tasks = TaskSet(f"job {spec.name}", on_error=self._task_failed)
        self.groups: list[Group] = []
        self.feed: PlanFeed | None = None
        self.payloads: PayloadSource | None = None
        self.plans = PlanLog()
        self.source_sizes: dict[str, int] = {}  # samples per epoch by source, where known here (status epochs)
        self.waits = WaitStats()  # how long each rank waited for data (reported by the clients)
        self.started_at: float | None = None
        self.start_step = 0
        self.inst = uuid.uuid4().hex[:16]  # this registration of the job on this node (the leader tells runs apart)
        self.may_start = asyncio.Event()  # a new run waits here until the previous run of the job has left
        if not hold:
            self.may_start.set()
        self._started = asyncio.Event()
        self._start_lock = asyncio.Lock()
        self._ring_cfg = rings
        self._ring_ids = itertools.count(1)
        self._forget = forget
        self._on_idle = on_idle  # an away rank was dropped: the node closes the job if nobody is left
        self._distributing: StepPlan | None = None  # the plan being queued in the groups
        self.late: LateGroups | None = None  # while some group has no reader here (job.late)
        self._closing: asyncio.Task | None = None  # aclose() after a failure (it cancels self.tasks)
        self.mixture_listeners: list[Callable[[str, int], None]] = []  # (job, cut) after a set_mixture
        self.saving: StateStore | None = None  # where its planner states are saved (status: why planning waits)

    # ---- ranks ------------------------------------------------------------------------------------------
    async def attach(
        self,
        conn,
        rank: int,
        position: RankPosition,
        state: dict | None = None,
        resume: bool = False,
        *,
        client: str | None = None,
        held: list | tuple = (),
        latest: dict | None = None,
    ) -> None:
        """Register a rank (checked with ``ranks.check_rank``/``check_state``); a running job welcomes it. A rank
        that comes back to a running job continues at ``position``: the notices kept for it from there on are
        sent again, the earlier slots it still ``held`` stay taken, the rest are freed (``ranks.rejoin``); the
        first reader of a group here after the start gets the group built here from its position (``late``)."""
        if self.late is not None and (grp := self.groups[self.spec.group_of(rank)]).rings is None:
            await self.late.activate(grp, rank, position)
        self.ranks.add(conn, rank, position, state, resume, client, latest)
        conn.job, conn.rank = self, rank
        if self.state == "running":
            back = self.ranks.rejoin(rank, position, held)
            for ring, slot in back.free:
                self._release(rank, ring, slot)
            self._welcome(rank, back.kept)
            for frame in back.resend:
                self.ranks.send([rank], frame)
            back.report(self.name, rank, position)

    def detach(self, conn) -> None:
        """A rank's socket closed. A rank that said bye, or whose process exited, is dropped (every slot it held
        is freed so the other readers never stall); one that merely lost its socket is kept as a reader for
        ``reconnect_grace`` seconds, so that when it comes back it continues exactly (``ranks.hold``)."""
        if not self.ranks.owns(conn):
            return
        rank = conn.rank
        if (
            self.state == "running"
            and self.error is None
            and not conn.ended
            and self.ranks.hold(rank, conn, self._drop)
        ):
            log.info(
                "job %s: rank %d lost its connection; its micro-batches are kept for it for %.0f s",
                self.name,
                rank,
                self.ranks.grace,
            )
            return
        self._drop(rank, left=True)

    def _drop(self, rank: int, left: bool = False) -> None:
        """Free every slot the rank held and forget what was kept for it."""
        self.ranks.forget(rank)
        for g in self.groups:
            if g.rings is not None:
                g.rings.drop_reader(rank)
        if left:
            log.info(
                "job %s: rank %d disconnected (%d of %d still connected)",
                self.name,
                rank,
                self.ranks.connected,
                self.mesh.world_size,
            )
        else:
            log.warning(
                "job %s: rank %d did not come back (its process exited or %.0f s passed): its slots are freed; "
                "if it reconnects now it is refused (restart it from its checkpoint)",
                self.name,
                rank,
                self.ranks.grace,
            )
            if self._on_idle is not None:
                self._on_idle(self)

    def release(self, conn, ring_id: int, slot: int) -> None:
        if self.ranks.owns(conn):  # a stale connection's late releases would free another publication
            self._release(conn.rank, ring_id, slot)

    def _release(self, rank: int, ring_id: int, slot: int) -> None:
        self.ranks.released(rank, ring_id, slot)
        for g in self.groups:
            if g.rings is not None and g.rings.release(ring_id, slot, rank):
                return

    def _welcome(self, rank: int, kept: list | None = None) -> None:
        grp = self.groups[self.spec.group_of(rank)]
        rings, fds = grp.rings.describe() if grp.rings is not None else ([], [])
        frame = {"t": "welcome", "node": self.node_id, "job": self.name, "rank": rank, "group": grp.index}
        self.ranks.send([rank], {**frame, "rings": rings, "fds": len(fds), "kept": kept or []}, fds)

    # ---- start ---------------------------------------------------------------------------------------------
    async def start_with(self, prepare: Prepare) -> None:
        """Start once: ``prepare()`` gives the plan feed, the payload source and the ranks' start positions. A
        second call while starting or started does nothing; an MsdataError fails the job for every rank."""
        async with self._start_lock:
            if self.state != "waiting" or self.error is not None:  # started, or failed (closing)
                return
            try:
                feed, payloads, positions = await prepare()
                await self._start(feed, payloads, positions)
            except MsdataError as e:  # e.g. ranks brought disagreeing states, /dev/shm full: tell every rank
                log.error("job %s cannot start: %s", self.name, e)
                self.fail(str(e), kind=type(e).__name__)

    async def _start(self, feed: PlanFeed, payloads: PayloadSource, positions: dict[int, tuple[int, int]]) -> None:
        spec = self.spec
        self.feed, self.payloads = feed, payloads
        self.ranks.place(positions)
        self.start_step = feed.start_step
        start = min(self.ranks.positions.values())
        self._cp = self.mesh.cp if spec.distribute != "world" else 1
        self._slot_est = estimate_slot(spec, self._cp)
        for g in range(spec.data_groups()):
            readers = spec.readers(g)
            grp = Group(index=g, readers=readers, queue=StepQueue(spec.prefetch_steps), committed=self.start_step - 1)
            if any(r in self.ranks.conns for r in readers):  # read here: rings and a constructor
                grp.rings = await self.open_rings(grp)
            self.groups.append(grp)
        if any(g.rings is None for g in self.groups):
            self.late = LateGroups(self, history_depth(spec.prefetch_steps, self._ring_cfg.slots, spec.micro_batches))
        self.state = "running"
        self.started_at = time.monotonic()
        log.info(
            "job %s started: %d ranks, %d groups, ring %d x %.1f MiB, from step %d micro %d",
            self.name,
            self.mesh.world_size,
            len(self.groups),
            self._ring_cfg.slots,
            self._slot_est / 2**20,
            start.step,
            start.micro,
        )
        for rank in sorted(self.ranks.conns):
            self._welcome(rank)
        self._started.set()
        feed.bind(self)
        self.tasks.spawn(self._distribute(), name=f"{self.name}-plans")
        for grp in self.groups:
            if grp.rings is not None:
                self.construct(grp)

    async def open_rings(self, grp: Group) -> RingSet:
        announce = partial(self.ranks.send, grp.readers)
        rings = RingSet(self._ring_cfg, job=self.name, group=grp.index, ids=self._ring_ids, announce=announce)
        await rings.open(self._slot_est)
        return rings

    def construct(self, grp: Group) -> None:
        assert self.feed is not None
        assert self.payloads is not None
        feed, payloads, ranks = self.feed, self.payloads, self.ranks
        con = Constructor(
            spec=self.spec, group=grp, ranks=ranks, feed=feed, payloads=payloads, cp=self._cp, tasks=self.tasks
        )
        self.tasks.spawn(con.run(), name=f"{self.name}-constructor-{grp.index}")

    async def _distribute(self) -> None:
        """Queue every plan the feed hands out in each group read here, in step order."""
        assert self.feed is not None
        feed = self.feed
        while True:
            plan, epoch = await feed.next()
            local = [g for g in self.groups if g.rings is not None]  # a group's first reader may come mid-run
            if self.late is not None:
                self.late.record(plan, epoch)
            self.plans.record(plan.stats)
            self._distributing = plan
            queued = True
            for grp in local:
                if not await grp.queue.put(plan, lambda: not feed.stale(plan, epoch)):  # noqa: B023 (put() calls it before it returns)
                    queued = False  # a mixture change cut this step: the feed hands it out again
                    break
            self._distributing = None
            if queued and not feed.stale(plan, epoch):
                feed.fed(plan)

    # ---- what the plan feed sees (job.seams.Steps) ---------------------------------------------------------
    def committed(self) -> int:
        """The newest step a constructor here took up."""
        return max((g.committed for g in self.groups), default=self.start_step - 1)

    def drop_from(self, cut: int) -> list[StepPlan]:
        """Drop the queued (and the distributing) plans of steps >= cut; returns each dropped plan once."""
        dropped: dict[int, StepPlan] = {}
        for grp in self.groups:
            dropped.update({id(p): p for p in grp.queue.drop_from(cut)})
        if self._distributing is not None and self._distributing.step >= cut:
            dropped[id(self._distributing)] = self._distributing
        return list(dropped.values())

    # ---- requests from ranks ---------------------------------------------------------------------------------
    async def set_mixture(self, weights: dict) -> int:
        """Use these weights from the first step not yet taken up by any constructor (returned)."""
        weights = check_mixture_change(weights, self.spec.source_names())  # the client's rule: refused here too
        await self._started.wait()
        assert self.feed is not None
        cut = await self.feed.set_mixture(weights)
        for listener in self.mixture_listeners:
            listener(self.name, cut)
        return cut

    async def state_at(self, step: int) -> dict:
        """The planner state at the start of ``step`` (for a rank's state_dict)."""
        await self._started.wait()
        assert self.feed is not None
        return await self.feed.state_at(step)

    # ---- failure and shutdown -----------------------------------------------------------------------------
    def _task_failed(self, task: asyncio.Task, exc: BaseException) -> None:
        if isinstance(exc, BadSourceError):  # bad data, not a bug: no traceback; say why its samples were bad
            message = f"{exc}; mostly {self._bad_reasons(exc.source)}"
            log.error("job %s: %s", self.name, message)
            self.fail(message, kind=type(exc).__name__)
            return
        if isinstance(exc, StorageError):  # the object store failed for good ([job] on_read_error = "fail")
            log.error("job %s: %s", self.name, exc)
            self.fail(
                f'{exc}; set [job] on_read_error = "skip" to count such reads as bad samples instead',
                kind=type(exc).__name__,
            )
            return
        log.error("job %s: %s failed: %s", self.name, task.get_name(), exc, exc_info=exc)
        self.fail(f"{type(exc).__name__}: {exc}", kind=type(exc).__name__)

    def _bad_reasons(self, source: str) -> str:
        """The reason most bad samples of ``source`` read here had (its loaders' counts)."""
        figures = self.payloads.status(None).get(source, {}) if self.payloads is not None else {}
        return dominant_reason(figures.get("bad_samples") or {})

    def fail(self, message: str, kind: str = "MsdataError") -> None:
        """Tell every rank why the job stopped, then close it; other jobs are unaffected."""
        if self.state == "closed":
            return
        self.error = message
        self.ranks.send(
            list(self.ranks.conns), {"t": "error", "kind": kind, "message": f"job {self.name!r} stopped: {message}"}
        )
        self._forget(self)
        self._closing = asyncio.get_running_loop().create_task(
            self.aclose(why=f"failed: {message}"), name=f"{self.name}-close"
        )

    async def aclose(self, why: str = "closed") -> None:
        """Log the run's summary (``why`` it ended), cancel the job's tasks, close its rings and payload source.
        Idempotent."""
        if self.state == "closed":
            return
        if self.started_at is not None:
            self._log_summary(why)
        self.state = "closed"
        if self.feed is not None:
            self.feed.close()
        self.ranks.close()
        await self.tasks.cancel_all(f"job {self.name} closing")
        if self.payloads is not None:
            await self.payloads.aclose()
        self.close_rings()
        collect_soon()  # the run's graph holds cycles: free it now, not at some later full collection

    def _log_summary(self, why: str) -> None:
        """One INFO line with what this run delivered (``job.summary``); never stops the close."""
        try:
            assert self.started_at is not None
            wall = time.monotonic() - self.started_at
            s = run_summary(self.status(), why=why, wall_s=wall, micro_batches=self.spec.micro_batches)
        except Exception:
            log.exception("job %s: its end-of-run summary could not be made", self.name)
            return
        log.info("%s", summary_text(s), extra={"fields": {"run_summary": s}})

    def close_rings(self) -> None:
        """Close (and unlink) every ring of the job; idempotent, safe after a failed or timed-out close."""
        for grp in self.groups:
            if grp.rings is not None:
                grp.rings.close()

    # ---- status ---------------------------------------------------------------------------------------------
    def status(self) -> dict:
        return job_status(self)
