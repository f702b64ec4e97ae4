"""A job on a node server, split into the roles of the paper (see docs/ARCHITECTURE.md):

- ``job.py``: ``Job``, which wires the roles: registry, groups, rings, constructors, the distribution loop;
- ``ranks.py``: the rank registry and start barrier; ``rings.py``: shared-memory rings of a group;
- ``steps.py``: groups and their bounded step queues; ``constructor.py``: the constructor loop;
- ``seams.py``: the PlanFeed and PayloadSource interfaces a job depends on;
- ``local.py`` / ``payloads.py``: their single-node implementations (the cluster's are in ``cluster/``);
- ``pieces.py``: piece reference counts; ``view.py``: the planner thread's bridge to the loop;
- ``status.py``: per-step plan statistics.
"""

from ..batch import BATCH_FIELDS
from .job import Job
from .ranks import RankPosition

__all__ = ["BATCH_FIELDS", "Job", "RankPosition"]
