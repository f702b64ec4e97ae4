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
len, fetch  node -> owner      lengths for the planner / a step's payloads (replied with ``rep``)
skip        node -> owner      occurrences this node will not build (their references drop)
mix         node -> leader     a rank's set_mixture (replied with the cut step or the refusal)
mixhold     leader -> nodes    hold the constructors, reply with the newest step taken up
mixcut      leader -> nodes    the cut (plans >= cut dropped) or, without one, the release
mixstate    node -> leader     a held node asks whether the change is over and where it cut
==========  =================  ========================================================================
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable
from contextlib import suppress

import numpy as np

from msdata_client.spec import JobSpec

from .. import faults
from ..errors import MsdataError, PeerLostError, ProtocolError
from ..job import Job
from ..ops.logs import Once
from ..tasks import TaskSet
from .leader.coordinator import Coordinator
from .mixing import MixtureRelay
from .net.rpc import PeerRpc, error_reply
from .planwire import decode_plan
from .report import LeaderReports
from .run import Run
from .shard import ShardPayloads, answer

__all__ = ["ClusterJobs"]

log = logging.getLogger(__name__)

Handler = Callable[[str, dict, memoryview | None], Awaitable[None]]


class ClusterJobs:
    """Per node: runs by digest, the report pushed to the leader, the peer frames of the job layer.

    Also the node's job starter in a cluster (``ranks_changed``): the leader decides when a job starts."""

    def __init__(self, node) -> None:
        self.node = node
        self.cluster = node.cluster
        self.node_id = node.config.node.id
        self.pool = node.pool
        self.runs: dict[str, Run] = {}
        self.tasks = TaskSet("cluster-jobs")
        self._warned = Once()  # a peer's bad frames are named once per kind, never in a loop
        self.rpc = PeerRpc(
            self.cluster, self.node_id, self.on_frame, timeout=max(5.0, 3 * node.config.cluster.lease_ttl)
        )
        self.probe = node.config.cluster.lease_ttl / 2  # how long a node waits for a plan before asking again
        self.coordinator = Coordinator(self)
        self._runs_changed = asyncio.Event()  # set (and replaced) whenever a run starts here
        self.reports = LeaderReports(node, self.rpc, self.runs, self.tasks)
        self.need, self.ack = self.reports.need, self.reports.ack
        self.mixing = MixtureRelay(self)
        self.set_mixture, self.mix_state = self.mixing.set_mixture, self.mixing.mix_state
        self._settled = asyncio.Event()
        self._leader_token: int | None = None  # the fencing token of the leader this node follows
        self.handlers: dict[str, Handler] = {
            "rep": self._on_rep,
            "plan": self._on_plan,
            "jstart": self._on_jstart,
            "jstop": self._on_jstop,
            "len": self._on_serve,
            "vis": self._on_serve,
            "fetch": self._on_serve,
            "skip": self._on_skip,
            "mixhold": self._on_mixhold,
            "mixcut": self._on_mixcut,
            "mix": self.mixing.on_mix,
            "mixstate": self.mixing.on_mixstate,
            "jobs": self._to_coordinator,
            "ack": self._to_coordinator,
            "need": self._to_coordinator,
        }
        faults.install(self)

    async def start(self) -> None:
        self.cluster.handler = self.on_frame
        self.cluster.election.on_change(self._on_role)
        self.cluster.on_link.append(self._link_up)
        self.cluster.on_link_lost.append(self.rpc.link_lost)
        self.cluster.on_link_lost.append(self._link_lost)
        self.tasks.spawn(self.reports.push(), name="job-reports")
        self.tasks.spawn(self._members(), name="job-members")
        self.reports.changed()

    async def aclose(self) -> None:
        await self.coordinator.aclose()
        await self.tasks.cancel_all("cluster jobs closing")
        for run in list(self.runs.values()):
            await run.shard.aclose()
        self.runs.clear()

    # ---- the node's job starter ------------------------------------------------------------------------------
    async def ranks_changed(self, job: Job) -> None:
        """A local rank came or went, or a job closed: the leader needs a new report (it starts runs)."""
        self.reports.changed()

    # ---- membership and leadership ----------------------------------------------------------------------
    def live_nodes(self) -> list[str]:
        return sorted(set(self.cluster.members) | {self.node_id})

    def _on_role(self, role, leader_id, token) -> None:
        self.reports.changed()
        if token is not None and token != self._leader_token:
            self._leader_token = token
            for run in self.runs.values():  # a hold for a leader that is gone ends now (its change never comes)
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
        changed = [run for run in self.runs.values() if run.shard.where.node_down(nid)]
        for run in changed:
            self.tasks.spawn(self.rebalance(run), name="shard-takeover")
        if changed:
            self._wake_settle()

    def _wake_settle(self) -> None:
        self._settled.set()
        self._settled = asyncio.Event()

    async def rebalance(self, run: Run) -> None:
        """Open the partitions placed here now, close the others (a node went or came, a split or merge)."""
        try:
            await run.shard.rebalance()
        except MsdataError as e:
            log.warning("node %s: re-placing partitions of %s: %s", self.node_id, run.spec.name, e)

    def _link_up(self, nid: str) -> None:
        """A link came (back) up; frames sent while it was down are lost, so both sides catch up."""
        for run in list(self.runs.values()):
            if nid in run.shard.where.down:
                run.shard.where.node_up(nid)
                self.tasks.spawn(self.rebalance(run), name="shard-rejoin")
        self.coordinator.link_up(nid)  # the leader re-sends the plans that node may lack
        if nid == self.cluster.leader_id:  # a follower reports again and says which step it lacks
            self.reports.changed()
            for run in list(self.runs.values()):
                if run.job is not None:
                    self.need(run)

    async def _members(self) -> None:
        ev = self.cluster.members_changed
        while True:
            await ev.wait()
            ev.clear()
            self._wake_settle()
            for run in list(self.runs.values()):
                await self.rebalance(run)
            self.coordinator.members_changed()
            self.reports.changed()

    async def members_settle(self) -> None:
        """Wait for the next membership change (or a lease period): a lost owner is replaced by then."""
        with suppress(TimeoutError):
            await asyncio.wait_for(self._settled.wait(), self.node.config.cluster.lease_ttl)

    # ---- frames ---------------------------------------------------------------------------------------------
    async def on_frame(self, peer: str, frame: dict, payload) -> None:
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

    async def _on_rep(self, peer: str, frame: dict, payload) -> None:
        self.rpc.answered(frame, payload)

    async def _on_plan(self, peer: str, frame: dict, payload) -> None:
        run = self._run(frame)
        if run is not None:
            cut = frame.get("cut")
            run.add_plan(
                decode_plan(frame, payload),
                frame.get("state"),
                (int(frame.get("token") or 0), int(frame.get("gen", 0))),
                None if cut is None else int(cut),
                frame.get("parts"),
            )

    async def _on_jstart(self, peer: str, frame: dict, payload) -> None:
        self._jstart(frame)

    async def _on_jstop(self, peer: str, frame: dict, payload) -> None:
        run = self._run(frame)
        if run is not None:
            self._end_run(run, "every rank left")

    async def _on_serve(self, peer: str, frame: dict, payload) -> None:
        self.tasks.spawn(self._serve(frame), name=f"serve-{frame['t']}")

    async def _on_skip(self, peer: str, frame: dict, payload) -> None:
        run = self._run(frame)
        if run is not None:
            run.shard.unref(np.asarray(frame["s"], np.int64), np.asarray(frame["o"], np.int64))

    async def _on_mixhold(self, peer: str, frame: dict, payload) -> None:
        """The leader cuts for a mixture change: hold, say the newest step taken up."""
        run = self._run(frame)
        await self.rpc.reply(frame, {"committed": run.hold(int(frame.get("token") or 0)) if run is not None else -1})

    async def _on_mixcut(self, peer: str, frame: dict, payload) -> None:
        run = self._run(frame)
        if run is not None:
            cut = frame.get("cut")
            run.cut(None if cut is None else int(cut), (int(frame.get("token") or 0), int(frame.get("gen", 0))))

    async def _to_coordinator(self, peer: str, frame: dict, payload) -> None:
        self.coordinator.on_frame(frame)

    # ---- runs -----------------------------------------------------------------------------------------------
    def _run(self, frame: dict) -> Run | None:
        """The run a frame is about (None: a run that ended here, or one not started here yet)."""
        run = self.runs.get(frame.get("digest"))  # type: ignore[arg-type]
        return run if run is not None and run.id == frame.get("run") else None

    async def _await_run(self, frame: dict) -> Run | None:
        """The run a peer asks about; its start may still be on the way from the leader: wait a little."""
        loop = asyncio.get_running_loop()
        end = loop.time() + self.probe
        while (run := self._run(frame)) is None and loop.time() < end:
            with suppress(TimeoutError):
                await asyncio.wait_for(self._runs_changed.wait(), end - loop.time())
        return run

    async def _watch(self, run: Run) -> None:
        """A node that only owns data of a run (no ranks here, so no feed asking for what it lacks) still counts
        every plan's payload references: when the step it lacks did not arrive for a whole probe period (a lost
        plan, while later ones keep coming), it tells the leader, which re-sends what is missing."""
        last = None
        while self.runs.get(run.digest) is run and run.job is None:
            await asyncio.sleep(self.probe)  # a periodic check by design: progress is what it looks for
            if run.job is None and self.runs.get(run.digest) is run and run.next_step == last:
                self.need(run)
            last = run.next_step

    def status(self) -> list[dict]:
        """The runs this node takes part in (with ranks or only as a data owner)."""
        return [
            {
                "job": run.spec.name,
                "run": run.id,
                "ranks_here": run.job is not None,
                "next_step": run.next_step,
                "fed": run.fed_step,
                "partitions_here": len(run.shard.loaders),
                "partitions": {n: run.shard.where.table.partitions(s) for s, n in enumerate(run.spec.source_names())},
                "shadows_here": len(run.shard.shadows),
                "takeovers": run.shard.takeovers,
                "payloads_pending": len(run.shard.refs),
            }
            for run in self.runs.values()
        ]

    def _set_run(self, run: Run) -> None:
        self.runs[run.digest] = run
        self._runs_changed.set()
        self._runs_changed = asyncio.Event()

    def _end_run(self, run: Run, why: str) -> None:
        if self.runs.get(run.digest) is run:
            del self.runs[run.digest]
        log.info("node %s: the run of job %s ended (%s)", self.node_id, run.spec.name, why)
        job = run.job
        if job is not None and job.state != "closed" and job.feed is run:
            job.fail(
                f"the run of job {run.spec.name!r} this rank belonged to ended on the cluster ({why}); "
                "register again for a new run"
            )
        self.tasks.spawn(run.shard.aclose(), name="shard-close")

    async def _serve(self, frame: dict) -> None:
        run = await self._await_run(frame)
        try:
            if run is None:
                raise PeerLostError(
                    f"node {self.node_id} does not run job {str(frame.get('digest'))[:12]} (run {frame.get('run')})"
                )
            head, body = await answer(run.shard, frame)
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
            run = Run(self, JobSpec.from_dict(frame["spec"]), digest, frame)
            self._set_run(run)
            self.tasks.spawn(run.shard.rebalance(), name="shard-open")
            self.tasks.spawn(self._watch(run), name="run-watch")
        else:
            run.set_ranks(frame["rank_nodes"])
        run.repartition(frame.get("parts"))  # a resumed run: the partition table a node holds with the most changes
        insts = set(frame.get("insts", {}).get(self.node_id, ()))
        for job in (self.node.jobs.get(run.spec.name), self.node.pending.get(run.spec.name)):
            if job is not None and job.digest == digest and job.inst in insts and job.state == "waiting":
                if run.inst != job.inst:  # a repeated start (a report crossed it) must not reset the positions
                    self._start_job(run, job, frame)
                break

    def _start_job(self, run: Run, job: Job, frame: dict) -> None:
        run.adopt(job, frame["positions"])

        async def prepare():
            run.job = job
            return run, ShardPayloads(run.shard), run.positions

        async def go():
            await job.start_with(prepare)
            self.reports.changed()

        self.tasks.spawn(go(), name=f"start-{job.name}")
