"""The planner configuration of a job spec: one rule for a single node and for the cluster leader."""

from __future__ import annotations

from msdata_client.choices import CostKind
from msdata_client.spec import JobSpec

from .mixture import Mixture
from .planner import PlannerConfig

__all__ = ["planner_config"]


def planner_config(spec: JobSpec) -> PlannerConfig:
    """What the planner needs of ``spec``: sources, step shape (one DP rank per data group), cost, mixture."""
    if spec.mix.schedule:
        mixture = Mixture.schedule([(st, dict(w)) for st, w in spec.mix.schedule], interpolate=spec.mix.interpolate)
    else:
        mixture = Mixture.constant(dict(spec.mix.weights))
    return PlannerConfig(
        sources=spec.source_names(), seq_len=spec.seq_len, dp=spec.data_groups(), micro_batches=spec.micro_batches,
        rows=spec.rows, method=spec.balance.method, alpha=spec.balance.alpha, beta=spec.balance.beta,
        cost_fn=None if spec.balance.cost == CostKind.ATTENTION else spec.balance.cost, long_docs=spec.long_docs,
        mixture=mixture)
