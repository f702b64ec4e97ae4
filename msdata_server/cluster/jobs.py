"""The node side of cluster jobs: reports local ranks to the leader, starts runs when it says, serves data.

Every node pushes a report of its jobs (ranks, their positions and states, the next step it lacks) to the
leader whenever it changes and whenever the leader changes. The leader's coordinators answer with ``jstart``
and a stream of fenced ``plan`` frames, which the node's ``Run`` keeps in order and feeds to its job; the
node serves its source partitions to peers.

Frames of the job layer (orjson over the peer links; those from the leader carry its fencing token, and all
but ``jobs`` name the run they are about, so frames of an ended run or an older leader are dropped):

==========  =================  ========================================================================
frame       from -> to         what
==========  =================  ========================================================================
jobs        node -> leader     report: per job registration (``inst``), its ranks, positions, states,
                               the run it belongs to and the next step it lacks
jstart      leader -> nodes    start or rejoin a run: run id, spec, registrations, positions, nparts
plan        leader -> nodes    one step's plan (payload), its planner state, generation and latest cut,
                               the run's partition table (splits and merges: ``cluster.parts``)
ack / need  node -> leader     the last step fed here / the step it lacks (the leader re-sends)
jstop       leader -> nodes    the run ended (every rank left)
jfail       leader -> nodes    the run cannot start (the error): the registrations waiting for it fail
len, fetch  node -> owner      lengths for the planner / a step's payloads (replied with ``rep``)
skip        node -> owner      occurrences this node will not build (their references drop)
mix         node -> leader     a rank's set_mixture (replied with the cut step or the refusal)
mixhold     leader -> nodes    hold the constructors, reply with the newest step taken up
mixcut      leader -> nodes    the cut (plans >= cut dropped) or, without one, the release
mixstate    node -> leader     a held node asks whether the change is over and where it cut
smeta       node -> leader     a remote source's kept listing and metadata (``cluster.metashare``)
==========  =================  ========================================================================

``ClusterJobs`` builds the layer's one ``ClusterContext`` (``cluster.context``) and hands it to each part:
its runs (``RunTable``), the reports to the leader, and the leader's ``Coordinator``. It routes frames and
link and membership events to them; none of them is handed ``ClusterJobs`` or the node server.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable, Iterator
from typing import TYPE_CHECKING, Protocol

import numpy as np

from msdata_client.spec import JobSpec

from .. import faults
from ..admission import check_bounds, check_functions, check_paths
from ..config import ServerConfig
from ..errors import ConfigError, MsdataError, PeerLostError, ProtocolError
from ..job import Job
from ..job.table import JobTable
from ..ops.logs import Once
from ..storage import get_store
from ..tasks import TaskSet
from .context import ClusterContext
from .metashare import MetaShare
from .net.rpc import PeerRpc, error_reply
from .planwire import decode_plan, plan_state
from .report import LeaderReports
from .run import Run, RunTable
from .shard import ShardPayloads

if TYPE_CHECKING:
    from ..autoscale import Autoscaler
    from ..pool import WorkerPool
    from .net.election import Role
    from .net.runtime import ClusterNode

__all__ = ["ClusterJobs"]

log = logging.getLogger(__name__)

Handler = Callable[[str, dict, memoryview | None], Awaitable[None]]


class LeaderRole(Protocol):
    """What the node side asks of the leader role this node hosts (``leader.coordinator.Coordinator``: the
    node server hands its constructor in, so that ``cluster/`` never imports ``cluster/leader/``, which builds
    on it)."""

    def on_role(self, role: str) -> None: ...
    def members_changed(self) -> None: ...
    def on_frame(self, frame: dict) -> None: ...
    def link_up(self, nid: str) -> None: ...
    async def on_mix(self, peer: str, frame: dict, payload: memoryview | None) -> None: ...
    async def on_mixstate(self, peer: str, frame: dict, payload: memoryview | None) -> None: ...
    async def aclose(self) -> None: ...


class ClusterJobs:
    """Per node: runs by digest, the report pushed to the leader, the peer frames of the job layer.

    Also the node's job starter in a cluster (``ranks_changed``): the leader decides when a job starts."""

    def __init__(
        self,
        cluster: ClusterNode,
        config: ServerConfig,
        *,
        table: JobTable,
        leader: Callable[[ClusterContext, RunTable], LeaderRole],
        pool: WorkerPool | None = None,
        autoscaler: Autoscaler | None = None,
    ) -> None:
        cc = config.cluster
        if cc is None:
            raise MsdataError("the cluster job layer needs a [cluster] table in node.toml")
        self.cluster = cluster
        self.node_id = config.node.id
        self.table = table  # the node's jobs by name (running and pending): the leader starts them
        self._admit = config.node  # [node] allow_transforms, data_roots: what a run here may name and read
        self._warned = Once()  # a peer's bad frames are named once per kind, never in a loop
        rpc = PeerRpc(cluster, self.node_id, self.on_frame, timeout=max(5.0, 3 * cc.lease_ttl))
        self.ctx = ClusterContext(
            node_id=self.node_id,
            config=cc,
            autoscale=config.autoscale,
            rpc=rpc,
            tasks=TaskSet("cluster-jobs"),
            cluster=cluster,
            pool=pool,
            autoscaler=autoscaler,
        )
        self.rpc, self.tasks = rpc, self.ctx.tasks
        self.runs = RunTable()
        self.coordinator = leader(self.ctx, self.runs)
        self.reports = LeaderReports(self.ctx, self.runs, self._registrations)
        self._leader_token: int | None = None  # the fencing token of the leader this node follows
        self.handlers: dict[str, Handler] = {
            "rep": self._on_rep,
            "plan": self._on_plan,
            "jstart": self._on_jstart,
            "jstop": self._on_jstop,
            "jfail": self._on_jfail,
            "len": self._on_serve,
            "vis": self._on_serve,
            "fetch": self._on_serve,
            "skip": self._on_skip,
            "mixhold": self._on_mixhold,
            "mixcut": self._on_mixcut,
            "mix": self.coordinator.on_mix,
            "mixstate": self.coordinator.on_mixstate,
            "jobs": self._to_coordinator,
            "ack": self._to_coordinator,
            "need": self._to_coordinator,
        }
        # remote sources' listings and metadata: read by the leader once, fetched from it by the other nodes
        self.metashare = MetaShare(cluster, self.node_id, rpc, self.tasks)
        self.handlers["smeta"] = self.metashare.on_request
        faults.install(self.ctx, self.handlers)

    async def start(self) -> None:
        self.cluster.handler = self.on_frame
        self.metashare.install(get_store())
        election = self.cluster.election
        if election is None:
            raise MsdataError("the cluster job layer starts after the node joined the cluster (ClusterNode.start)")
        election.on_change(self._on_role)
        self.cluster.on_link.append(self._link_up)
        self.cluster.on_link_lost.append(self.rpc.link_lost)
        self.cluster.on_link_lost.append(self._link_lost)
        self.tasks.spawn(self.reports.push(), name="job-reports")
        self.tasks.spawn(self._members(), name="job-members")
        self.reports.changed()

    async def aclose(self) -> None:
        self.metashare.uninstall()
        await self.coordinator.aclose()
        await self.tasks.cancel_all("cluster jobs closing")
        runs = list(self.runs)
        self.runs.clear()
        for run in runs:
            await run.aclose()

    # ---- the node's job starter ------------------------------------------------------------------------------
    async def ranks_changed(self, job: Job) -> None:
        """A local rank came or went, or a job closed: the leader needs a new report (it starts runs)."""
        self.reports.changed()

    def _registrations(self) -> Iterator[Job]:
        """The node's jobs, running and pending (the next run of a job still winding down)."""
        yield from list(self.table.jobs.values())
        yield from list(self.table.pending.values())

    # ---- membership and leadership ----------------------------------------------------------------------
    def _on_role(self, role: Role, leader_id: str | None, token: int | None) -> None:
        self.reports.changed()
        if token is not None and token != self._leader_token:
            self._leader_token = token
            for run in self.runs:  # a hold for a leader that is gone ends now (its change never comes)
                if run.holding is not None and run.hold_token < int(token):
                    log.info(
                        "node %s: job %s: the leader that held the constructors for a mixture change is gone; "
                        "going on without it",
                        self.node_id,
                        run.spec.name,
                    )
                    run.release_hold()
        self.coordinator.on_role(role)

    def _link_lost(self, nid: str) -> None:
        """Our link to nid broke: runs with shadow loaders hand its partitions to their standbys at once (the
        peer may be gone; its lease would say so only later). A fetch waiting for placement to settle goes on."""
        changed = [run for run in self.runs if run.node_down(nid)]
        for run in changed:
            self.tasks.spawn(run.rebalance(), name="shard-takeover")
        if changed:
            self.ctx.settled.wake()

    def _link_up(self, nid: str) -> None:
        """A link came (back) up; frames sent while it was down are lost, so both sides catch up."""
        for run in self.runs:
            if run.node_up(nid):
                self.tasks.spawn(run.rebalance(), name="shard-rejoin")
        self.coordinator.link_up(nid)  # the leader re-sends the plans that node may lack
        if nid == self.cluster.leader_id:  # a follower reports again and says which step it lacks
            self.reports.changed()
            for run in self.runs:
                if run.job is not None:
                    self.ctx.need(run)

    async def _members(self) -> None:
        ev = self.cluster.members_changed
        while True:
            await ev.wait()
            ev.clear()
            self.ctx.settled.wake()
            for run in self.runs:
                await run.rebalance()
            self.coordinator.members_changed()
            self.reports.changed()

    # ---- frames ---------------------------------------------------------------------------------------------
    async def on_frame(self, peer: str, frame: dict, payload: memoryview | None) -> None:
        t = frame.get("t")
        handler = self.handlers.get(str(t))
        if handler is None:
            if self._warned("unknown", peer, t):
                log.warning("node %s: unknown job frame %r from %s (repeats not logged)", self.node_id, t, peer)
            return
        try:
            await handler(peer, frame, payload)
        except (KeyError, TypeError, ValueError, ProtocolError) as e:
            if self._warned("malformed", peer, t):
                log.warning("node %s: malformed %r frame from %s: %s (repeats not logged)", self.node_id, t, peer, e)

    async def _on_rep(self, peer: str, frame: dict, payload: memoryview | None) -> None:
        self.rpc.answered(frame, payload)

    async def _on_plan(self, peer: str, frame: dict, payload: memoryview | None) -> None:
        run = self.runs.named(frame)
        if run is not None:
            cut = frame.get("cut")
            run.add_plan(
                decode_plan(frame, payload),
                plan_state(frame, payload),
                (int(frame.get("token") or 0), int(frame.get("gen", 0))),
                None if cut is None else int(cut),
                frame.get("parts"),
                skipped=bool(frame.get("skipped")),
            )

    async def _on_jstart(self, peer: str, frame: dict, payload: memoryview | None) -> None:
        self._jstart(frame)

    async def _on_jstop(self, peer: str, frame: dict, payload: memoryview | None) -> None:
        run = self.runs.named(frame)
        if run is not None:
            self._end_run(run, "every rank left")

    async def _on_jfail(self, peer: str, frame: dict, payload: memoryview | None) -> None:
        """The leader cannot start the run our registrations wait for: they fail with its error (their ranks get
        it); a frame of an older leader is dropped."""
        if self._leader_token is not None and int(frame.get("token") or 0) < self._leader_token:
            return
        digest, name = str(frame["digest"]), str(frame["job"])
        insts = set(frame.get("insts", {}).get(self.node_id, ()))
        for job in (self.table.jobs.get(name), self.table.pending.get(name)):
            if job is not None and job.digest == digest and job.inst in insts and job.state == "waiting":
                job.fail(str(frame["message"]), kind=str(frame.get("kind") or "MsdataError"))

    async def _on_serve(self, peer: str, frame: dict, payload: memoryview | None) -> None:
        self.tasks.spawn(self._serve(frame), name=f"serve-{frame['t']}")

    async def _on_skip(self, peer: str, frame: dict, payload: memoryview | None) -> None:
        run = self.runs.named(frame)
        if run is not None:
            run.unref(np.asarray(frame["s"], np.int64), np.asarray(frame["o"], np.int64))

    async def _on_mixhold(self, peer: str, frame: dict, payload: memoryview | None) -> None:
        """The leader cuts for a mixture change: hold, say the newest step taken up."""
        run = self.runs.named(frame)
        await self.rpc.reply(frame, {"committed": run.hold(int(frame.get("token") or 0)) if run is not None else -1})

    async def _on_mixcut(self, peer: str, frame: dict, payload: memoryview | None) -> None:
        run = self.runs.named(frame)
        if run is not None:
            cut = frame.get("cut")
            run.cut(None if cut is None else int(cut), (int(frame.get("token") or 0), int(frame.get("gen", 0))))

    async def _to_coordinator(self, peer: str, frame: dict, payload: memoryview | None) -> None:
        self.coordinator.on_frame(frame)

    # ---- runs -----------------------------------------------------------------------------------------------
    async def _watch(self, run: Run) -> None:
        """A node that only owns data of a run (no ranks here, so no feed asking for what it lacks) still counts
        every plan's payload references: when the step it lacks did not arrive for a whole probe period (a lost
        plan, while later ones keep coming), it tells the leader, which re-sends what is missing."""
        last = None
        while not run.ended and run.job is None:
            await asyncio.sleep(self.ctx.probe)  # a periodic check by design: progress is what it looks for
            if run.job is None and not run.ended and run.next_step == last:
                self.ctx.need(run)
            last = run.next_step

    def status(self) -> list[dict]:
        """The runs this node takes part in (with ranks or only as a data owner)."""
        return [run.status() for run in self.runs]

    def _end_run(self, run: Run, why: str) -> None:
        self.runs.remove(run)
        log.info("node %s: the run of job %s ended (%s)", self.node_id, run.spec.name, why)
        job = run.job
        if job is not None and job.state != "closed" and job.feed is run:
            job.fail(
                f"the run of job {run.spec.name!r} this rank belonged to ended on the cluster ({why}); "
                "register again for a new run"
            )
        self.tasks.spawn(run.aclose(), name="shard-close")

    async def _serve(self, frame: dict) -> None:
        run = await self.runs.started(frame, self.ctx.probe)
        try:
            if run is None:
                raise PeerLostError(
                    f"node {self.node_id} does not run job {str(frame.get('digest'))[:12]} (run {frame.get('run')})"
                )
            head, body = await run.serve(frame)
            await self.rpc.reply(frame, head, body)
        except (MsdataError, KeyError, TypeError, ValueError) as e:
            await self.rpc.reply(frame, error_reply(e))

    def _jstart(self, frame: dict) -> None:
        """Start (or, for ranks that rejoin, continue) a run; a new run of a job replaces the ended one here."""
        digest, rid = str(frame["digest"]), str(frame["run"])
        run = self.runs.get(digest)
        if run is not None and run.id != rid:
            self._end_run(run, f"run {rid} of the job started")
            run = None
        if run is None:
            spec = JobSpec.from_dict(frame["spec"])
            try:  # the ranks' nodes admitted it; this node's operator decides for what it opens and runs here
                check_bounds(spec, self._admit)
                check_functions(spec, self._admit.allow_transforms)
                check_paths(spec, self._admit.data_roots)
            except ConfigError as e:
                if self._warned("admit", digest):
                    log.error(
                        "run %s of job %s not served here: %s; give every node of the cluster the same [node] "
                        "allow_transforms and data_roots",
                        rid,
                        spec.name,
                        e,
                    )
                return
            run = Run(self.ctx, spec, digest, frame)
            self.runs.add(run)
            self.tasks.spawn(run.rebalance(), name="shard-open")
            self.tasks.spawn(self._watch(run), name="run-watch")
        else:
            run.set_ranks(frame["rank_nodes"])
        run.repartition(frame.get("parts"))  # a resumed run: the partition table a node holds with the most changes
        insts = set(frame.get("insts", {}).get(self.node_id, ()))
        for job in (self.table.jobs.get(run.spec.name), self.table.pending.get(run.spec.name)):
            if job is not None and job.digest == digest and job.inst in insts and job.state == "waiting":
                if run.inst != job.inst:  # a repeated start (a report crossed it) must not reset the positions
                    self._start_job(run, job, frame)
                break

    def _start_job(self, run: Run, job: Job, frame: dict) -> None:
        run.adopt(job, frame["positions"])

        async def prepare() -> tuple[Run, ShardPayloads, dict[int, tuple[int, int]]]:
            run.job = job
            return run, run.payloads(), run.positions

        async def go() -> None:
            await job.start_with(prepare)
            self.reports.changed()

        self.tasks.spawn(go(), name=f"start-{job.name}")
