"""The planner's MetadataView from its thread: each length look-up runs as a coroutine on the event loop.

One bridge for both planning homes: a single node asks its own loaders, the cluster leader asks the owners
of each partition. ``close()`` cancels the look-ups in flight, so a planner thread never outlives its job.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import threading
from collections.abc import Awaitable, Callable

import numpy as np

from ..errors import ClosedError

__all__ = ["ThreadView"]


class ThreadView:
    """``lengths(source, start, count)`` for a planner thread, answered by ``ask`` on ``loop``."""

    def __init__(
        self,
        ask: Callable[[int, int, int], Awaitable[np.ndarray]],
        loop: asyncio.AbstractEventLoop,
        *,
        closed: str = "planning stopped",
    ):
        self._ask = ask
        self._loop = loop
        self._closed_msg = closed
        self._pending: set[concurrent.futures.Future] = set()
        self._closed = False
        self._lock = threading.Lock()

    def lengths(self, source: int, start: int, count: int) -> np.ndarray:
        with self._lock:
            if self._closed:
                raise ClosedError(self._closed_msg)
            fut = asyncio.run_coroutine_threadsafe(self._call(source, start, count), self._loop)
            self._pending.add(fut)
        try:
            return fut.result()
        except concurrent.futures.CancelledError:
            raise ClosedError(self._closed_msg) from None
        finally:
            with self._lock:
                self._pending.discard(fut)

    async def _call(self, source: int, start: int, count: int) -> np.ndarray:
        return await self._ask(source, start, count)

    def close(self) -> None:
        with self._lock:
            self._closed = True
            pending = list(self._pending)
        for fut in pending:
            fut.cancel()
