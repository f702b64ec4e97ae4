"""Owned background tasks: every task has an owner that keeps it alive, logs its failure, and cancels it."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Coroutine

__all__ = ["TaskSet"]

log = logging.getLogger(__name__)


class TaskSet:
    """A set of tasks with add_done_callback(discard); failures are logged (never unretrieved)."""

    def __init__(self, name: str = "tasks", on_error=None):
        self.name = name
        self._tasks: set[asyncio.Task] = set()
        self._on_error = on_error

    def spawn(self, coro: Coroutine, *, name: str | None = None) -> asyncio.Task:
        t = asyncio.get_running_loop().create_task(coro, name=name)
        self._tasks.add(t)
        t.add_done_callback(self._done)
        return t

    def _done(self, t: asyncio.Task) -> None:
        self._tasks.discard(t)
        if t.cancelled():
            return
        exc = t.exception()
        if exc is not None:
            if self._on_error is not None:
                self._on_error(t, exc)
            else:
                log.error("%s: task %s failed", self.name, t.get_name(), exc_info=exc)

    def __len__(self) -> int:
        return len(self._tasks)

    async def cancel_all(self, msg: str = "shutting down", timeout: float = 5.0) -> None:  # noqa: ASYNC109
        """Cancel every task and wait (bounded) for them to finish."""
        tasks = list(self._tasks)
        for t in tasks:
            t.cancel(msg)
        if tasks:
            _done, pending = await asyncio.wait(tasks, timeout=timeout)
            for t in pending:
                log.warning("%s: task %s did not stop within %.1fs", self.name, t.get_name(), timeout)
