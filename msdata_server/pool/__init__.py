"""The transform worker pool: resizable worker processes (started from a forkserver) that run per-sample
transforms, shared by every job of the node with a weighted fair share per source.

``pool.py`` is the pool (``WorkerPool``); ``dispatch.py`` the fair queueing of tasks to workers, ``launch.py``
how worker processes start, ``workerproc.py`` the parent's half of a worker, ``worker.py`` the worker process
itself (``python -m msdata_server.pool.worker``).
"""

from .pool import PoolStats, WorkerPool

__all__ = ["PoolStats", "WorkerPool"]
