"""``loader.skip(steps=k)`` at a run's start: the planner plans steps s..s+k-1 from the ranks' state and the run
delivers from s+k on. The plans of later steps are exactly those of an uninterrupted run (the state at s+k is
the same), so the skipped pieces are the only ones missing; the state records the range for lineage.

Both planning homes call ``skip_ahead`` with the start point's ``skip`` (``checkpoint.start_point``) before they
open their loaders at the new position, and store the states of the skipped steps like any others.

``loader.skip(steps=(A, B))`` from a state saved before A travels in the planner state as its pending skip
(``planner.state.PendingSkip``); each planning home calls ``skip_pending`` before it plans a step, which at
step A plans A..B-1 the same way (``skip_steps``, one rule for both) and hands back the skipped plans: their
pieces were read ahead by the loaders, which release them (they are counted planned and done at once).
"""

from __future__ import annotations

import asyncio
from collections.abc import Sequence

from msdata_client.spec import JobSpec

from ..job.view import ThreadView
from ..planner import MetadataView, Planner, StepPlan
from ..planner.deferred import Deferred, Insert, pieces_of
from ..planner.spec import planner_config
from ..sources import open_source
from .data import DataView

__all__ = ["skip_ahead", "skip_pending", "skip_steps", "source_sizes"]


async def skip_ahead(
    spec: JobSpec, state: dict | None, steps: int, pool=None, *, defer: bool = False
) -> tuple[dict, dict[int, dict]]:
    """The planner state ``steps`` steps after ``state`` with the skipped range recorded (``defer``: and the
    skipped pieces inserted after the rest of each source's epoch), and the states at the start of each
    skipped step (for the store: lineage replays the skipped steps from them)."""
    cfg = planner_config(spec)
    data = await DataView.open(spec, pool, vision=cfg.vlm_cost is not None)
    view = ThreadView(data.lengths, asyncio.get_running_loop(), closed="skip stopped", ask_vision=data.vision)

    def plan() -> tuple[dict, dict[int, dict]]:
        planner = Planner(cfg, state=state)
        states = skip_steps(planner, view, steps, [src.num_samples for src in data.sources], defer=defer)[1]
        return planner.state_dict(), states

    try:
        return await asyncio.to_thread(plan)
    finally:
        view.close()
        await data.aclose()


async def source_sizes(spec: JobSpec) -> list[int]:
    """Samples per epoch of each of ``spec``'s sources (a planning home without loaders: the cluster leader)."""
    sources = await asyncio.to_thread(lambda: [open_source(s, seed=spec.seed) for s in spec.sources])
    return [src.num_samples for src in sources]


def skip_steps(
    planner: Planner, view: MetadataView, steps: int, sizes: Sequence[int], *, defer: bool
) -> tuple[list[StepPlan], dict[int, dict]]:
    """Plan the next ``steps`` steps on ``planner`` (in place) never to deliver them: the state records the skip
    (``defer``: and puts their pieces after the rest of each source's epoch; ``sizes``: samples per epoch).
    Returns the skipped plans and the states at the start of each skipped step (lineage replays from them)."""
    if defer and len(sizes) != len(planner.config.sources):
        raise ValueError(f"skip_steps(defer=True) needs the samples per epoch of each source, got {list(sizes)}")
    before, states, plans = planner.state_dict(), {}, []
    for _ in range(steps):
        states[planner.step] = planner.state_dict()
        plans.append(planner.plan_step(view))
    planner.record_skip(before)
    if defer:
        planner.defer(epoch_end_inserts(planner, plans, list(sizes)))
    return plans, states


def skip_pending(
    planner: Planner, view: MetadataView, sizes: Sequence[int]
) -> tuple[list[StepPlan], dict[int, dict], dict[int, list[int]]]:
    """At the first step of the planner's pending skip (``loader.skip(steps=(A, B))``): plan A..B-1 in place never
    to deliver them (``skip_steps``); the skipped plans and, for each of A..B-1, the state to keep for it: the
    state at A, which still holds the pending skip. Whoever plans on from a state kept for a step of the range (a
    new leader, a node's catch-up, a lineage replay) skips the whole range again, as the job did; a state taken
    inside the range would plan its rest as deliverable steps and lose the skip's record and deferral. Third, the
    planner's real cursor at the start of each skipped step (where a partition change may start).
    ([], {}, {}) at any other step. Runs in a thread."""
    pending = planner.pending_skip
    if pending is None or pending.start != planner.step:
        return [], {}, {}
    at_start = planner.state_dict()
    planner.take_pending_skip()
    plans, inside = skip_steps(planner, view, pending.stop - pending.start, sizes, defer=pending.defer)
    return plans, {p.step: at_start for p in plans}, {k: list(st["cursor"]) for k, st in inside.items()}


def epoch_end_inserts(planner: Planner, plans: list, sizes: list[int]) -> list[Insert]:
    """Per source, the pieces of ``plans`` (real ordinals) as an insert at the end of the epoch the planner's
    cursor is in (``sizes``: samples per epoch; at the cursor itself when that epoch just ended)."""
    state = planner.state_dict()
    d = Deferred.from_list(state.get("deferred", []), len(sizes))
    out = []
    for s, (ords, offs, lens) in enumerate(pieces_of(plans, len(sizes))):
        if not ords.size:
            continue
        real = d.real_cursor(s, int(state["cursor"][s]))
        end = -(-real // sizes[s]) * sizes[s]  # the next epoch boundary at or after the cursor
        at = max(d.virtual(s, end), int(state["cursor"][s]))
        out.append(Insert(source=s, at=at, ordinal=ords, offset=offs, length=lens))
        d = d.with_insert(out[-1])
    return out
