"""Mixture-driven autoscaling of the transform workers: each source's measured cost (``profile``), the
trainers' consumption at the mixture of the steps being planned (``demand``), the decision rule with
hysteresis and a cooldown (``policy``), and the node's loop that applies it to the worker pool
(``controller``). See the README's "Autoscaling" section."""

from .controller import Autoscaler
from .demand import ConsumptionMeter, SourceDemand, lookahead_shares
from .policy import Decision, Policy, PolicyConfig, apportion
from .profile import Counters, SourceProfile

__all__ = [
    "Autoscaler",
    "ConsumptionMeter",
    "Counters",
    "Decision",
    "Policy",
    "PolicyConfig",
    "SourceDemand",
    "SourceProfile",
    "apportion",
    "lookahead_shares",
]
