"""``loader.skip(steps=k)`` at a run's start: the planner plans steps s..s+k-1 from the ranks' state and the run
delivers from s+k on. The plans of later steps are exactly those of an uninterrupted run (the state at s+k is
the same), so the skipped pieces are the only ones missing; the state records the range for lineage.

Both planning homes call ``skip_ahead`` with the start point's ``skip`` (``checkpoint.start_point``) before they
open their loaders at the new position, and store the states of the skipped steps like any others.
"""

from __future__ import annotations

import asyncio

from msdata_client.spec import JobSpec

from ..job.view import ThreadView
from ..planner import Planner
from ..planner.deferred import Deferred, Insert, pieces_of
from ..planner.spec import planner_config
from .data import DataView

__all__ = ["skip_ahead"]


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
        before, states, plans = planner.state_dict(), {}, []
        for _ in range(steps):
            states[planner.step] = planner.state_dict()
            plans.append(planner.plan_step(view))
        planner.record_skip(before)
        if defer:
            planner.defer(epoch_end_inserts(planner, plans, [src.num_samples for src in data.sources]))
        return planner.state_dict(), states

    try:
        return await asyncio.to_thread(plan)
    finally:
        view.close()
        await data.aclose()


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
