"""The single-node PlanFeed: the planner runs here.

The plan feed plans one step at a time in a thread, at most ``prefetch_steps`` ahead of the constructors (the
group queues push back), saves the planner state of every step to ``state_dir`` first (a SIGKILL loses
nothing), and counts each plan's piece references as it hands it out.
"""

from __future__ import annotations

import asyncio
import logging

from ..checkpoint import StateStore
from ..errors import CheckpointError
from ..job.seams import CutLog, Steps
from ..job.view import ThreadView
from ..lineage.skip import skip_pending
from ..planner import Mixture, Planner, StepPlan
from ..planner.history import StateHistory
from .payloads import LocalPayloads

__all__ = ["LocalPlanFeed"]

log = logging.getLogger(__name__)


class LocalPlanFeed:
    """PlanFeed of a job planned on this node (see the module docstring)."""

    def __init__(self, planner: Planner, store: StateStore, payloads: LocalPayloads, *, keep: int, name: str):
        self.planner = planner
        self.start_step = planner.step
        self.store = store
        self.payloads = payloads
        self.history = StateHistory(keep)
        self.cuts = CutLog()
        self.name = name
        self._lock = asyncio.Lock()  # the planner is touched by one coroutine (or its thread) at a time
        self._view: ThreadView | None = None
        self._steps: Steps | None = None

    def bind(self, steps: Steps) -> None:
        self._steps = steps

    async def next(self) -> tuple[StepPlan, int]:
        if self._view is None:
            self._view = ThreadView(
                self.payloads.lengths,
                asyncio.get_running_loop(),
                closed="job closed while planning",
                ask_vision=self.payloads.vision,
            )
        async with self._lock:
            planner = self.planner
            step = planner.step
            state = planner.state_dict()
            self.history.record(step, state)
            await self.store.persist(step, state)  # small; a SIGKILL loses nothing (waits while state_dir fails)
            if planner.pending_skip is not None:  # loader.skip(steps=(A, B)): at A, plan A..B-1 and skip them
                await self._skip_pending(planner)
            plan = await asyncio.to_thread(planner.plan_step, self._view)
            self.payloads.planned(plan)
            return plan, self.cuts.epoch

    async def _skip_pending(self, planner: Planner) -> None:
        """At the first step of the planner's pending skip: plan its steps, store their states (lineage), and
        release what the loaders read ahead for them (their pieces count planned and done at once)."""
        assert self._view is not None
        sizes = [ld.source.num_samples for ld in self.payloads.loaders]
        skipped, states, _ = await asyncio.to_thread(skip_pending, planner, self._view, sizes)
        if not skipped:
            return
        for step, st in sorted(states.items()):
            self.history.record(step, st)
            await self.store.persist(step, st)
        for p in skipped:
            self.payloads.planned(p)
            await self.payloads.skip(p.source, p.ordinal)
        state = planner.state_dict()
        self.history.record(planner.step, state)
        await self.store.persist(planner.step, state)
        log.info("job %s: skipped steps %d..%d (loader.skip)", self.name, skipped[0].step, skipped[-1].step)

    def stale(self, plan: StepPlan, epoch: int) -> bool:
        return self.cuts.stale(plan, epoch)

    def fed(self, plan: StepPlan) -> None:
        pass  # nobody waits for it on one node: the group queues bound how far planning runs ahead

    async def take(self, plan: StepPlan) -> bool:
        return True  # a mixture change here cuts only steps no constructor took up (nothing holds them)

    async def set_mixture(self, weights: dict) -> int:
        """Use these weights from the first step no constructor took up (returned); steps planned past it are
        planned again. Recorded in the planner state (and the node's checkpoint) before returning."""
        assert self._steps is not None, "bind() before set_mixture"
        async with self._lock:
            cut = self._steps.committed() + 1
            planner = self.history.rebase(self.planner, cut, weights)  # ConfigError: nothing changed
            dropped = self._steps.drop_from(cut)
            for p in dropped:
                self.payloads.unplanned(p)
            self.cuts.record(cut)
            self.planner = planner
            await self.store.persist(cut, planner.state_dict())  # the state rebase recorded
        log.info("job %s: mixture %s from step %d (%d planned steps re-planned)", self.name, weights, cut, len(dropped))
        return cut

    async def state_at(self, step: int) -> dict:
        async with self._lock:
            if step == self.planner.step:
                return self.planner.state_dict()
            state = self.history.get(step)
        if state is None:
            raise CheckpointError(
                f"the server no longer holds the state of step {step} (it keeps recent steps "
                f"{self.history.span()}); call state_dict() at the position you checkpoint"
            )
        return state

    def newest_state(self) -> dict | None:
        return self.history.newest()

    def position(self) -> tuple[int, Mixture]:
        return self.planner.step, self.planner.mixture  # it plans here: its planner is the newest word

    def saved_states(self, start: int, stop: int) -> tuple[tuple[int, dict] | None, dict[int, dict]]:
        base, held = self.history.window(start, stop)  # (its thinned older states too)
        if base is None:  # older than the memory holds: the node's stored states
            base = self.store.load_at_or_before(start)
        return base, held

    def close(self) -> None:
        if self._view is not None:
            self._view.close()  # wakes a planner thread blocked on metadata
