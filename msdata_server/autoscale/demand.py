"""Demand per source: how many samples per second of each source the trainers will consume at the steps being
planned, and how many workers that takes.

Pure. The trainers' consumption rate is measured from the ranks' pulls: steps per second of compute, i.e.
steps over wall time minus the time the ranks waited for data (a starved trainer's rate is what it would
consume, not what it got). A source's demand = steps/s x tokens per step x its share of the mixture x 1 /
tokens per sample. The share is the largest one over the look-ahead window of steps from the planner's cursor:
the schedule and every ``set_mixture`` override are known to the planner ahead of time, so the workers are
there before the first step of a shift is planned, and they stay until its last one is.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from ..planner.mixture import Mixture
from .profile import Ewma

__all__ = ["ConsumptionMeter", "SourceDemand", "horizon_steps", "job_demands", "lookahead_shares", "source_demand"]


class ConsumptionMeter:
    """Steps per second of trainer compute, smoothed; fed (time, newest step, total seconds waited) of one rank.

    It smooths the steps and the compute seconds apart and divides (a harmonic mean: one interval that was
    nearly all waiting cannot claim an absurd rate); compute is at least a tenth of the wall time."""

    def __init__(self, *, tau: float = 5.0):
        self._steps = Ewma(tau)
        self._busy = Ewma(tau)
        self._prev: tuple[float, int, float] | None = None

    def observe(self, now: float, step: int, waited_s: float) -> float | None:
        """The smoothed rate after this report (None until two reports with progress)."""
        prev, self._prev = self._prev, (now, step, waited_s)
        if prev is not None:
            t0, s0, w0 = prev
            dt = now - t0
            if step < s0:  # a new run: start again
                self._steps, self._busy = Ewma(self._steps.tau), Ewma(self._busy.tau)
            elif dt > 0 and (step > s0 or self._steps.value is not None):
                busy = max(dt - max(0.0, waited_s - w0), 0.1 * dt)
                self._steps.add((step - s0) / dt, dt)
                self._busy.add(busy / dt, dt)
        return self.steps_per_s

    @property
    def steps_per_s(self) -> float | None:
        s, b = self._steps.value, self._busy.value
        return s / b if s is not None and b else None


def horizon_steps(steps_per_s: float, lead_s: float, *, minimum: int = 2) -> int:
    """Steps of look-ahead that cover ``lead_s`` seconds at this rate (decision interval, worker start)."""
    if not math.isfinite(steps_per_s) or steps_per_s <= 0:
        return minimum
    return max(minimum, math.ceil(steps_per_s * lead_s))


def lookahead_shares(mixture: Mixture, sources: Sequence[str], start: int, horizon: int) -> dict[str, float]:
    """Per source, its largest share over steps ``[start, start + horizon]``: what the workers must supply
    for any step the next decision interval may plan."""
    best = dict.fromkeys(sources, 0.0)
    for step in range(max(0, start), max(0, start) + horizon + 1):
        w = mixture.weights_at(step, tuple(sources))
        for name, x in zip(sources, w.tolist()):
            best[name] = max(best[name], x)
    return best


@dataclass(frozen=True, slots=True, kw_only=True)
class SourceDemand:
    """What one source must supply, and what that costs in workers."""

    name: str
    samples_s: float  # demand
    worker_s_per_sample: float | None  # None: not measured yet (its work cannot be sized)
    share_now: float  # its share at the step being planned
    share_ahead: float  # its largest share over the look-ahead

    @property
    def workers(self) -> float:
        """Workers (fractional) the demand keeps busy; 0 while unmeasured."""
        return self.samples_s * (self.worker_s_per_sample or 0.0)


def source_demand(
    name: str,
    *,
    steps_per_s: float,
    tokens_per_step: int,
    share_now: float,
    share_ahead: float,
    tokens_per_sample: float | None,
    worker_s_per_sample: float | None,
) -> SourceDemand:
    """One source's demand at the look-ahead share (see the module docstring)."""
    samples_s = 0.0
    if tokens_per_sample and tokens_per_sample > 0:
        samples_s = steps_per_s * tokens_per_step * share_ahead / tokens_per_sample
    return SourceDemand(
        name=name,
        samples_s=samples_s,
        worker_s_per_sample=worker_s_per_sample,
        share_now=share_now,
        share_ahead=share_ahead,
    )


def job_demands(
    *,
    mixture: Mixture,
    sources: Sequence[str],
    planned_step: int,
    tokens_per_step: int,
    steps_per_s: float,
    lead_s: float,
    figures: Callable[[str], tuple[float | None, float | None]],
) -> tuple[list[SourceDemand], bool]:
    """One job's demand per source at its consumption rate and the mixture of the steps ahead of its planner;
    ``figures(name)`` is (tokens per sample, worker seconds per sample) of a source, None while unmeasured.
    Also whether to hold (give nothing back): a source with a share ahead whose cost is not measured yet.
    The one rule of a node's own demand and of the leader's demand of a job run across nodes."""
    ahead = lookahead_shares(mixture, sources, planned_step, horizon_steps(steps_per_s, lead_s))
    now_w = lookahead_shares(mixture, sources, planned_step, 0)
    parts: list[SourceDemand] = []
    hold = False
    for name in sources:
        tokens, cost = figures(name)
        if tokens is None:
            hold = hold or ahead[name] > 0  # not read yet: its cost is unknown
            continue
        parts.append(
            source_demand(
                name,
                steps_per_s=steps_per_s,
                tokens_per_step=tokens_per_step,
                share_now=now_w[name],
                share_ahead=ahead[name],
                tokens_per_sample=tokens,
                worker_s_per_sample=cost,
            )
        )
    return parts, hold


def merge_demands(parts: Sequence[SourceDemand]) -> dict[str, SourceDemand]:
    """Demands of sources with one name in several jobs (they share its quota): summed per name."""
    out: dict[str, SourceDemand] = {}
    for d in parts:
        o = out.get(d.name)
        if o is None:
            out[d.name] = d
            continue
        cost = o.worker_s_per_sample if o.worker_s_per_sample is not None else d.worker_s_per_sample
        out[d.name] = SourceDemand(
            name=d.name,
            samples_s=o.samples_s + d.samples_s,
            worker_s_per_sample=cost,
            share_now=max(o.share_now, d.share_now),
            share_ahead=max(o.share_ahead, d.share_ahead),
        )
    return out
