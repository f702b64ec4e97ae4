"""One job run as a node knows it, and its PlanFeed: the leader's plans, kept in step order.

The leader sends every node every step's plan (with the planner state at its start, its fencing token, the
mixture-change generation and the latest cut). A node keeps them in step order, ignores duplicates (a new
leader re-plans from an earlier step), counts the payload references of the partitions it owns as each plan
takes its turn, and hands them to its job's constructors (``PlanFeed``). A node that lacks a step for a
probe period asks the leader for it.

Mixture changes: the leader holds every node (constructors take up no new step), learns the newest step
taken up anywhere, cuts after it and releases the nodes with the cut; plans of steps >= cut are dropped
everywhere (with their references) and planned again.
"""

from __future__ import annotations

import asyncio
import logging
from contextlib import suppress
from typing import TYPE_CHECKING, Protocol

from msdata_client.spec import JobSpec

from ..autoscale.cluster import placement_costs
from ..errors import CheckpointError, PeerLostError
from ..job.seams import CutLog, Steps
from ..planner import Mixture, StepPlan
from ..planner.history import held_window
from ..planner.state import K_MIXTURE, K_STEP
from ..tasks import TaskSet
from .shard import JobShard, repartition, retire

if TYPE_CHECKING:
    from ..job import Job

__all__ = ["Run", "RunHost"]


def _positions(wire: dict) -> dict[int, tuple[int, int]]:
    """Rank -> (step, micro) from a jstart frame (JSON keys are strings)."""
    return {int(r): (int(p[0]), int(p[1])) for r, p in wire.items()}


class RunHost(Protocol):
    """What a run needs of its node's job layer (``cluster.jobs.ClusterJobs``)."""

    node_id: str
    probe: float  # seconds a node waits for a plan (or a hold's end) before asking the leader
    tasks: TaskSet
    runs: dict[str, Run]

    def need(self, run: Run) -> None: ...

    def ack(self, run: Run) -> None: ...

    async def set_mixture(self, run: Run, weights: dict) -> int: ...

    async def mix_state(self, run: Run) -> dict: ...

    async def rebalance(self, run: Run) -> None: ...


log = logging.getLogger(__name__)

KEEP_STATES = 256  # planner states kept per run for state_dict() (kilobytes each)


def _forget_through(by_step: dict, step: int) -> None:
    """Drop the entries of steps <= ``step`` from a dict filled in step order (after a cut: nearly; a later
    call takes what one left)."""
    while by_step:
        first = next(iter(by_step))
        if first > step:
            return
        del by_step[first]


class Run:
    """One job run on this node: the shard, the plans received, the states that came with them."""

    def __init__(self, jobs: RunHost, spec: JobSpec, digest: str, frame: dict):
        self.jobs = jobs
        self.spec = spec
        self.digest = digest
        self.id = str(frame["run"])  # one run of the job: plans, acks and payload requests name it
        self.inst: str | None = None  # the local registration (Job.inst) this run feeds, once started here
        self.start_step = int(frame["start_step"])
        self.positions = _positions(frame["positions"])
        self.group_nodes: dict[int, tuple[str, ...]] = {}
        self.set_ranks(frame["rank_nodes"])
        self.shard = JobShard(jobs, spec, digest, int(frame["nparts"]), run=self.id)
        self.shard.cursor = frame.get("cursor")
        self.shard.costs = placement_costs(frame, len(spec.sources)) or self.shard.costs  # measured (autoscale)
        self.plans: dict[int, StepPlan] = {}
        self.early: dict[int, tuple] = {}
        self.states: dict[int, dict] = {}
        self.next_step = self.start_step  # the lowest step not yet received
        self.fed_step = self.start_step - 1  # the last step every constructor here queued
        self.feed_next = self.start_step  # the next step to hand to the job
        self.arrived = asyncio.Event()
        self.job: Job | None = None  # the registration of this job on this node, once started here
        self.closed = False
        self.steps: Steps | None = None
        # mixture changes (set_mixture): plans of an older (token, gen) are dropped; a cut drops plans >= cut
        self.gen_key = (0, 0)
        self.cuts = CutLog()
        self.holding: asyncio.Event | None = None  # constructors take up no new step while the leader cuts
        self.gated: dict[int, StepPlan] = {}  # plans constructors hold at the gate (take) during a hold
        self.hold_token = 0  # the fencing token of the leader that holds

    def set_ranks(self, rank_nodes: dict) -> None:
        g: dict[int, set] = {}
        for r, nid in rank_nodes.items():
            g.setdefault(self.spec.group_of(int(r)), set()).add(str(nid))
        self.group_nodes = {k: tuple(sorted(v)) for k, v in g.items()}

    def adopt(self, job: Job, positions: dict) -> None:
        """This node's registration of the job joins the run at the positions the leader gives."""
        self.inst = job.inst
        self.positions = _positions(positions)
        self.start_step = min(
            (self.positions[r] for r in job.ranks.conns if r in self.positions), default=(self.start_step, 0)
        )[0]
        # the lowest step not yet received here is where this node's ranks are: when they are behind the steps
        # received so far (their server restarted while the run went on), the leader's replay of the steps
        # between comes next (``catchup``) and must not be dropped as old
        self.next_step = self.start_step
        for s in [s for s in self.early if s < self.next_step]:
            del self.early[s]  # never counted (behind these ranks: never their turn)
        self._take_turns()
        self.fed_step = self.start_step - 1
        self.feed_next = self.start_step

    # ---- plans arriving -----------------------------------------------------------------------------------
    def add_plan(
        self,
        plan: StepPlan,
        state: dict | None,
        key: tuple[int, int] = (0, 0),
        cut: int | None = None,
        parts: list | None = None,
    ) -> None:
        """A plan from the leader (``parts``: its partition table, applied before the plan is counted)."""
        if key < self.gen_key:
            return  # planned before a mixture change: its steps were planned again
        if cut is not None and key > self.gen_key:
            self.cut(cut, key)  # the leader's mixcut to this node was lost: the first plan after it says the cut
        if plan.step < self.next_step or plan.step in self.early or plan.step in self.plans:
            return  # a re-sent plan (a new leader re-plans from an earlier step): identical, ignored
        if plan.step > self.next_step + KEEP_STATES:
            log.warning(
                "node %s: plan of step %d far past the missing step %d; dropped",
                self.jobs.node_id,
                plan.step,
                self.next_step,
            )
            return
        self.early[plan.step] = (plan, state, parts)  # a later step may overtake a re-sent one: keep it till its turn
        self._take_turns()

    def _take_turns(self) -> None:
        """The plans kept early from ``next_step`` on take their turn, in step order (the steps already held
        are passed): counted, their states kept. Called when a plan arrives and when the node's ranks say
        where they are (plans that came before, with a run this node heard of without ranks, wait for that)."""
        self._skip_held()
        if self.next_step not in self.early:
            return
        while self.next_step in self.early:
            plan, state, parts = self.early.pop(self.next_step)
            self.plans[plan.step] = plan
            if state is not None:
                self.states[plan.step] = state
                self.shard.cursor = state.get("cursor")
                self.shard.state = state
                _forget_through(self.states, plan.step - KEEP_STATES)
            self.repartition(parts)
            self.next_step = plan.step + 1
            self.shard.add_refs(plan, self.group_nodes)
            if self.shard.where.table.ended:
                retire(self.shard)
            self._skip_held()
            if self.inst is None:  # no ranks here (the node only owns data): no feed takes the plans
                _forget_through(self.plans, plan.step - KEEP_STATES)  # a cut or joining ranks take none older
        self.arrived.set()

    def repartition(self, parts: list | None) -> None:
        """The leader's partition table, with a plan or a resumed run's start (``cluster.parts``; None: none
        came): new partitions placed here open."""
        if parts is None:
            return
        try:
            changed = repartition(self.shard, parts)
        except (KeyError, TypeError, ValueError) as e:
            log.warning(
                "node %s: job %s: ignored a malformed partition table: %s", self.jobs.node_id, self.spec.name, e
            )
            return
        if changed:
            log.info(
                "node %s: job %s: partitions per source %s from step %d",
                self.jobs.node_id,
                self.spec.name,
                {name: self.shard.where.table.partitions(s) for s, name in enumerate(self.spec.source_names())},
                self.next_step,
            )
            self.jobs.tasks.spawn(self.jobs.rebalance(self), name="shard-repartition")

    def _skip_held(self) -> None:
        """Past the steps already received (they arrived before the node's ranks said where they are)."""
        while self.next_step in self.plans:
            self.next_step += 1

    # ---- PlanFeed -----------------------------------------------------------------------------------------
    def bind(self, steps: Steps) -> None:
        self.steps = steps

    async def next(self) -> tuple[StepPlan, int]:
        while self.feed_next not in self.plans:
            self.arrived.clear()
            try:  # a plan lost on a broken link: after a quiet while, tell the leader what we lack
                await asyncio.wait_for(self.arrived.wait(), self.jobs.probe)
            except TimeoutError:
                self.jobs.need(self)
        return self.plans.pop(self.feed_next), self.cuts.epoch

    def stale(self, plan: StepPlan, epoch: int) -> bool:
        return self.cuts.stale(plan, epoch)

    def fed(self, plan: StepPlan) -> None:
        self.fed_step = plan.step
        self.feed_next = plan.step + 1
        self.jobs.ack(self)

    async def take(self, plan: StepPlan) -> bool:
        """A constructor's gate before it takes up a step: waits out a hold; False if the step was cut."""
        epoch = self.cuts.epoch
        if self.holding is None:
            return True
        self.gated[id(plan)] = plan
        try:
            while self.holding is not None:
                await self.holding.wait()
        finally:
            self.gated.pop(id(plan), None)
        return not self.stale(plan, epoch)

    async def set_mixture(self, weights: dict) -> int:
        return await self.jobs.set_mixture(self, weights)

    async def state_at(self, step: int) -> dict:
        """The planner state at the start of ``step`` (it comes with that step's plan)."""
        while step not in self.states:
            # a step below next_step came and its state is gone; a later one comes with its plan (a node that
            # just restarted holds no state yet: wait, do not refuse)
            if step < self.next_step or self.closed:
                raise CheckpointError(
                    f"the server no longer holds the state of step {step} (recent steps "
                    f"{min(self.states, default=0)}..{self.next_step - 1}); call state_dict() "
                    "at the position you checkpoint"
                )
            self.arrived.clear()
            await self.arrived.wait()
        return self.states[step]

    def newest_state(self) -> dict | None:
        return self.states[max(self.states)] if self.states else None

    def position(self) -> tuple[int, Mixture] | None:
        state = self.newest_state()  # the leader plans: the newest state it sent is what this node knows
        return None if state is None else (int(state[K_STEP]) + 1, Mixture.from_dict(state[K_MIXTURE]))

    def saved_states(self, start: int, stop: int) -> tuple[tuple[int, dict] | None, dict[int, dict]]:
        return held_window(self.states, start, stop)

    def close(self) -> None:
        """The job that this run fed closed."""
        self.closed = True
        self.arrived.set()

    # ---- mixture changes (the leader cuts at the first step no constructor on any node has taken up) -------
    def hold(self, token: int) -> int:
        """Stop constructors taking up new steps (until the leader's cut or release, or a newer leader); the
        newest step taken up here."""
        self.hold_token = max(self.hold_token, token)
        if self.holding is None:
            ev = self.holding = asyncio.Event()
            self.jobs.tasks.spawn(self._hold_watch(ev), name="hold-watch")
        return self.steps.committed() if self.steps is not None else self.start_step - 1

    async def _hold_watch(self, ev: asyncio.Event) -> None:
        """A hold ends with the leader's cut (or its release). If that does not come within a probe period
        (the frame was lost), ask the leader where its mixture changes stand; a newer leader ends it too."""
        while self.holding is ev:
            with suppress(TimeoutError):
                await asyncio.wait_for(ev.wait(), self.jobs.probe)
            if self.holding is not ev:
                return
            if self.jobs.runs.get(self.digest) is not self:  # the run ended here meanwhile
                self.release_hold()
                return
            try:
                head = await self.jobs.mix_state(self)
            except PeerLostError as e:
                log.info(
                    "node %s: job %s: held for a mixture change; asking the leader: %s",
                    self.jobs.node_id,
                    self.spec.name,
                    e,
                )
                continue
            if head.get("busy") or self.holding is not ev:
                continue
            key = (int(head["token"]), int(head["gen"]))
            if head.get("cut") is not None and key > self.gen_key:
                log.info(
                    "node %s: job %s: the cut of a mixture change reached us late (step %s)",
                    self.jobs.node_id,
                    self.spec.name,
                    head["cut"],
                )
                self.cut(int(head["cut"]), key)
            else:
                self.release_hold()

    def release_hold(self, older_than: int | None = None) -> None:
        """End the hold (only if its leader's token is older than ``older_than``, when given)."""
        ev = self.holding
        if ev is None or (older_than is not None and self.hold_token >= older_than):
            return
        self.holding = None
        ev.set()

    def cut(self, cut: int | None, key: tuple[int, int]) -> None:
        """Apply a mixture change: drop every plan of steps >= cut (re-planned by the leader), then release."""
        if cut is not None and key > self.gen_key:
            self.gen_key = key
            self.cuts.record(cut)
            dropped = {id(p): p for s, p in self.plans.items() if s >= cut}
            for s in [s for s in self.plans if s >= cut]:
                del self.plans[s]
            for s in [s for s in self.early if s >= cut]:
                del self.early[s]  # never counted (add_refs runs when a plan takes its turn)
            for s in [s for s in self.states if s >= cut]:
                del self.states[s]
            if self.steps is not None:
                dropped.update({id(p): p for p in self.steps.drop_from(cut)})
            dropped.update({id(p): p for p in self.gated.values() if p.step >= cut})
            for p in dropped.values():
                self.shard.drop_refs(p, self.group_nodes)
            self.next_step = min(self.next_step, cut)
            self.fed_step = min(self.fed_step, cut - 1)
            self.feed_next = min(self.feed_next, cut)
            log.info(
                "node %s: job %s: mixture change from step %d (%d planned step(s) dropped)",
                self.jobs.node_id,
                self.spec.name,
                cut,
                len(dropped),
            )
        self.release_hold()
