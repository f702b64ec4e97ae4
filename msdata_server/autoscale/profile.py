"""The online profile of one source on this node: what a sample costs and how fast samples come.

Pure: fed cumulative counters (the worker pool's per-source CPU and worker seconds, measured in the workers;
the loaders' read seconds, bytes, tokens and held memory) with the time they were taken; it smooths the
deltas exponentially with a time constant, so an interval of any length weighs by its duration. A ratio (CPU
seconds per sample...) smooths its numerator and denominator apart, so an interval with no samples moves
nothing.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

__all__ = ["Counters", "Ewma", "ProfileFigures", "SourceProfile"]


@dataclass(frozen=True, slots=True, kw_only=True)
class Counters:
    """Cumulative figures of one source at one instant (counters only grow, except ``memory_bytes``)."""

    samples_transformed: int = 0  # samples its pool tasks returned
    cpu_s: float = 0.0  # process CPU seconds of those tasks, in the workers
    worker_s: float = 0.0  # seconds workers spent on them
    samples_read: int = 0  # samples its loaders read
    read_s: float = 0.0
    bytes_read: int = 0
    tokens_read: int = 0
    memory_bytes: int = 0  # payloads its loaders hold now


@dataclass(frozen=True, slots=True, kw_only=True)
class ProfileFigures:
    """Smoothed figures (None until measured)."""

    cpu_s_per_sample: float | None
    worker_s_per_sample: float | None
    read_s_per_sample: float | None
    bytes_per_sample: float | None
    tokens_per_sample: float | None
    supply_samples_s: float  # samples per second the loaders delivered (read and transformed)
    memory_bytes: int


_CUMULATIVE = ("samples_transformed", "cpu_s", "worker_s", "samples_read", "read_s", "bytes_read", "tokens_read")


class Ewma:
    """Exponentially weighted mean of a rate or an amount, decaying with time constant ``tau`` seconds."""

    __slots__ = ("tau", "value")

    def __init__(self, tau: float):
        if tau <= 0:
            raise ValueError(f"{tau=} must be > 0 seconds")
        self.tau = tau
        self.value: float | None = None

    def add(self, x: float, dt: float) -> float:
        """Blend in ``x`` observed over ``dt`` seconds (the first observation is taken as is)."""
        if self.value is None:
            self.value = float(x)
        else:
            a = 1.0 - math.exp(-max(dt, 0.0) / self.tau)
            self.value += a * (float(x) - self.value)
        return self.value


class _Ratio:
    """Smoothed num / den per unit time; None until the denominator moved."""

    __slots__ = ("den", "num")

    def __init__(self, tau: float):
        self.num, self.den = Ewma(tau), Ewma(tau)

    def add(self, dnum: float, dden: float, dt: float) -> None:
        if dden > 0 or self.den.value is not None:
            rate = 1.0 / dt if dt > 0 else 1.0
            self.num.add(dnum * rate, dt)
            self.den.add(dden * rate, dt)

    @property
    def value(self) -> float | None:
        n, d = self.num.value, self.den.value
        return n / d if n is not None and d else None


class SourceProfile:
    """Profile of one source (see the module docstring); ``observe`` once per decision interval."""

    def __init__(self, *, tau: float = 5.0):
        self._prev: tuple[float, Counters] | None = None
        self._cpu = _Ratio(tau)
        self._worker = _Ratio(tau)
        self._read = _Ratio(tau)
        self._bytes = _Ratio(tau)
        self._tokens = _Ratio(tau)
        self._supply = Ewma(tau)
        self._memory = 0

    def observe(self, now: float, c: Counters) -> None:
        """Counters taken at ``now`` (seconds, monotonic); the first call only sets the baseline. A counter that
        went down (a job restarted, its loaders are new, or a drained partition's loader closed after a split or
        merge) restarts the baseline without a sample."""
        self._memory = c.memory_bytes
        prev, self._prev = self._prev, (now, c)
        if prev is None:
            return
        t0, p = prev
        dt = now - t0
        if dt <= 0:
            return
        dx = c.samples_transformed - p.samples_transformed
        dr = c.samples_read - p.samples_read
        if any(getattr(c, k) < getattr(p, k) for k in _CUMULATIVE):
            return
        self._cpu.add(c.cpu_s - p.cpu_s, dx, dt)
        self._worker.add(c.worker_s - p.worker_s, dx, dt)
        self._read.add(c.read_s - p.read_s, dr, dt)
        self._bytes.add(c.bytes_read - p.bytes_read, dr, dt)
        self._tokens.add(c.tokens_read - p.tokens_read, dr, dt)
        self._supply.add(dr / dt, dt)

    def figures(self) -> ProfileFigures:
        return ProfileFigures(
            cpu_s_per_sample=self._cpu.value,
            worker_s_per_sample=self._worker.value,
            read_s_per_sample=self._read.value,
            bytes_per_sample=self._bytes.value,
            tokens_per_sample=self._tokens.value,
            supply_samples_s=self._supply.value or 0.0,
            memory_bytes=self._memory,
        )
