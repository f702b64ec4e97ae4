"""Groups whose first reader on this node arrives after the job started here.

On one node every rank registers before the start. In a cluster, a node that restarted while its ranks lived
on starts its job as soon as one of its ranks is back; another of its ranks may come back only later (it was
waiting at a collective for the first one to get its data). When that rank's group has no reader here yet,
the group had no rings and no constructor; it gets them when the rank arrives, and the steps the feed handed
out since (kept here, a few steps deep) are queued for it again, so it builds from the rank's position on
exactly: the same plans, in order, before any later one. A rank whose position this node cannot serve (before
the job's start here, or behind the kept steps) is refused with an error that says so, never served a gap.

Bound: at most ``depth`` plans are kept, and only while some group has no reader here.
"""

from __future__ import annotations

import asyncio
import logging
from collections import deque
from typing import Any, Protocol

from ..errors import CheckpointError
from ..planner import StepPlan
from .ranks import RankPosition
from .rings import RingSet
from .steps import Group

__all__ = ["LateGroups", "history_depth"]

log = logging.getLogger(__name__)


class Builder(Protocol):
    """What the groups use of their job (``job.job.Job``; this module does not import it)."""

    name: str
    start_step: int
    feed: Any  # the PlanFeed: stale(plan, epoch)

    async def open_rings(self, grp: Group) -> RingSet: ...

    def construct(self, grp: Group) -> None: ...


def history_depth(prefetch_steps: int, ring_slots: int, micro_batches: int) -> int:
    """Steps of plans to keep: how far the feed can run ahead of a reader here (its queue, the step being
    staged, a ring's worth of micro-batches) with a wide margin for a rank that comes back a few steps later."""
    return prefetch_steps + 2 + -(-ring_slots // max(1, micro_batches)) + 8


class LateGroups:
    """The plans handed out lately (``record``) and the start of a group's first reader mid-run (``activate``)."""

    def __init__(self, job: Builder, depth: int):
        self.job = job
        self.start_step = job.start_step
        self.next_step = job.start_step  # the step after the newest one handed out
        self._plans: deque[tuple[StepPlan, int]] = deque(maxlen=depth)
        self._lock = asyncio.Lock()

    def record(self, plan: StepPlan, epoch: int) -> None:
        """The feed handed out ``plan`` (of mixture epoch ``epoch``) to the groups read here."""
        self._plans.append((plan, epoch))
        self.next_step = plan.step + 1

    def since(self, position: RankPosition, rank: int) -> list[StepPlan]:
        """The plans handed out from ``position``'s step on, in step order (the newest of a step that a mixture
        change re-planned); CheckpointError when this node no longer holds them all."""
        live = {p.step: p for p, epoch in self._plans if not self.job.feed.stale(p, epoch)}
        low = min(live, default=self.next_step)
        if position.step < low and position.step < self.next_step:
            where = (
                f"its job here started at step {self.start_step} (this node restarted)"
                if position.step < self.start_step
                else f"it keeps the plans of steps {low}..{self.next_step - 1} only"
            )
            raise CheckpointError(
                f"rank {rank} of job {self.job.name!r} came back at step {position.step} micro {position.micro}, "
                f"which this node can no longer build: {where}; restart the ranks from their checkpoint"
            )
        return [live[s] for s in sorted(live) if s >= position.step]

    async def activate(self, grp: Group, rank: int, position: RankPosition) -> None:
        """``rank`` is the group's first reader here and the job runs: open its rings, queue the steps handed
        out from its position on again, and start its constructor (once, if two of its ranks arrive)."""
        async with self._lock:
            if grp.rings is not None:
                return
            rings = await self.job.open_rings(grp)
            try:
                backlog = self.since(position, rank)
            except CheckpointError:
                rings.close()
                raise
            # no await from here on: the job's distribution loop sees the group read here from its next plan
            grp.queue.backfill(backlog)
            grp.rings = rings
            self.job.construct(grp)
        log.info(
            "job %s: rank %d is the first reader of group %d here since the job started; building the group from "
            "step %d micro %d (%d step(s) handed out again)",
            self.job.name,
            rank,
            grp.index,
            position.step,
            position.micro,
            len(backlog),
        )
