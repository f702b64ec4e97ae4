"""Give the memory of a closed run back at once (issue 14, the soak).

A run's object graph (its job, source loaders with their read-ahead payloads and order caches, rings, the
connections of its ranks, 64 planner states) holds reference cycles, so reference counting never frees it
when the run closes: only a full (generation 2) pass of the cyclic collector does. CPython runs one only once
the objects that survived younger passes reach a quarter of the long-lived ones (tens of thousands in a
server), which can take several runs: every restarted run then left its predecessor's megabytes in the heap,
and the allocator's high-water mark grew with the most runs ever waiting at once.

``collect_soon()`` schedules one full collection on the event loop, after the closing coroutine and its
callers have dropped their references (a few tens of milliseconds, once per closed run), then hands the
allocator's free pages back to the system (glibc's ``malloc_trim``: without it the freed megabytes stay in
the heap's arenas, counted in the server's memory until some later allocation reuses them).
"""

from __future__ import annotations

import asyncio
import ctypes
import gc
from collections.abc import Callable

__all__ = ["collect", "collect_soon"]

_DELAY = 1.0  # seconds: once the closing tasks (and those that heard of the close) have finished


def _find_trim() -> Callable[[int], int] | None:
    """glibc's ``malloc_trim``, or None where the C library has none (musl, macOS): then only gc runs."""
    try:
        return ctypes.CDLL(None).malloc_trim
    except (OSError, AttributeError):
        return None


_TRIM = _find_trim()


def collect() -> int:
    """One full collection, then the free pages of every malloc arena back to the system; the objects freed."""
    freed = gc.collect()
    if _TRIM is not None:
        _TRIM(0)
    return freed


def collect_soon() -> asyncio.TimerHandle:
    """Schedule ``collect()`` on the running loop (call it from the loop thread when a run closed)."""
    return asyncio.get_running_loop().call_later(_DELAY, collect)
