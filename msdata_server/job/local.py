"""A single node: the start barrier and start point of a job here, and its PlanFeed (the planner runs here).

The plan feed plans one step at a time in a thread, at most ``prefetch_steps`` ahead of the constructors (the
group queues push back), saves the planner state of every step to ``state_dir`` first (a SIGKILL loses
nothing), and counts each plan's piece references as it hands it out.
"""

from __future__ import annotations

import asyncio
import logging

from msdata_client.spec import JobSpec

from ..checkpoint import StateStore, start_point
from ..errors import CheckpointError
from ..lineage.replay import held_window
from ..lineage.skip import skip_ahead
from ..loader import SourceLoader
from ..planner import Planner, StepPlan
from ..planner.history import StateHistory
from ..planner.spec import planner_config
from ..sources import open_source
from .images import source_transform
from .job import Job
from .payloads import LocalPayloads
from .seams import CutLog, Steps
from .view import ThreadView

__all__ = ["LocalPlanFeed", "LocalStarter"]

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
            plan = await asyncio.to_thread(planner.plan_step, self._view)
            self.payloads.planned(plan)
            return plan, self.cuts.epoch

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

    def saved_states(self, start: int, stop: int) -> tuple[tuple[int, dict] | None, dict[int, dict]]:
        base, held = held_window(self.history.states, start, stop)
        if base is None:  # older than the memory holds: the node's stored states
            base = self.store.load_at_or_before(start)
        return base, held

    def close(self) -> None:
        if self._view is not None:
            self._view.close()  # wakes a planner thread blocked on metadata


class LocalStarter:
    """Starts jobs on one node: when every rank of a job's mesh registered here, from the start point the
    ranks and the node's checkpoints give (``checkpoint.start_point``)."""

    def __init__(self, *, pool, state_dir: str, ring_slots: int):
        self.pool = pool
        self.state_dir = state_dir
        self.ring_slots = ring_slots

    async def ranks_changed(self, job: Job) -> None:
        if job.state != "waiting" or not job.ranks.complete():
            return
        await job.may_start.wait()
        await job.start_with(lambda: self._prepare(job))

    async def _prepare(self, job: Job) -> tuple[LocalPlanFeed, LocalPayloads, dict]:
        spec = job.spec
        store = StateStore(self.state_dir, spec.name, job.digest)
        sp = start_point(job.ranks.starts(), spec.layout())
        if sp.clear:
            store.clear()  # a new run (or one from the ranks' states): what the node remembers does not apply
        state = sp.planner
        if sp.load_at is not None:
            found = store.load_at_or_before(sp.load_at)
            if found is not None:
                log.info(
                    "job %s: continuing from the node's checkpoint of step %d (ranks at step %d)",
                    spec.name,
                    found[0],
                    sp.load_at,
                )
                state = found[1]
            else:
                log.warning(
                    "job %s: no checkpoint at or before step %d; replaying from the beginning", spec.name, sp.load_at
                )
        planner = Planner(planner_config(spec), state=state)  # a state that does not fit fails before any I/O
        if sp.skip:  # loader.skip: plan the skipped steps, deliver from the step after them
            state, skipped = await skip_ahead(spec, state, sp.skip, self.pool, defer=sp.defer)
            for step, st in skipped.items():
                await store.persist(step, st)  # lineage replays the skipped steps from these
            planner = Planner(planner_config(spec), state=state)
            log.info("job %s: skipped steps %d..%d (loader.skip)", spec.name, planner.step - sp.skip, planner.step - 1)
        loaders = await self._open_loaders(spec, state)
        job.source_sizes = {ld.name: ld.source.num_samples for ld in loaders}  # status: epochs completed
        payloads = LocalPayloads(loaders)
        keep = max(64, spec.prefetch_steps + self.ring_slots + 4)
        return LocalPlanFeed(planner, store, payloads, keep=keep, name=spec.name), payloads, sp.positions

    async def _open_loaders(self, spec: JobSpec, state: dict | None) -> list[SourceLoader]:
        # sources open in a thread: opening many files must not stall the loop
        sources = await asyncio.to_thread(lambda: [open_source(s, seed=spec.seed) for s in spec.sources])
        loaders = [
            SourceLoader(src, self.pool, transform=source_transform(spec, s), seed=spec.seed)
            for src, s in zip(sources, spec.sources)
        ]
        cursor = (state or {}).get("cursor") or [0] * len(loaders)
        for ld, at in zip(loaders, cursor):
            ld.seek(int(at))  # a resumed job reads on from its position (carried pieces: on demand)
            await ld.start()
        return loaders
