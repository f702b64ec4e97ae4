"""The planner: pure functions of metadata that decide which documents make each step and where they go.

numpy only: no I/O, no asyncio, no torch. The node server runs `Planner.plan_step` in a thread.
"""

from .balance import Method, Placement, place
from .cost import attention_cost, load_cost_fn, make_cost
from .layout import Layout
from .lengths import VisionView
from .mixture import Interpolate, Mixture
from .pack import LongDocs, next_fit, pieces
from .partition import greedy_partition, kk_partition
from .planner import MetadataView, Planner, PlannerConfig, PlanStats, StepPlan

__all__ = [
    "Interpolate",
    "Layout",
    "LongDocs",
    "MetadataView",
    "Method",
    "Mixture",
    "Placement",
    "PlanStats",
    "Planner",
    "PlannerConfig",
    "StepPlan",
    "VisionView",
    "attention_cost",
    "greedy_partition",
    "kk_partition",
    "load_cost_fn",
    "make_cost",
    "next_fit",
    "pieces",
    "place",
]
