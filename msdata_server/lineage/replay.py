"""Deterministic replay of a job's plans: steps [start, stop) re-planned from a saved planner state.

A plan is a pure function of (planner state, config, document lengths), so the same Planner, started from the
state of a step at or before ``start``, plans those steps bit for bit as the job did. Mixture changes are in
the states: where a state held for a later step carries another mixture than the replay has (a set_mixture cut
there), the replay continues from that state, exactly as the job did. A skip still to come in the state
(``loader.skip(steps=(A, B))``) is applied at A as the job applied it (``skip.skip_pending``).
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping, Sequence

from ..errors import CheckpointError
from ..planner import MetadataView, Planner, PlannerConfig, StepPlan
from .skip import skip_pending

__all__ = ["replay"]


def replay(
    cfg: PlannerConfig,
    base: Mapping | None,
    view: MetadataView,
    start: int,
    stop: int,
    held: Mapping[int, Mapping] | None = None,
    *,
    sizes: Sequence[int] = (),
) -> Iterator[StepPlan]:
    """The plans of steps [start, stop), in order, planned from ``base`` (a planner state at a step <= start;
    None: the job's beginning) with lengths from ``view`` (``sizes``: samples per epoch of each source, for a
    deferring skip). ``held``: other saved states by step (a mixture cut among them is followed).
    CheckpointError when ``base`` is past ``start``."""
    planner = Planner(cfg, state=base)
    if planner.step > start:
        raise CheckpointError(
            f"the planner state is at step {planner.step}, after step {start}: replay needs a state at or before "
            f"the first step asked for (an earlier checkpoint, or none to replay from the beginning)"
        )
    held = held or {}
    first = planner.step
    while planner.step < stop:
        st = held.get(planner.step) if planner.step > first else None
        if st is not None and st.get("mixture") != planner.mixture.since(planner.step).to_dict():
            planner = Planner(cfg, state=st)  # a mixture change was cut here: continue as the job did
        skipped, _, _ = skip_pending(planner, view, sizes)
        for plan in skipped if skipped else [planner.plan_step(view)]:
            if start <= plan.step < stop:
                yield plan
