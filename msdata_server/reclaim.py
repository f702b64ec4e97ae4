"""Give the memory of a closed run back at once (issue 14, the soak).

A run's object graph (its job, source loaders with their read-ahead payloads and order caches, rings, the
connections of its ranks, 64 planner states) holds reference cycles, so reference counting never frees it
when the run closes: only a full (generation 2) pass of the cyclic collector does. CPython runs one only once
the objects that survived younger passes reach a quarter of the long-lived ones (tens of thousands in a
server), which can take several runs: every restarted run then left its predecessor's megabytes in the heap,
and the allocator's high-water mark grew with the most runs ever waiting at once.

``collect_soon()`` schedules one full collection on the event loop, after the closing coroutine and its
callers have dropped their references (a few tens of milliseconds, once per closed run).
"""

from __future__ import annotations

import asyncio
import gc

__all__ = ["collect_soon"]

_DELAY = 1.0  # seconds: once the closing tasks (and those that heard of the close) have finished


def collect_soon() -> asyncio.TimerHandle:
    """Schedule ``gc.collect()`` on the running loop (call it from the loop thread when a run closed)."""
    return asyncio.get_running_loop().call_later(_DELAY, gc.collect)
