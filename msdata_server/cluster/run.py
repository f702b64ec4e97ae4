"""One job run as a node knows it, and its PlanFeed: the leader's plans, kept in step order.

The leader sends every node every step's plan (with the planner state at its start, its fencing token, the
mixture-change generation and the latest cut). A node keeps them in step order, ignores duplicates (a new
leader re-plans from an earlier step), counts the payload references of the partitions it owns as each plan
takes its turn, and hands them to its job's constructors (``PlanFeed``). A node that lacks a step for a
probe period asks the leader for it.

Mixture changes: the leader holds every node (constructors take up no new step), learns the newest step
taken up anywhere, cuts after it and releases the nodes with the cut; plans of steps >= cut are dropped
everywhere (with their references) and planned again.

A run uses the node through its ``ClusterContext`` (``cluster.context``) only; the leader on this node reads
it through ``HeldRun`` (``leader.coordinator``): its id, partition layout and the lengths of its sources.
``RunTable`` holds this node's runs by job digest.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Iterator
from contextlib import suppress
from typing import TYPE_CHECKING

import numpy as np

from msdata_client.spec import JobSpec

from ..autoscale.cluster import placement_costs
from ..errors import CheckpointError, MsdataError, PeerLostError
from ..job.seams import CutLog, Steps
from ..planner import Mixture, StepPlan
from ..planner.history import StateHistory
from ..planner.state import K_MIXTURE, K_STEP
from .context import ClusterContext, ack_due
from .placement import PartitionLayout
from .shard import JobShard, ShardPayloads, answer, repartition, retire

if TYPE_CHECKING:
    from ..job import Job

__all__ = ["KEEP_STATES", "Run", "RunTable"]


def _positions(wire: dict) -> dict[int, tuple[int, int]]:
    """Rank -> (step, micro) from a jstart frame (JSON keys are strings)."""
    return {int(r): (int(p[0]), int(p[1])) for r, p in wire.items()}


log = logging.getLogger(__name__)

KEEP_STATES = 256  # planner states kept per run for state_dict() (kilobytes each)


def _forget_through(by_step: dict[int, StepPlan], step: int) -> None:
    """Drop the entries of steps <= ``step`` from a dict filled in step order (after a cut: nearly; a later
    call takes what one left)."""
    while by_step:
        first = next(iter(by_step))
        if first > step:
            return
        del by_step[first]


class Run:
    """One job run on this node: the shard, the plans received, the states that came with them."""

    def __init__(self, ctx: ClusterContext, spec: JobSpec, digest: str, frame: dict) -> None:
        self.ctx = ctx
        self.spec = spec
        self.digest = digest
        self.id = str(frame["run"])  # one run of the job: plans, acks and payload requests name it
        self.inst: str | None = None  # the local registration (Job.inst) this run feeds, once started here
        self.start_step = int(frame["start_step"])
        self.positions = _positions(frame["positions"])
        self.group_nodes: dict[int, tuple[str, ...]] = {}
        self.set_ranks(frame["rank_nodes"])
        self.shard = JobShard(ctx, spec, digest, int(frame["nparts"]), run=self.id)
        self.shard.cursor = frame.get("cursor")
        self.shard.costs = placement_costs(frame, len(spec.sources)) or self.shard.costs  # measured (autoscale)
        self.plans: dict[int, StepPlan] = {}
        self.early: dict[int, tuple[StepPlan, dict | None, list | None, bool]] = {}  # (..., skipped)
        self.passed: set[int] = set()  # steps received as skipped (loader.skip): the feed hands them to nobody
        self.states = StateHistory(KEEP_STATES)  # the planner state at the start of each recent step
        self.next_step = self.start_step  # the lowest step not yet received
        self.fed_step = self.start_step - 1  # the last step every constructor here queued
        self.feed_next = self.start_step  # the next step to hand to the job
        self.acked: int | None = None  # the last fed step the leader was told of (None: none yet)
        self.arrived = asyncio.Event()
        self.job: Job | None = None  # the registration of this job on this node, once started here
        self.closed = False  # the job this run fed closed
        self.ended = False  # the run ended here (``end``)
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
        *,
        skipped: bool = False,
    ) -> None:
        """A plan from the leader (``parts``: its partition table, applied before the plan is counted;
        ``skipped``: a step ``loader.skip`` skips, its pieces released here and never handed out)."""
        if key < self.gen_key:
            return  # planned before a mixture change: its steps were planned again
        if cut is not None and key > self.gen_key:
            self.cut(cut, key)  # the leader's mixcut to this node was lost: the first plan after it says the cut
        if plan.step < self.next_step or plan.step in self.early or plan.step in self.plans or plan.step in self.passed:
            return  # a re-sent plan (a new leader re-plans from an earlier step): identical, ignored
        if plan.step > self.next_step + KEEP_STATES:
            log.warning(
                "node %s: plan of step %d far past the missing step %d; dropped",
                self.ctx.node_id,
                plan.step,
                self.next_step,
            )
            return
        # a later step may overtake a re-sent one: keep it till its turn
        self.early[plan.step] = (plan, state, parts, skipped)
        self._take_turns()

    def _take_turns(self) -> None:
        """The plans kept early from ``next_step`` on take their turn, in step order (the steps already held
        are passed): counted, their states kept. Called when a plan arrives and when the node's ranks say
        where they are (plans that came before, with a run this node heard of without ranks, wait for that)."""
        self._skip_held()
        if self.next_step not in self.early:
            return
        while self.next_step in self.early:
            plan, state, parts, skipped = self.early.pop(self.next_step)
            if skipped:
                self.passed.add(plan.step)
            else:
                self.plans[plan.step] = plan
            if state is not None:
                self.states.record(plan.step, state)  # forgets the states of steps <= step - KEEP_STATES
                self.shard.cursor = state.get("cursor")
                self.shard.state = state
            self.repartition(parts)
            self.next_step = plan.step + 1
            if skipped:
                self.shard.skip_refs(plan)
            else:
                self.shard.add_refs(plan, self.group_nodes)
            if self.shard.where.table.ended:
                retire(self.shard)
            self._skip_held()
            if self.inst is None:  # no ranks here (the node only owns data): no feed takes the plans
                _forget_through(self.plans, plan.step - KEEP_STATES)  # a cut or joining ranks take none older
                self.passed = {s for s in self.passed if s > plan.step - KEEP_STATES}
        self.arrived.set()
        if self.inst is not None and self.acked is not None:
            self._ack()  # the leader may be about to wait for our position to plan further

    def repartition(self, parts: list | None) -> None:
        """The leader's partition table, with a plan or a resumed run's start (``cluster.parts``; None: none
        came): new partitions placed here open."""
        if parts is None:
            return
        try:
            changed = repartition(self.shard, parts)
        except (KeyError, TypeError, ValueError) as e:
            log.warning("node %s: job %s: ignored a malformed partition table: %s", self.ctx.node_id, self.spec.name, e)
            return
        if changed:
            log.info(
                "node %s: job %s: partitions per source %s from step %d",
                self.ctx.node_id,
                self.spec.name,
                {name: self.shard.where.table.partitions(s) for s, name in enumerate(self.spec.source_names())},
                self.next_step,
            )
            self.ctx.tasks.spawn(self.rebalance(), name="shard-repartition")

    def _skip_held(self) -> None:
        """Past the steps already received (they arrived before the node's ranks said where they are)."""
        while self.next_step in self.plans or self.next_step in self.passed:
            self.next_step += 1

    # ---- PlanFeed -----------------------------------------------------------------------------------------
    def bind(self, steps: Steps) -> None:
        self.steps = steps

    async def next(self) -> tuple[StepPlan, int]:
        while self._pass_skipped() not in self.plans:
            self.arrived.clear()
            try:  # a plan lost on a broken link: after a quiet while, tell the leader what we lack
                await asyncio.wait_for(self.arrived.wait(), self.ctx.probe)
            except TimeoutError:
                self.ctx.need(self)
        return self.plans.pop(self.feed_next), self.cuts.epoch

    def _pass_skipped(self) -> int:
        """The next step to hand to the job, past those received as skipped (``loader.skip``)."""
        while self.feed_next in self.passed:
            self.passed.discard(self.feed_next)
            self.feed_next += 1
        return self.feed_next

    def stale(self, plan: StepPlan, epoch: int) -> bool:
        return self.cuts.stale(plan, epoch)

    def fed(self, plan: StepPlan) -> None:
        self.fed_step = plan.step
        self.feed_next = plan.step + 1
        self._ack()

    def _ack(self) -> None:
        """Tell the leader the last step fed, when that is due (``context.ack_due``: every few steps, at once
        when the leader is about to wait for it)."""
        if ack_due(self.fed_step, self.acked, self.next_step - 1, self.spec.prefetch_steps + 1):
            self.acked = self.fed_step
            self.ctx.ack(self)

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
        """A rank's set_mixture, asked of the leader (it cuts and re-plans); the cut step."""
        return await self.ctx.set_mixture(self, weights)

    async def state_at(self, step: int) -> dict:
        """The planner state at the start of ``step`` (it comes with that step's plan)."""
        while step not in self.states:
            # a step below next_step came and its state is gone; a later one comes with its plan (a node that
            # just restarted holds no state yet: wait, do not refuse)
            if step < self.next_step or self.closed:
                raise CheckpointError(
                    f"the server no longer holds the state of step {step} (recent steps "
                    f"{self.states.oldest()}..{self.next_step - 1}); call state_dict() "
                    "at the position you checkpoint"
                )
            self.arrived.clear()
            await self.arrived.wait()
        return self.states[step]

    def newest_state(self) -> dict | None:
        return self.states.newest()

    def position(self) -> tuple[int, Mixture] | None:
        state = self.newest_state()  # the leader plans: the newest state it sent is what this node knows
        return None if state is None else (int(state[K_STEP]) + 1, Mixture.from_dict(state[K_MIXTURE]))

    def saved_states(self, start: int, stop: int) -> tuple[tuple[int, dict] | None, dict[int, dict]]:
        return self.states.window(start, stop)

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
            self.ctx.tasks.spawn(self._hold_watch(ev), name="hold-watch")
        return self.steps.committed() if self.steps is not None else self.start_step - 1

    async def _hold_watch(self, ev: asyncio.Event) -> None:
        """A hold ends with the leader's cut (or its release). If that does not come within a probe period
        (the frame was lost), ask the leader where its mixture changes stand; a newer leader ends it too."""
        while self.holding is ev:
            with suppress(TimeoutError):
                await asyncio.wait_for(ev.wait(), self.ctx.probe)
            if self.holding is not ev:
                return
            if self.ended:  # the run ended here meanwhile
                self.release_hold()
                return
            try:
                head = await self.ctx.mix_state(self)
            except PeerLostError as e:
                log.info(
                    "node %s: job %s: held for a mixture change; asking the leader: %s",
                    self.ctx.node_id,
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
                    self.ctx.node_id,
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
            self.passed = {s for s in self.passed if s < cut}  # skipped again (or not) as the leader re-plans
            self.states.forget_from(cut)
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
                self.ctx.node_id,
                self.spec.name,
                cut,
                len(dropped),
            )
        self.release_hold()

    # ---- what the node's job layer and the leader here ask of the run ----------------------------------------
    @property
    def layout(self) -> PartitionLayout:
        """Who owns (and stands by for) each partition of the run, and its partition table (``HeldRun``)."""
        return self.shard.where

    async def lengths(self, s: int, start: int, count: int) -> np.ndarray:
        """Lengths of [start, start+count) of source s, asked of the partition owners (``HeldRun``)."""
        return await self.shard.lengths(s, start, count)

    async def vision(self, s: int, start: int, count: int) -> tuple[np.ndarray, np.ndarray]:
        """(images per sample, patches per image) of a span of source s (``HeldRun``)."""
        return await self.shard.vision(s, start, count)

    def parts_wire(self) -> list:
        """The run's partition table as this node holds it (splits and merges), for the leader's report."""
        return self.shard.where.table.wire()

    async def rebalance(self) -> None:
        """Open the partitions placed here now, close the others (a node went or came, a split or merge)."""
        try:
            await self.shard.rebalance()
        except MsdataError as e:
            log.warning("node %s: re-placing partitions of %s: %s", self.ctx.node_id, self.spec.name, e)

    def node_down(self, nid: str) -> bool:
        """Our link to nid broke: its partitions go to their standbys; True if the placement changed."""
        return self.shard.where.node_down(nid)

    def node_up(self, nid: str) -> bool:
        """A link to nid came (back) up; True if nid was down for this run (then it rebalances)."""
        where = self.shard.where
        if nid not in where.down:
            return False
        where.node_up(nid)
        return True

    def unref(self, src: np.ndarray, ords: np.ndarray) -> None:
        """Occurrences a builder will not fetch (``skip``): their references drop."""
        self.shard.unref(src, ords)

    async def serve(self, frame: dict) -> tuple[dict, bytes]:
        """A peer's ``len``, ``vis`` or ``fetch`` request, answered from the partitions here."""
        return await answer(self.shard, frame)

    def payloads(self) -> ShardPayloads:
        """The job's PayloadSource: this run's shard (the run closes it at its end)."""
        return ShardPayloads(self.shard)

    def status(self) -> dict:
        """This run on this node (with ranks or only as a data owner)."""
        shard, table = self.shard, self.shard.where.table
        return {
            "job": self.spec.name,
            "run": self.id,
            "ranks_here": self.job is not None,
            "next_step": self.next_step,
            "fed": self.fed_step,
            "partitions_here": len(shard.loaders),
            "partitions": {n: table.partitions(s) for s, n in enumerate(self.spec.source_names())},
            "shadows_here": len(shard.shadows),
            "takeovers": shard.takeovers,
            "payloads_pending": len(shard.refs),
        }

    def end(self) -> None:
        """The run ended here (every rank left, or a new run of the job started): a hold watch stops."""
        self.ended = True

    async def aclose(self) -> None:
        await self.shard.aclose()


class RunTable:
    """This node's runs by job digest (at most one per job: a new run replaces the ended one); whoever waits for
    a run to start here is woken when one does."""

    def __init__(self) -> None:
        self._runs: dict[str, Run] = {}
        self._added = asyncio.Event()  # set (and replaced) whenever a run starts here

    def __iter__(self) -> Iterator[Run]:
        return iter(list(self._runs.values()))  # a copy: callers may end runs meanwhile

    def __len__(self) -> int:
        return len(self._runs)

    def get(self, digest: str) -> Run | None:
        return self._runs.get(digest)

    def held(self, digest: str, run_id: str) -> Run | None:
        """This node's run ``run_id`` of a job, if it takes part in it (the leader's ``LocalRuns``)."""
        run = self._runs.get(digest)
        return run if run is not None and run.id == run_id else None

    def named(self, frame: dict) -> Run | None:
        """The run a frame is about (None: a run that ended here, or one not started here yet)."""
        return self.held(str(frame.get("digest")), str(frame.get("run")))

    async def started(self, frame: dict, timeout: float) -> Run | None:  # noqa: ASYNC109  (its own deadline)
        """The run a peer asks about; its start may still be on the way from the leader: wait up to timeout."""
        loop = asyncio.get_running_loop()
        end = loop.time() + timeout
        while (run := self.named(frame)) is None and loop.time() < end:
            with suppress(TimeoutError):
                await asyncio.wait_for(self._added.wait(), end - loop.time())
        return run

    def add(self, run: Run) -> None:
        self._runs[run.digest] = run
        self._added.set()
        self._added = asyncio.Event()

    def remove(self, run: Run) -> None:
        """``run`` ends here (if it is still the run of its job)."""
        if self._runs.get(run.digest) is run:
            del self._runs[run.digest]
        run.end()

    def clear(self) -> None:
        for run in self:
            run.end()
        self._runs.clear()
