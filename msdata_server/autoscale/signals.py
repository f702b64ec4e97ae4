"""What the autoscaler reads of a running job, through public seams only: the ranks' pulls (``job.waits``),
the planner's cursor and mixture (``PlanFeed.position``), the step shape, and its loaders' counters
(``job.payloads.status``)."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from ..planner.spec import planner_config

if TYPE_CHECKING:
    from ..job import Job
    from ..planner.mixture import Mixture

__all__ = ["JobSignals", "job_signals"]


@dataclass(frozen=True, slots=True, kw_only=True)
class JobSignals:
    """One job's figures at one instant."""

    key: str  # the job's registration on this node (a new run is a new key)
    name: str
    rank_step: int | None  # newest step the lowest reporting rank pulled
    rank_wait_s: float  # its total seconds waiting for data
    planned_step: int  # the next step the planner plans
    mixture: Mixture
    sources: tuple[str, ...]
    tokens_per_step: int
    loaders: Mapping[str, Mapping[str, Any]]  # source name -> its loaders' figures here (job.payloads.status)
    started: tuple[float, int] | None = None  # (monotonic time, step) the job started at: the pace's first point


def job_signals(job: Job) -> JobSignals | None:
    """The signals of a running job; None while it is not running."""
    if job.state != "running" or job.feed is None or job.payloads is None:
        return None
    cfg = planner_config(job.spec)
    step, mixture = job.feed.position() or (0, cfg.mixture)
    ranks = job.waits.snapshot()
    rank_step, waited = None, 0.0
    for r in sorted(ranks, key=int):
        if "step" in ranks[r]:
            rank_step, waited = int(ranks[r]["step"]), float(ranks[r]["wait_s"])
            break
    return JobSignals(
        key=job.inst,
        name=job.name,
        rank_step=rank_step,
        rank_wait_s=waited,
        planned_step=step,
        mixture=mixture,
        sources=tuple(cfg.sources),
        tokens_per_step=cfg.capacity,
        loaders=job.payloads.status(None),
        started=(job.started_at, job.start_step) if job.started_at is not None else None,
    )
