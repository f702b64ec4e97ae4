"""The one polling helper: for conditions only another process can make true (its status, its log, its files), as
no event crosses the process boundary. Waits inside one process use events instead."""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import TypeVar

T = TypeVar("T")

__all__ = ["wait_for"]


def wait_for(
    cond: Callable[[], T], timeout: float, what: str, *, log: Callable[[], str] | None = None, every: float = 0.05
) -> T:
    """Call ``cond`` every ``every`` seconds until it returns something true, and return that; on timeout an
    AssertionError naming ``what`` (and the tail of ``log()``, a server's log, when given)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        got = cond()
        if got:
            return got
        time.sleep(every)
    tail = f"; server log:\n{log()[-3000:]}" if log is not None else ""
    raise AssertionError(f"timed out after {timeout}s waiting for {what}{tail}")
