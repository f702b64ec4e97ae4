"""The planner configuration of a job spec: one rule for a single node and for the cluster leader."""

from __future__ import annotations

from msdata_client.choices import CostKind
from msdata_client.spec import JobSpec

from ..errors import ConfigError
from .mixture import Mixture
from .planner import PlannerConfig

__all__ = ["planner_config"]


def planner_config(spec: JobSpec) -> PlannerConfig:
    """What the planner needs of ``spec``: sources, step shape (one DP rank per data group), cost, mixture."""
    if spec.mix.schedule:
        mixture = Mixture.schedule([(st, dict(w)) for st, w in spec.mix.schedule], interpolate=spec.mix.interpolate)
    elif spec.mix.weights is not None:
        mixture = Mixture.constant(dict(spec.mix.weights))
    else:  # MixSpec refuses this already
        raise ConfigError(f"[mix] needs weights or a schedule, got {spec.mix!r}")
    bal = spec.balance
    builtin = bal.cost in CostKind.values()
    return PlannerConfig(
        sources=spec.source_names(),
        seq_len=spec.seq_len,
        dp=spec.data_groups(),
        micro_batches=spec.micro_batches,
        rows=spec.rows,
        method=bal.method,
        alpha=bal.alpha,
        beta=bal.beta,
        cost=bal.cost if builtin else CostKind.ATTENTION.value,
        cost_fn=None if builtin else bal.cost,
        long_docs=spec.long_docs,
        mixture=mixture,
        alpha_v=bal.alpha_v,  # the vision encoder's constants (used by cost = "vlm" only)
        beta_v=bal.beta_v,
        pad_cost=bal.padding_cost,
    )
