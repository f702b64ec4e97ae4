"""The node side of cluster jobs: reports local ranks to the leader, starts runs when it says, feeds its plans.

Every node pushes a report of its jobs (ranks, their positions and states, the next step it lacks) to the
leader whenever it changes and whenever the leader changes. The leader's coordinators answer with ``jstart``
and a stream of fenced ``plan`` frames; a node keeps the plans in step order, ignores duplicates (a new leader
re-plans from an earlier step), hands them to its constructors, and serves its source partitions to peers.

Frames of the job layer (orjson over the peer links; those from the leader carry its fencing token, and all
but ``jobs`` name the run they are about, so frames of an ended run or an older leader are dropped):

==========  =================  ========================================================================
frame       from -> to         what
==========  =================  ========================================================================
jobs        node -> leader     report: per job registration (``inst``), its ranks, positions, states,
                               the run it belongs to and the next step it lacks
jstart      leader -> nodes    start or rejoin a run: run id, spec, registrations, positions, nparts
plan        leader -> nodes    one step's plan (payload), its planner state, generation and latest cut
ack / need  node -> leader     the last step fed here / the step it lacks (the leader re-sends)
jstop       leader -> nodes    the run ended (every rank left)
len, fetch  node -> owner      lengths for the planner / a step's payloads (replied with ``rep``)
skip        node -> owner      occurrences this node will not build (their references drop)
mix         node -> leader     a rank's set_mixture (replied with the cut step or the refusal)
mixhold     leader -> nodes    hold the constructors, reply with the newest step taken up
mixcut      leader -> nodes    the cut (plans >= cut dropped) or, without one, the release
mixstate    node -> leader     a held node asks whether the change is over and where it cut
fault       test -> leader     only with MSDATA_TEST_FAULTS=1: lose plans or cuts, stall a change
==========  =================  ========================================================================
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import os
from contextlib import suppress

import numpy as np

from msdata_client.graph import JobSpec

from ..errors import CheckpointError, ConfigError, MsdataError, PeerLostError, ProtocolError
from ..job import RankPosition
from ..tasks import TaskSet
from .planwire import decode_plan
from .shard import BLOCK, JobShard, pack_docs

__all__ = ["ClusterJobs", "Run"]

log = logging.getLogger(__name__)

_KEEP_STATES = 256  # planner states kept per run for state_dict() (kilobytes each)


class _Loaders(list):
    """Job.loaders in cluster mode: per-source proxies plus batched fetch/skip through the shard."""

    def __init__(self, shard: JobShard):
        super().__init__(shard.proxies)
        self.fetch = shard.fetch
        self.skip = shard.skip


class Run:
    """One job run as this node knows it: the shard, the plans received, the states that came with them."""

    def __init__(self, jobs: ClusterJobs, spec: JobSpec, digest: str, frame: dict):
        self.jobs = jobs
        self.spec = spec
        self.digest = digest
        self.id = str(frame["run"])  # one run of the job: plans, acks and payload requests name it
        self.inst: str | None = None  # the local registration (Job.inst) this run feeds, once started here
        self.start_step = int(frame["start_step"])
        self.positions = {int(r): RankPosition(int(p[0]), int(p[1])) for r, p in frame["positions"].items()}
        self.group_nodes: dict[int, tuple[str, ...]] = {}
        self.set_ranks(frame["rank_nodes"])
        self.shard = JobShard(jobs, spec, digest, int(frame["nparts"]), run=self.id)
        self.shard.cursor = frame.get("cursor")
        self.loaders = _Loaders(self.shard)
        self.plans: dict[int, object] = {}
        self.early: dict[int, tuple] = {}
        self.states: dict[int, dict] = {}
        self.next_step = self.start_step  # the lowest step not yet received
        self.fed = self.start_step - 1
        self.arrived = asyncio.Event()
        self.job = None
        # mixture changes (set_mixture): plans of an older (token, gen) are dropped; a cut drops plans >= cut
        self.gen_key = (0, 0)
        self.epoch = 0
        self.cuts: list[tuple[int, int]] = []  # (epoch, cut) of each change this node applied
        self.holding: asyncio.Event | None = None  # constructors take up no new step while the leader cuts
        self.feed_next = self.start_step
        self.feeding = None  # the plan feed() is handing to the group queues
        self.gated: dict[int, object] = {}  # plans constructors hold at the gate (take) during a hold
        self.hold_token = 0  # the fencing token of the leader that holds

    def set_ranks(self, rank_nodes: dict) -> None:
        g: dict[int, set] = {}
        for r, nid in rank_nodes.items():
            g.setdefault(self.spec.mesh.group_of(int(r), self.spec.distribute), set()).add(str(nid))
        self.group_nodes = {k: tuple(sorted(v)) for k, v in g.items()}

    def add_plan(self, plan, state: dict | None, key: tuple[int, int] = (0, 0), cut: int | None = None) -> None:
        if key < self.gen_key:
            return  # planned before a mixture change: its steps were planned again
        if cut is not None and key > self.gen_key:
            self.cut(cut, key)  # the leader's mixcut to this node was lost: the first plan after it says the cut
        if plan.step < self.next_step or plan.step in self.early:
            return  # a re-sent plan (a new leader re-plans from an earlier step): identical, ignored
        if plan.step > self.next_step + _KEEP_STATES:
            log.warning("node %s: plan of step %d far past the missing step %d; dropped", self.jobs.node_id,
                        plan.step, self.next_step)
            return
        self.early[plan.step] = (plan, state)  # a later step may overtake a re-sent one: keep it until its turn
        while self.next_step in self.early:
            plan, state = self.early.pop(self.next_step)
            self.plans[plan.step] = plan
            if state is not None:
                self.states[plan.step] = state
                self.shard.cursor = state.get("cursor")
                self.shard.state = state
                for old in [s for s in self.states if s <= plan.step - _KEEP_STATES]:
                    del self.states[old]
            self.next_step = plan.step + 1
            self.shard.add_refs(plan, self.group_nodes)
        self.arrived.set()

    async def state_at(self, step: int) -> dict:
        """The planner state at the start of ``step`` (it comes with that step's plan)."""
        while step not in self.states:
            if step < min(self.states, default=step + 1) or self.job is None or self.job.state == "closed":
                raise CheckpointError(f"the server no longer holds the state of step {step} (recent steps "
                                      f"{min(self.states, default=0)}..{self.next_step - 1}); call state_dict() "
                                      "at the position you checkpoint")
            self.arrived.clear()
            await self.arrived.wait()
        return self.states[step]

    async def feed(self, job) -> None:
        """Hand plans in step order to the constructors of the groups read on this node; ack each step."""
        local = [g for g in job.groups if g.current is not None]
        self.feed_next = self.start_step
        while True:
            while self.feed_next not in self.plans:
                self.arrived.clear()
                try:  # a plan lost on a broken link: after a quiet while, tell the leader what we lack
                    await asyncio.wait_for(self.arrived.wait(), self.jobs.probe)
                except TimeoutError:
                    self.jobs.need(self)
            step = self.feed_next
            plan, epoch = self.plans.pop(step), self.epoch
            self.feeding = plan
            job.steps_planned += 1
            job._record_stats(plan)
            ok = True
            for grp in local:
                if not await grp.queue.put(plan, lambda: not self.stale(plan, epoch)):
                    ok = False  # a mixture change cut this step: feed_next went back to the cut
                    break
            self.feeding = None
            if not ok or self.stale(plan, epoch):
                continue
            self.fed = step
            self.feed_next = step + 1
            self.jobs.ack(self)

    # ---- mixture changes (the leader cuts at the first step no constructor on any node has taken up) -------
    def stale(self, plan, epoch: int) -> bool:
        """Whether a plan held since ``epoch`` was cut by a later mixture change."""
        return any(e > epoch and plan.step >= c for e, c in self.cuts)

    async def take(self, plan) -> bool:
        """A constructor's gate before it takes up a step: waits out a hold; False if the step was cut."""
        epoch = self.epoch
        if self.holding is None:
            return True
        self.gated[id(plan)] = plan
        try:
            while self.holding is not None:
                await self.holding.wait()
        finally:
            self.gated.pop(id(plan), None)
        return not self.stale(plan, epoch)

    def hold(self, token: int) -> int:
        """Stop constructors taking up new steps (until the leader's cut or release, or a newer leader); the
        newest step taken up here."""
        self.hold_token = max(self.hold_token, token)
        if self.holding is None:
            ev = self.holding = asyncio.Event()
            self.jobs.tasks.spawn(self._hold_watch(ev), name="hold-watch")
        job = self.job
        if job is None or not job.groups:
            return self.start_step - 1
        return max(g.committed for g in job.groups)

    async def _hold_watch(self, ev: asyncio.Event) -> None:
        """A hold ends with the leader's cut (or its release). If that does not come within a probe period
        (the frame was lost), ask the leader where its mixture changes stand; a newer leader ends it too."""
        while self.holding is ev:
            with suppress(TimeoutError):
                await asyncio.wait_for(ev.wait(), self.jobs.probe)
            if self.holding is not ev:
                return
            if self.jobs.runs.get(self.digest) is not self:  # the run ended here meanwhile
                self._release(ev)
                return
            try:
                head = await self.jobs.mix_state(self)
            except PeerLostError as e:
                log.info("node %s: job %s: held for a mixture change; asking the leader: %s", self.jobs.node_id,
                         self.spec.name, e)
                continue
            if head.get("busy") or self.holding is not ev:
                continue
            key = (int(head["token"]), int(head["gen"]))
            if head.get("cut") is not None and key > self.gen_key:
                log.info("node %s: job %s: the cut of a mixture change reached us late (step %s)", self.jobs.node_id,
                         self.spec.name, head["cut"])
                self.cut(int(head["cut"]), key)
            else:
                self._release(ev)

    def _release(self, ev: asyncio.Event) -> None:
        if self.holding is ev:
            self.holding = None
        ev.set()

    def cut(self, cut: int | None, key: tuple[int, int]) -> None:
        """Apply a mixture change: drop every plan of steps >= cut (re-planned by the leader), then release."""
        if cut is not None and key > self.gen_key:
            self.gen_key = key
            self.epoch += 1
            self.cuts.append((self.epoch, cut))
            del self.cuts[:-16]
            dropped = {id(p): p for s, p in self.plans.items() if s >= cut}
            for s in [s for s in self.plans if s >= cut]:
                del self.plans[s]
            for s in [s for s in self.early if s >= cut]:
                del self.early[s]  # never counted (add_refs runs when a plan takes its turn)
            for s in [s for s in self.states if s >= cut]:
                del self.states[s]
            for grp in (self.job.groups if self.job is not None else ()):
                dropped.update({id(p): p for p in grp.queue.drop_from(cut)})
            for p in [self.feeding, *self.gated.values()]:
                if p is not None and p.step >= cut:
                    dropped[id(p)] = p
            for p in dropped.values():
                self.shard.drop_refs(p, self.group_nodes)
            self.next_step = min(self.next_step, cut)
            self.fed = min(self.fed, cut - 1)
            self.feed_next = min(self.feed_next, cut)
            log.info("node %s: job %s: mixture change from step %d (%d planned step(s) dropped)", self.jobs.node_id,
                     self.spec.name, cut, len(dropped))
        if self.holding is not None:
            self._release(self.holding)


class ClusterJobs:
    """Per node: runs by digest, the report pushed to the leader, the peer frames of the job layer."""

    def __init__(self, node):
        self.node = node
        self.cluster = node.cluster
        self.node_id = node.config.node.id
        self.pool = node.pool
        self.runs: dict[str, Run] = {}
        self.tasks = TaskSet("cluster-jobs")
        self._ids = itertools.count(1)
        self._waiting: dict[int, tuple[str, asyncio.Future]] = {}  # request id -> (peer, its reply)
        self._runs_changed = asyncio.Event()  # set (and replaced) whenever a run starts here
        self._dirty = asyncio.Event()
        self._settled = asyncio.Event()
        self.coordinator = None
        self.timeout = max(5.0, 3 * node.config.cluster.lease_ttl)
        self.probe = node.config.cluster.lease_ttl / 2  # how long a node waits for a plan before asking again
        self._faults = os.environ.get("MSDATA_TEST_FAULTS") == "1"  # tests inject lost frames (see on_frame)
        self._drop_plans: dict[str, int] = {}
        self._drop_cuts: dict[str, int] = {}
        self._stall_mix = False
        self._leader_token = None  # the fencing token of the leader this node follows

    async def start(self) -> None:
        from .coordinator import Coordinator

        self.coordinator = Coordinator(self)
        self.cluster.handler = self.on_frame
        self.cluster.election.on_change(self._on_role)
        self.cluster.on_link.append(self._link_up)
        self.cluster.on_link_lost.append(self._link_lost)
        self.tasks.spawn(self._pusher(), name="job-reports")
        self.tasks.spawn(self._members(), name="job-members")
        self._dirty.set()

    async def aclose(self) -> None:
        await self.coordinator.aclose()
        await self.tasks.cancel_all("cluster jobs closing")
        for run in list(self.runs.values()):
            await run.shard.aclose()
        self.runs.clear()

    # ---- membership and leadership ----------------------------------------------------------------------
    def live_nodes(self) -> list[str]:
        return sorted(set(self.cluster.members) | {self.node_id})

    def _on_role(self, role, leader_id, token) -> None:
        self._dirty.set()
        if token is not None and token != self._leader_token:
            self._leader_token = token
            for run in self.runs.values():  # a hold for a leader that is gone ends now (its change never comes)
                if run.holding is not None and run.hold_token < int(token):
                    log.info("node %s: job %s: the leader that held the constructors for a mixture change is gone; "
                             "going on without it", self.node_id, run.spec.name)
                    run._release(run.holding)
        self.coordinator.on_role(role)

    def _link_up(self, nid: str) -> None:
        """A link came (back) up; frames sent while it was down are lost, so both sides catch up."""
        self.coordinator.link_up(nid)  # the leader re-sends the plans that node may lack
        if nid == self.cluster.leader_id:  # a follower reports again and says which step it lacks
            self._dirty.set()
            for run in list(self.runs.values()):
                if run.job is not None:
                    self.need(run)

    def _link_lost(self, nid: str) -> None:
        """Requests to a peer whose link broke get no answer: fail them now rather than at the timeout."""
        for peer, fut in list(self._waiting.values()):
            if peer == nid and not fut.done():
                fut.set_exception(PeerLostError(f"the link to peer {nid} broke before it answered"))

    async def _members(self) -> None:
        ev = self.cluster.members_changed
        while True:
            await ev.wait()
            ev.clear()
            self._settled.set()
            self._settled = asyncio.Event()
            for run in list(self.runs.values()):
                try:
                    await run.shard.rebalance()
                except MsdataError as e:
                    log.warning("node %s: re-placing partitions of %s: %s", self.node_id, run.spec.name, e)
            self.coordinator.members_changed()
            self._dirty.set()

    async def members_settle(self) -> None:
        """Wait for the next membership change (or a lease period): a lost owner is replaced by then."""
        with suppress(TimeoutError):
            await asyncio.wait_for(self._settled.wait(), self.node.config.cluster.lease_ttl)

    # ---- reports to the leader ----------------------------------------------------------------------------
    def changed(self) -> None:
        """A local rank came or went, or a job closed: the leader needs a new report."""
        self._dirty.set()

    def report(self) -> dict:
        jobs = []
        for job in list(self.node.jobs.values()) + list(self.node.pending.values()):
            if job.state == "closed":
                continue
            ranks = {str(r): {"pos": [job.positions[r].step, job.positions[r].micro], "state": job.states.get(r),
                              "resume": job.resuming.get(r, False)}
                     for r, c in job.conns.items() if not c.closed}
            run = self.runs.get(job.digest)
            mine = run is not None and run.inst == job.inst  # this registration is part of that run
            jobs.append({"name": job.name, "digest": job.digest, "spec": job.spec.to_dict(), "ranks": ranks,
                         "inst": job.inst, "run": run.id if mine else None, "running": mine,
                         "next": run.next_step if mine else None, "fed": run.fed if mine else None})
        return {"t": "jobs", "node": self.node_id, "jobs": jobs}

    async def _pusher(self) -> None:
        delay = 0.05
        while True:
            await self._dirty.wait()
            self._dirty.clear()
            leader = self.cluster.leader_id
            if leader is None:
                await self._wait_leader()
                self._dirty.set()
                continue
            try:
                await self.send(leader, self.report())
                delay = 0.05
            except PeerLostError:
                self._dirty.set()
                await asyncio.sleep(delay)  # back-off until the link to the new leader is up
                delay = min(delay * 2, 0.5)

    async def _wait_leader(self) -> None:
        with suppress(TimeoutError):
            await asyncio.wait_for(self.cluster.election.wait_leader(), self.node.config.cluster.lease_ttl)

    def need(self, run: Run) -> None:
        """Tell the leader the lowest step this node lacks and the last it fed (it re-sends what is missing)."""
        leader = self.cluster.leader_id
        if leader is None:
            return
        self.tasks.spawn(self._quiet_send(leader, {"t": "need", "digest": run.digest, "run": run.id,
                                                   "node": self.node_id, "step": run.next_step, "fed": run.fed}),
                         name="need")

    def ack(self, run: Run) -> None:
        leader = self.cluster.leader_id
        if leader is None:
            return
        self.tasks.spawn(self._quiet_send(leader, {"t": "ack", "digest": run.digest, "run": run.id,
                                                   "node": self.node_id, "step": run.fed}), name="ack")

    async def _quiet_send(self, nid: str, frame: dict, payload=None) -> None:
        with suppress(PeerLostError):
            await self.send(nid, frame, payload)

    # ---- transport ------------------------------------------------------------------------------------------
    async def send(self, nid: str, frame: dict, payload=None) -> None:
        if self._drop_plans and frame.get("t") == "plan" and self._drop_plans.get(nid, 0) > 0:
            self._drop_plans[nid] -= 1  # an injected fault: this plan is lost on the way
            log.warning("node %s: test fault: dropped the plan of step %s to %s", self.node_id, frame.get("step"), nid)
            return
        if self._drop_cuts and frame.get("t") == "mixcut" and self._drop_cuts.get(nid, 0) > 0:
            self._drop_cuts[nid] -= 1
            log.warning("node %s: test fault: dropped a mixcut (cut %s) to %s", self.node_id, frame.get("cut"), nid)
            return
        if nid == self.node_id:
            await self.on_frame(nid, frame, None if payload is None else memoryview(payload))
        else:
            await self.cluster.send(nid, frame, payload)

    async def request(self, nid: str, frame: dict, payload=None) -> tuple[dict, memoryview | None]:
        """Send a request and await its reply (PeerLostError/TimeoutError if the peer goes or is silent)."""
        rid = next(self._ids)
        fut = asyncio.get_running_loop().create_future()
        self._waiting[rid] = (nid, fut)
        try:
            await self.send(nid, {**frame, "id": rid, "from": self.node_id}, payload)
            head, body = await asyncio.wait_for(fut, self.timeout)
        except TimeoutError:
            raise PeerLostError(f"peer {nid} did not answer {frame.get('t')!r} within {self.timeout:.0f}s") from None
        finally:
            self._waiting.pop(rid, None)
        if head.get("error"):
            raise PeerLostError(f"peer {nid} could not answer {frame.get('t')!r}: {head['error']}")
        return head, body

    async def _reply(self, frame: dict, head: dict, payload=None) -> None:
        with suppress(PeerLostError):
            await self.send(str(frame["from"]), {**head, "t": "rep", "id": frame["id"]}, payload)

    # ---- frames ---------------------------------------------------------------------------------------------
    async def on_frame(self, peer: str, frame: dict, payload) -> None:
        t = frame.get("t")
        try:
            if t == "rep":
                _, fut = self._waiting.get(frame.get("id"), (None, None))
                if fut is not None and not fut.done():
                    fut.set_result((frame, None if payload is None else bytes(payload)))
            elif t == "plan":
                run = self._run(frame)
                if run is not None:
                    cut = frame.get("cut")
                    run.add_plan(decode_plan(frame, payload), frame.get("state"),
                                 (int(frame.get("token") or 0), int(frame.get("gen", 0))),
                                 None if cut is None else int(cut))
            elif t == "jstart":
                self._jstart(frame)
            elif t == "jstop":
                run = self._run(frame)
                if run is not None:
                    self._end_run(run, "every rank left")
            elif t in ("len", "fetch"):
                self.tasks.spawn(self._serve(frame), name=f"serve-{t}")
            elif t == "skip":
                run = self._run(frame)
                if run is not None:
                    run.shard.unref(np.asarray(frame["s"], np.int64), np.asarray(frame["o"], np.int64))
            elif t == "mixhold":  # the leader cuts for a mixture change: hold, say the newest step taken up
                run = self._run(frame)
                await self._reply(frame, {"committed": run.hold(int(frame.get("token") or 0)) if run is not None else -1})
            elif t == "mixcut":
                run = self._run(frame)
                if run is not None:
                    cut = frame.get("cut")
                    run.cut(None if cut is None else int(cut), (int(frame.get("token") or 0), int(frame.get("gen", 0))))
            elif t == "mix":
                self.tasks.spawn(self._serve_mix(frame), name="serve-mix")
            elif t == "mixstate":  # a held node asks where the leader's mixture changes stand
                c = self.coordinator.coords.get(frame.get("digest")) if self.coordinator.leading else None
                if c is None or c.run_id != frame.get("run"):
                    await self._reply(frame, {"error": f"node {self.node_id} does not coordinate that run"})
                else:
                    await self._reply(frame, {"busy": c.mixing, "token": c.token, "gen": c.gen, "cut": c.last_cut})
            elif t in ("jobs", "ack", "need"):
                self.coordinator.on_frame(frame)
            elif t == "fault" and self._faults:  # tests only (MSDATA_TEST_FAULTS=1): lose plans, break a link
                nid = str(frame["node"])
                self._drop_plans[nid] = int(frame.get("drop_plans", 0))
                self._stall_mix = bool(frame.get("stall_mix", False))
                self._drop_cuts[nid] = int(frame.get("drop_cuts", 0))
                link = self.cluster.links.get(nid)
                if frame.get("close") and link is not None:
                    self.tasks.spawn(link.aclose(), name="fault-close")
                log.warning("node %s: test fault: next %d plan(s) to %s dropped%s", self.node_id,
                            self._drop_plans[nid], nid, ", link closed" if frame.get("close") else "")
            else:
                log.warning("node %s: unknown job frame %r from %s", self.node_id, t, peer)
        except (KeyError, TypeError, ValueError, ProtocolError) as e:
            log.warning("node %s: malformed %r frame from %s: %s", self.node_id, t, peer, e)

    async def set_mixture(self, run: Run, weights: dict) -> int:
        """A rank's set_mixture: the leader's coordinator cuts, re-plans and records it; returns the cut step."""
        leader = self.cluster.leader_id
        if leader is None:
            raise PeerLostError("set_mixture: the cluster has no leader right now (etcd unreachable?); retry shortly")
        head, _ = await self.request(leader, {"t": "mix", "digest": run.digest, "run": run.id, "weights": weights})
        if head.get("refused"):
            raise ConfigError(head["refused"])
        return int(head["step"])

    async def mix_state(self, run: Run) -> dict:
        """The leader's mixture-change state of a run (PeerLostError while there is no leader to ask)."""
        leader = self.cluster.leader_id
        if leader is None:
            raise PeerLostError("the cluster has no leader right now")
        head, _ = await self.request(leader, {"t": "mixstate", "digest": run.digest, "run": run.id})
        return head

    async def _serve_mix(self, frame: dict) -> None:
        c = self.coordinator.coords.get(frame.get("digest")) if self.coordinator.leading else None
        try:
            if c is None or c.run_id != frame.get("run"):
                raise PeerLostError(f"node {self.node_id} does not coordinate job {str(frame.get('digest'))[:12]} "
                                    "(the leader changed); retry")
            await self._reply(frame, {"step": await c.set_mixture(dict(frame["weights"]))})
        except ConfigError as e:
            await self._reply(frame, {"refused": str(e)})
        except (MsdataError, KeyError, TypeError, ValueError) as e:
            await self._reply(frame, {"error": f"{type(e).__name__}: {e}"})

    def _run(self, frame: dict) -> Run | None:
        """The run a frame is about (None: a run that ended here, or one not started here yet)."""
        run = self.runs.get(frame.get("digest"))
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
        return [{"job": run.spec.name, "run": run.id, "ranks_here": run.job is not None, "next_step": run.next_step,
                 "fed": run.fed, "partitions_here": len(run.shard.loaders), "payloads_pending": len(run.shard.refs)}
                for run in self.runs.values()]

    def _set_run(self, run: Run) -> None:
        self.runs[run.digest] = run
        self._runs_changed.set()
        self._runs_changed = asyncio.Event()

    def _end_run(self, run: Run, why: str) -> None:
        if self.runs.get(run.digest) is run:
            del self.runs[run.digest]
        log.info("node %s: the run of job %s ended (%s)", self.node_id, run.spec.name, why)
        job = run.job
        if job is not None and job.state != "closed" and job.remote is run:
            job.fail(f"the run of job {run.spec.name!r} this rank belonged to ended on the cluster ({why}); "
                     "register again for a new run")
        self.tasks.spawn(run.shard.aclose(), name="shard-close")

    async def _serve(self, frame: dict) -> None:
        run = await self._await_run(frame)
        try:
            if run is None:
                raise PeerLostError(f"node {self.node_id} does not run job {str(frame.get('digest'))[:12]} "
                                    f"(run {frame.get('run')})")
            if frame["t"] == "len":
                s = int(frame["s"])
                parts = [await run.shard.serve_lengths(s, int(a), int(n)) for a, n in frame["spans"]]
                buf = np.concatenate(parts) if parts else np.zeros(0, np.int64)
                await self._reply(frame, {}, buf.astype("<i8", copy=False).tobytes())
            else:
                docs = await run.shard.serve_tokens(np.asarray(frame["s"], np.int64), np.asarray(frame["o"], np.int64))
                head, buf = pack_docs(docs)
                await self._reply(frame, head, buf)
        except (MsdataError, KeyError, TypeError, ValueError) as e:
            await self._reply(frame, {"error": f"{type(e).__name__}: {e}"})

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
        insts = set(frame.get("insts", {}).get(self.node_id, ()))
        for job in (self.node.jobs.get(run.spec.name), self.node.pending.get(run.spec.name)):
            if job is not None and job.digest == digest and job.inst in insts and job.state == "waiting":
                if run.inst != job.inst:  # a repeated start (a report crossed it) must not reset the positions
                    self._start_job(run, job, frame)
                break

    def _start_job(self, run: Run, job, frame: dict) -> None:
        run.inst = job.inst
        run.positions = {int(r): RankPosition(int(p[0]), int(p[1])) for r, p in frame["positions"].items()}
        run.start_step = min((run.positions[r] for r in job.conns if r in run.positions),
                             default=RankPosition(run.start_step, 0)).step
        if run.next_step < run.start_step:
            run.next_step = run.start_step
        run.fed = run.start_step - 1

        async def go():
            async with job._start_lock:
                if job.state == "waiting":
                    run.job = job
                    try:
                        await job._start(cluster=run)
                    except MsdataError as e:
                        job.fail(str(e), kind=type(e).__name__)

        self.tasks.spawn(go(), name=f"start-{job.name}")

    def started(self, run: Run, job) -> None:
        job.tasks.spawn(run.feed(job), name=f"{job.name}-plans")
        self._dirty.set()

    async def fetch_lengths(self, run: Run, s: int, start: int, count: int) -> np.ndarray:
        """Lengths of [start, start+count) of source s, asked of the nodes that own the blocks (retrying)."""
        shard = run.shard
        while True:
            pl = shard.placement()
            spans: dict[str, list[list[int]]] = {}
            pos, end = start, start + count
            while pos < end:
                hi = min(end, (pos // BLOCK + 1) * BLOCK)
                spans.setdefault(pl[s][shard.part(pos)], []).append([pos, hi - pos])
                pos = hi
            try:
                out = np.empty(count, dtype=np.int64)
                res = await asyncio.gather(*(self._lengths_from(run, nid, s, sp) for nid, sp in spans.items()))
                for (nid, sp), arr in zip(spans.items(), res):
                    off = 0
                    for a, n in sp:
                        out[a - start : a - start + n] = arr[off : off + n]
                        off += n
                return out
            except (PeerLostError, TimeoutError, ProtocolError) as e:
                log.info("node %s: asking lengths: %s; retrying after placement settles", self.node_id, e)
                await self.members_settle()

    async def _lengths_from(self, run: Run, nid: str, s: int, spans: list) -> np.ndarray:
        if nid == self.node_id:
            return np.concatenate([await run.shard.serve_lengths(s, a, n) for a, n in spans])
        _, body = await self.request(nid, {"t": "len", "digest": run.digest, "run": run.id, "s": s, "spans": spans})
        a = np.frombuffer(body or b"", dtype="<i8")
        if len(a) != sum(n for _, n in spans):
            raise ProtocolError(f"lengths reply of {len(a)} values for {sum(n for _, n in spans)} asked")
        return a

