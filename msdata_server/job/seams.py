"""The two seams a job runs on, and what they see of the job: one pipeline for one node and for a cluster.

A ``Job`` (registry, rings, constructors) depends on a ``PlanFeed`` (the plans of its steps, in order) and a
``PayloadSource`` (the documents those plans name). Each has one implementation per mode:

=============  ==========================================  ==============================================
seam           one node (``local/``)                       cluster (``cluster.run``, ``cluster.shard``)
=============  ==========================================  ==============================================
PlanFeed       ``LocalPlanFeed``: plans here, in a thread  ``Run``: the leader's plans over the peer links
PayloadSource  ``LocalPayloads``: this node's loaders      ``ShardPayloads``: the owners of each partition
=============  ==========================================  ==============================================

Piece references (``PieceRefs``) are counted by the feed as plans arrive, since only it knows when a plan is
cut by a mixture change; the payload source counts pieces done as it serves them.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Protocol

import numpy as np

if TYPE_CHECKING:
    from ..planner import Mixture, StepPlan

__all__ = ["CutLog", "PayloadSource", "PlanFeed", "Steps"]


class Steps(Protocol):
    """What a plan feed sees of the job's constructors."""

    def committed(self) -> int:
        """The newest step any constructor here has taken up (it is built as planned, whatever happens)."""
        ...

    def drop_from(self, cut: int) -> list[StepPlan]:
        """Drop the plans of steps >= cut that no constructor took up yet; returns them."""
        ...


class PlanFeed(Protocol):
    """The plans of a job's steps, in step order, and the planner states and mixture changes that go with them.

    Size: one member per thing the job, its constructors, lineage and the autoscaler ask of the plans; each mode
    answers all of them, so splitting the protocol would only split what every implementation must provide."""

    start_step: int

    def bind(self, steps: Steps) -> None:
        """The job's constructors (for mixture changes), given once the job has started."""
        ...

    async def next(self) -> tuple[StepPlan, int]:
        """The next plan and the epoch it was handed out in (see ``stale``)."""
        ...

    def stale(self, plan: StepPlan, epoch: int) -> bool:
        """Whether a mixture change after ``epoch`` cut the step of ``plan`` (it will be planned again)."""
        ...

    def fed(self, plan: StepPlan) -> None:
        """Every local constructor queued ``plan``."""
        ...

    async def take(self, plan: StepPlan) -> bool:
        """A constructor's gate before it takes up a step; False when a mixture change cut it meanwhile."""
        ...

    async def set_mixture(self, weights: dict) -> int:
        """Use ``weights`` from the first step no constructor took up (returned)."""
        ...

    async def state_at(self, step: int) -> dict:
        """The planner state at the start of ``step``."""
        ...

    def newest_state(self) -> dict | None:
        """The planner state at the start of the newest step planned (or received) here."""
        ...

    def position(self) -> tuple[int, Mixture] | None:
        """The next step to be planned and its mixture, as this node knows them (None: nothing planned or
        received yet). One node: its planner; a cluster: the newest planner state the leader sent."""
        ...

    def saved_states(self, start: int, stop: int) -> tuple[tuple[int, dict] | None, dict[int, dict]]:
        """For lineage (``planner.history.held_window``): the newest planner state held here at or before
        ``start`` (step, state), and those held at steps in (start, stop)."""
        ...

    def close(self) -> None:
        """Stop: wake whatever waits on planning."""
        ...


class PayloadSource(Protocol):
    """The documents plans name: fetched for building, skipped when nobody reads them; ids and figures."""

    async def fetch(self, source: np.ndarray, ordinal: np.ndarray, offset: np.ndarray, length: np.ndarray) -> list:
        """The pieces, in order (each counted done): token slices, or picture pieces (``document.VlmSample``)."""
        ...

    async def skip(self, source: np.ndarray, ordinal: np.ndarray) -> None:
        """Pieces this node was to build but will not (no reader): counted done."""
        ...

    def sample_ids(self, source: int, ordinals: np.ndarray) -> np.ndarray:
        """Stable global sample ids of ordinals of ``source``."""
        ...

    def status(self, newest_state: dict | None) -> dict[str, dict]:
        """Per source name: its loaders' figures here and the held-payload bound."""
        ...

    async def repartition(self, source: str, n: int) -> bool:
        """Read ``source`` in ``n`` partitions from here on (the autoscaler's split or merge). False where this
        node does not decide its partitions (a cluster: the leader repartitions each run's sources)."""
        ...

    async def aclose(self) -> None:
        """Close what this source opened (loaders, files)."""
        ...


class CutLog:
    """Mixture changes a feed applied, by epoch: a plan handed out in an older epoch whose step is at or past a
    later cut is stale (its step is planned again with the new mixture)."""

    def __init__(self) -> None:
        self.epoch = 0
        self.cuts: list[tuple[int, int]] = []  # (epoch, cut), the latest 16

    def record(self, cut: int) -> None:
        self.epoch += 1
        self.cuts.append((self.epoch, cut))
        del self.cuts[:-16]

    def stale(self, plan: StepPlan, epoch: int) -> bool:
        return any(e > epoch and plan.step >= c for e, c in self.cuts)
