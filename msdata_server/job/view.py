"""The planner's MetadataView from its thread: each length look-up runs as a coroutine on the event loop.
It is a VisionView too (``planner.lengths``): ``vision`` asks for the images of samples the same way, so the
"vlm" cost prices a picture document's encoder work; a view given no ``vision`` answers "no images".

One bridge for both planning homes: a single node asks its own loaders, the cluster leader asks the owners
of each partition. ``close()`` cancels the look-ups in flight, so a planner thread never outlives its job.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import threading
from collections.abc import Awaitable, Callable, Coroutine
from typing import Any, TypeVar

import numpy as np

from ..errors import ClosedError

__all__ = ["ThreadView"]

_T = TypeVar("_T")


class ThreadView:
    """``lengths(source, start, count)`` for a planner thread, answered by ``ask`` on ``loop``; ``vision`` by
    ``ask_vision`` (None: text only)."""

    def __init__(
        self,
        ask: Callable[[int, int, int], Awaitable[np.ndarray]],
        loop: asyncio.AbstractEventLoop,
        *,
        closed: str = "planning stopped",
        ask_vision: Callable[[int, int, int], Awaitable[tuple[np.ndarray, np.ndarray]]] | None = None,
    ):
        self._ask = ask
        self._ask_vision = ask_vision
        self._loop = loop
        self._closed_msg = closed
        self._pending: set[concurrent.futures.Future] = set()
        self._closed = False
        self._lock = threading.Lock()

    def lengths(self, source: int, start: int, count: int) -> np.ndarray:
        return self._run(self._call(self._ask, source, start, count))

    def vision(self, source: int, start: int, count: int) -> tuple[np.ndarray, np.ndarray]:
        if self._ask_vision is None:
            return np.zeros(count, dtype=np.int64), np.zeros(0, dtype=np.int64)
        return self._run(self._call(self._ask_vision, source, start, count))

    def _run(self, coro: Coroutine[Any, Any, _T]) -> _T:
        with self._lock:
            if self._closed:
                coro.close()
                raise ClosedError(self._closed_msg)
            fut = asyncio.run_coroutine_threadsafe(coro, self._loop)
            self._pending.add(fut)
        try:
            return fut.result()
        except concurrent.futures.CancelledError:
            raise ClosedError(self._closed_msg) from None
        finally:
            with self._lock:
                self._pending.discard(fut)

    @staticmethod
    async def _call(ask: Callable[[int, int, int], Awaitable[_T]], source: int, start: int, count: int) -> _T:
        return await ask(source, start, count)

    def close(self) -> None:
        with self._lock:
            self._closed = True
            pending = list(self._pending)
        for fut in pending:
            fut.cancel()
