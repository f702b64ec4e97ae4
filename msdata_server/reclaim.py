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

``tune_allocator()`` (the server calls it once at start) fixes glibc's mmap threshold at 4 MiB. By default the
threshold is dynamic: each freed mapped block raises it (up to 32 MiB), after which the server's transient buffers
of megabytes (batches being built, read-ahead payloads) were carved from the heap between long-lived objects, and
the holes they left were too small to give back: the soak's anonymous memory crept for its first 15-20 minutes.
Blocks of 4 MiB and more are now mapped and unmapped on their own. The threshold was 16 KiB until the planner's
cost showed: a planner step allocates tens of megabytes of temporaries of 16 KiB to a few MiB (arrays over the
step's pieces and ranks), and with every one mapped, zero-filled page by page and unmapped, a step at dp 512 took
28 ms instead of 17 (7,100 page faults), at dp 4,096 228 ms instead of 89 (text4, 16k; planning in a thread, as
the server does). Side by side with the 16 KiB setting (``bench/memgrowth.py --baseline``, 12 minutes,
155k steps each) the server's private memory grew alike (46.5 against 38.2 KiB per 10k steps) at a 0.7 MiB higher
level, serving 2 % faster.
"""

from __future__ import annotations

import asyncio
import ctypes
import gc
from collections.abc import Callable

__all__ = ["collect", "collect_soon", "tune_allocator"]

_DELAY = 1.0  # seconds: once the closing tasks (and those that heard of the close) have finished
_M_MMAP_THRESHOLD = -3  # mallopt's parameter number (malloc.h)
MMAP_THRESHOLD = 4 << 20  # bytes: blocks this large are mapped on their own, smaller ones come from the heap


def _libc(name: str) -> Callable[..., int] | None:
    """A glibc allocator function, or None where the C library has none (musl, macOS)."""
    try:
        return getattr(ctypes.CDLL(None), name)
    except (OSError, AttributeError):
        return None


_TRIM = _libc("malloc_trim")  # None: only gc runs


def tune_allocator(threshold: int = MMAP_THRESHOLD) -> bool:
    """Fix glibc's mmap threshold (which also stops its dynamic growth); False where there is no glibc."""
    mallopt = _libc("mallopt")
    return mallopt is not None and bool(mallopt(_M_MMAP_THRESHOLD, int(threshold)))


def collect() -> int:
    """One full collection, then the free pages of every malloc arena back to the system; the objects freed."""
    freed = gc.collect()
    if _TRIM is not None:
        _TRIM(0)
    return freed


def collect_soon() -> asyncio.TimerHandle:
    """Schedule ``collect()`` on the running loop (call it from the loop thread when a run closed)."""
    return asyncio.get_running_loop().call_later(_DELAY, collect)
