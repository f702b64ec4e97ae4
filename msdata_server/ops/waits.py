"""How long each rank of a job waited for data: the figure that says whether the data path slows training.

Clients report the seconds each ``next()`` spent blocked on a batch (a list per report); ``WaitStats`` (one per
job) keeps, per rank, the total, a count, p50/p99 over the newest ``window`` waits, and the fraction of wall
time spent waiting. Pure: the clock is injected, nothing here does I/O.

``snapshot()`` is the job status key ``ranks_detail`` (rank keys are strings, as JSON needs)::

    {"0": {"delivered": 1200,      # micro-batches delivered (waits reported) to this rank
           "micro_batches_delivered": 1200,  # the same: its name in the summary and the metrics
           "wait_s": 3.25,         # total seconds spent waiting for data
           "wait_p50_s": 0.0011,   # median of the newest `window` waits (None before any)
           "wait_p99_s": 0.0150,   # 99th percentile of them, nearest rank (None before any)
           "wait_frac": 0.012,     # waited / wall time between the first and the newest report (None before two)
           "step": 299}}           # the rank's step at its newest report, when the client sent one
"""

from __future__ import annotations

import math
import time
from collections import deque
from collections.abc import Callable, Iterable
from typing import Any

from ..errors import ProtocolError

__all__ = ["WaitStats"]

WINDOW = 1024


def _quantile(ordered: list[float], q: float) -> float:
    """Nearest-rank quantile of a sorted, non-empty list."""
    return ordered[max(0, math.ceil(q * len(ordered)) - 1)]


class _Rank:
    __slots__ = ("count", "first", "last", "recent", "step", "total", "waited_since_first")

    def __init__(self, window: int, now: float):
        self.count = 0
        self.total = 0.0
        self.waited_since_first = 0.0  # waits reported after the first report (they lie within [first, last])
        self.first = self.last = now
        self.recent: deque[float] = deque(maxlen=window)  # bounded: the newest `window` waits
        self.step: int | None = None


class WaitStats:
    """Data-wait figures of one job's ranks. Memory is bounded by ``window`` floats per rank; ``forget(rank)``
    drops a rank that left for good."""

    def __init__(self, *, window: int = WINDOW, clock: Callable[[], float] = time.monotonic):
        if window < 1:
            raise ValueError(f"{window=} must be >= 1")
        self.window = window
        self._clock = clock
        self._ranks: dict[int, _Rank] = {}

    def record(self, rank: int, waits: Iterable[float], *, step: int | None = None) -> None:
        """Add one report of ``rank``. Raises ProtocolError for a wait that is not a finite number >= 0."""
        try:
            values = [float(w) for w in waits]
        except (TypeError, ValueError) as e:
            raise ProtocolError(f"rank {rank} reported data waits that are not numbers: {e}") from None
        bad = [w for w in values if not math.isfinite(w) or w < 0]
        if bad:
            raise ProtocolError(
                f"rank {rank} reported data waits {bad[:4]}: each must be a finite number of seconds >= 0"
            )
        now = self._clock()
        r = self._ranks.get(rank)
        if r is None:
            r = self._ranks[rank] = _Rank(self.window, now)
        else:
            r.waited_since_first += sum(values)
            r.last = now
        r.count += len(values)
        r.total += sum(values)
        r.recent.extend(values)
        if step is not None:
            r.step = int(step)

    def forget(self, rank: int) -> None:
        self._ranks.pop(rank, None)

    def snapshot(self) -> dict[str, dict[str, Any]]:
        """{rank: figures} in the shape of the module docstring, ranks in ascending order."""
        out: dict[str, dict[str, Any]] = {}
        for rank in sorted(self._ranks):
            r = self._ranks[rank]
            ordered = sorted(r.recent)
            span = r.last - r.first
            fig: dict[str, Any] = {
                "delivered": r.count,
                "micro_batches_delivered": r.count,
                "wait_s": r.total,
                "wait_p50_s": _quantile(ordered, 0.50) if ordered else None,
                "wait_p99_s": _quantile(ordered, 0.99) if ordered else None,
                "wait_frac": min(1.0, r.waited_since_first / span) if span > 0 else None,
            }
            if r.step is not None:
                fig["step"] = r.step
            out[str(rank)] = fig
        return out
