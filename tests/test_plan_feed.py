"""A node's PlanFeed (``cluster.run.Run``): plans from the leader taken in step order, whatever order they come
in and whenever the node's ranks say where they are. No processes: the run, its shard's reference counts and
the planner are the real ones; the node around them is a small host."""

from __future__ import annotations

import asyncio

import numpy as np

from msdata_server.cluster.run import KEEP_STATES, Run
from msdata_server.planner import Mixture, Planner, PlannerConfig
from msdata_server.tasks import TaskSet

from .e2e_util import small_job

NODES = ["node-0", "node-1", "node-2"]


class _Host:
    """What a Run asks of its node's ClusterJobs; ``needs`` records what it told the leader it lacks."""

    node_id = "node-1"
    pool = None
    probe = 0.05

    def __init__(self):
        self.tasks = TaskSet("test")
        self.runs: dict[str, Run] = {}
        self.needs: list[int] = []
        self.asked = asyncio.Event()
        self.acks: list[int] = []

    def live_nodes(self) -> list[str]:
        return list(NODES)

    def need(self, run: Run) -> None:
        self.needs.append(run.next_step)
        self.asked.set()

    def ack(self, run: Run) -> None:
        self.acks.append(run.fed_step)

    async def rebalance(self, run: Run) -> None:
        return None


class _View:
    def lengths(self, source, start, count):
        return np.random.default_rng(source * 1000003 + start).integers(1, 24, size=count).astype(np.int64)


class _Job:
    """The node's registration of the job: its inst and the ranks connected here."""

    inst = "inst-1"

    class ranks:
        conns = {1: object()}  # noqa: RUF012  (a stand-in's fixed table)


def _plans(steps: int):
    cfg = PlannerConfig(
        sources=("a", "b"), seq_len=64, dp=3, micro_batches=2, rows=1, mixture=Mixture.constant({"a": 0.4, "b": 0.6})
    )
    planner = Planner(cfg)
    out = []
    for _ in range(steps):
        state = planner.state_dict()
        out.append((planner.plan_step(_View()), state))
    return out


def _start_frame() -> dict:
    """The run as the leader tells it a node that restarted without ranks (``CatchUp.relink``: positions of the
    run's start, no registrations)."""
    return {
        "run": "r1",
        "start_step": 0,
        "positions": {str(r): [0, 0] for r in range(3)},
        "rank_nodes": {str(r): NODES[r] for r in range(3)},
        "nparts": 3,
    }


def test_plans_that_came_before_the_ranks_said_where_they_are_take_their_turn():
    """A follower restarted mid-run: the leader tells it the run (no ranks yet) and re-sends the plans its rank
    lacks, and only then do the rank's registration and position arrive (steps 6..7, from step 6). The plans
    kept early are the ones the feed needs: they take their turn when the position comes, and a re-send of
    them (ignored as a duplicate) is not needed for that. Before the fix the feed waited forever, asking the
    leader every probe period for plans it already held (a hang on CI)."""
    spec = small_job("feed", dp=3, samples=400, seed=5, prefetch=1)
    plans = _plans(8)

    async def main():
        host = _Host()
        run = Run(host, spec, "digest", _start_frame())
        for plan, state in plans[6:8]:  # the re-send of steps 6..7 crosses the rank's start
            run.add_plan(plan, state)
        assert run.next_step == 0
        assert sorted(run.early) == [6, 7]
        run.adopt(_Job(), {"0": [8, 0], "1": [6, 0], "2": [8, 0]})
        assert run.next_step == 8
        assert not run.early
        fed = []
        for _ in range(2):
            plan, _epoch = await asyncio.wait_for(run.next(), 2)
            run.fed(plan)
            fed.append(plan.step)
        assert fed == [6, 7]
        assert host.acks == [6, 7]  # step 7: the leader (window 2) may plan up to 8 only: about to wait on us
        assert host.needs == []
        assert run.states[6] == plans[6][1]
        # a duplicate after the turn is ignored; the next step is asked for when it does not come
        run.add_plan(*plans[7])
        waiting = asyncio.ensure_future(run.next())
        await asyncio.wait_for(host.asked.wait(), 5)
        assert host.needs[0] == 8
        assert not waiting.done()
        waiting.cancel()

    asyncio.run(main())


def test_plans_behind_the_ranks_are_dropped_and_later_ones_wait_their_turn():
    """Plans kept early for steps behind the position the ranks give are never their turn: dropped, and never
    counted. Plans after a gap wait for it; the gap filled, all take their turn in order."""
    spec = small_job("feed", dp=3, samples=400, seed=5, prefetch=1)
    plans = _plans(8)

    async def main():
        host = _Host()
        run = Run(host, spec, "digest", _start_frame())
        for i in (2, 3, 6):
            run.add_plan(*plans[i])
        run.adopt(_Job(), {"1": [4, 0]})
        assert run.next_step == 4, "plans behind the ranks were kept"
        assert sorted(run.early) == [6], "plans behind the ranks were kept"
        assert len(run.shard.refs) == 0, "a plan that never took its turn was counted"
        run.add_plan(*plans[5])
        run.add_plan(*plans[4])
        assert run.next_step == 7
        assert not run.early
        assert len(run.shard.refs) > 0
        fed = []
        for _ in range(3):
            plan, _epoch = await asyncio.wait_for(run.next(), 2)
            run.fed(plan)
            fed.append(plan.step)
        assert fed == [4, 5, 6]

    asyncio.run(main())


def test_a_node_that_only_owns_data_keeps_the_plans_of_recent_steps_only():
    """A node with no ranks of the run counts every plan's payload references but no feed takes its plans: it
    keeps those of the last KEEP_STATES steps (before, one per step of the run: memory that grew for as long as
    the run went on). A mixture change still takes back the references of the plans it cuts."""
    spec = small_job("feed", dp=3, samples=400, seed=5, prefetch=1)
    steps = KEEP_STATES + 200
    plans = _plans(steps)

    async def main():
        host = _Host()
        run = Run(host, spec, "digest", _start_frame())
        counted = []
        for plan, state in plans:
            run.add_plan(plan, state)
            counted.append(len(run.shard.refs))
        assert run.next_step == steps
        assert not run.early
        assert sorted(run.plans) == list(range(steps - KEEP_STATES, steps)), "a data owner kept old plans"
        assert len(run.states) <= KEEP_STATES
        # every plan was counted as it took its turn, the trimmed ones too
        assert counted[-1] > counted[KEEP_STATES] > 0
        run.cut(steps - 3, (0, 1))
        assert sorted(run.plans)[-1] == steps - 4
        assert run.next_step == steps - 3
        assert len(run.shard.refs) < counted[-1], "the cut plans' references were not taken back"

    asyncio.run(main())


def test_a_node_acknowledges_every_few_steps_and_at_once_when_the_leader_waits_on_it():
    """Acknowledgements (``context.ack_due``): the first step fed at once; then every ACK_EVERY steps while the
    leader plans ahead unhindered; and as soon as the plans held reach one short of the last acknowledged step
    + the leader's window (prefetch_steps + 1: the leader plans its last allowed step and would then wait),
    whether that happens at a feed or at a plan's arrival. Neither the leader nor a node waits for a plan
    because an acknowledgement was held back."""
    from msdata_server.cluster.context import ACK_EVERY, ack_due

    assert ack_due(3, None, 3, 2)
    assert ack_due(2, 5, 9, 2)
    assert not ack_due(5, 5, 9, 2)  # nothing new fed
    spec = small_job("feed", dp=3, samples=400, seed=5, prefetch=8)  # window 9: the leader is far from waiting
    plans = _plans(20)

    async def main():
        host = _Host()
        run = Run(host, spec, "digest", _start_frame())
        run.adopt(_Job(), {"1": [0, 0]})
        for p in plans[:12]:  # a leader slower than the feed: each plan fed as it comes
            run.add_plan(*p)
            plan, _epoch = await asyncio.wait_for(run.next(), 2)
            run.fed(plan)
        assert host.acks == [0, ACK_EVERY, 2 * ACK_EVERY], "acknowledged more often than every ACK_EVERY steps"
        # now the leader gets ahead: it may plan up to 2 * ACK_EVERY + 9 = 17 (the window past the last
        # acknowledgement), then waits; the plan of step 16 arriving makes the node say where it is at once
        for p in plans[12:16]:
            run.add_plan(*p)
        assert host.acks[-1] == 2 * ACK_EVERY
        run.add_plan(*plans[16])
        assert host.acks[-1] == 11, "the node did not tell a leader about to wait on it where it is"

    asyncio.run(main())
