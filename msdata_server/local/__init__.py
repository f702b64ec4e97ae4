"""The single-node mode: the job starter, the plan feed (the planner runs here), the payloads from this node's
loaders and a source's partitions. The cluster mode implements the same seams in ``cluster/``."""

from .feed import LocalPlanFeed
from .payloads import LocalPayloads
from .sourceparts import SourceParts
from .starter import LocalStarter

__all__ = ["LocalPayloads", "LocalPlanFeed", "LocalStarter", "SourceParts"]
