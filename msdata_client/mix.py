"""MixSpec: a job's mixture (the `[mix]` table): share of tokens per source, constant or over steps."""

from __future__ import annotations

import bisect
import itertools
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from msdata_client._validate import FrozenMap, check_int, check_keys, check_weights
from msdata_client.choices import Interpolate
from msdata_client.errors import ConfigError

__all__ = ["MixSpec", "check_mixture_change", "schedule_points"]

_POINT_KEYS = ("step", "weights")


def _normalise(weights: Mapping[str, float]) -> dict[str, float]:
    total = math.fsum(weights.values())
    return {k: v / total for k, v in weights.items()}


def _check_list(schedule: Any) -> None:
    if isinstance(schedule, (str, Mapping)) or not isinstance(schedule, Sequence):
        raise ConfigError(f"mix schedule={schedule!r} must be a list of (step, weights) points")


def check_mixture_change(weights: Any, sources: Sequence[str]) -> dict[str, float]:
    """The weights of a ``set_mixture``, checked as ``[mix]`` checks its own (one rule on both sides of the
    socket): a finite weight >= 0 for every source of the job, summing to a finite number > 0."""
    if not isinstance(weights, Mapping) or not weights:
        raise ConfigError(f"set_mixture weights must be a non-empty dict of source -> weight, got {weights!r}")
    unknown = sorted(set(weights) - set(sources))
    if unknown:
        raise ConfigError(f"set_mixture names unknown source(s) {unknown}; this job has {sorted(sources)}")
    missing = [s for s in sources if s not in weights]
    if missing:
        raise ConfigError(
            f"set_mixture weights lack source(s) {missing}; give every source of the job a weight, as [mix] "
            f"does (0 leaves a source out)"
        )
    # all zero goes on to the planner (the leader's, in a cluster), which refuses it: "must not all be 0"
    return dict(check_weights("set_mixture weights", weights, all_zero_ok=True))


def schedule_points(schedule: Any) -> tuple[Any, ...]:
    """A schedule's points as (step, weights) pairs; a point may also be a {step, weights} mapping."""
    _check_list(schedule)
    return tuple(
        (check_keys(f"mix schedule[{i}]", p, _POINT_KEYS).get("step"), p.get("weights"))
        if isinstance(p, Mapping)
        else p
        for i, p in enumerate(schedule)
    )


@dataclass(frozen=True, slots=True, kw_only=True)
class MixSpec:
    """The mixture: share of tokens per source, constant (`weights`) or over steps (`schedule`)."""

    weights: Mapping[str, float] | None = None
    schedule: tuple[tuple[int, Mapping[str, float]], ...] = ()
    interpolate: str = "step"

    def __post_init__(self) -> None:
        Interpolate.parse(self.interpolate, "mix interpolate")
        if (self.weights is None) == (not self.schedule):
            raise ConfigError(
                "[mix] needs exactly one of weights = { source = share, ... } or "
                "schedule = [{ step = 0, weights = {...} }, ...]; "
                f"got weights={self.weights!r} and schedule={self.schedule!r}"
            )
        if self.weights is not None:
            if self.interpolate != Interpolate.STEP:
                raise ConfigError(
                    f"mix interpolate={self.interpolate!r} applies to a schedule only; "
                    f"remove it or use schedule = [...]"
                )
            object.__setattr__(self, "weights", check_weights("mix weights", self.weights))
            return
        _check_list(self.schedule)
        points: list[tuple[int, FrozenMap]] = []
        for i, point in enumerate(self.schedule):
            if not isinstance(point, Sequence) or len(point) != 2:
                raise ConfigError(f"mix schedule[{i}]={point!r} must be a (step, weights) pair")
            step = check_int(f"mix schedule[{i}] step", point[0], low=0, fix="steps count from 0")
            points.append((step, check_weights(f"mix schedule[{i}] (step {step}) weights", point[1])))
        steps = [s for s, _ in points]
        if steps[0] != 0:
            raise ConfigError(
                f"mix schedule must start at step 0, but its first step is {steps[0]}; add a point at step 0"
            )
        if any(b <= a for a, b in itertools.pairwise(steps)):
            raise ConfigError(f"mix schedule steps {steps} are not strictly increasing; sort the points by step")
        names = set(points[0][1])
        for step, w in points[1:]:
            if set(w) != names:
                raise ConfigError(
                    f"mix schedule point at step {step} names {sorted(w)} but step 0 names {sorted(names)}; "
                    f"every point must weigh the same sources (use 0 to leave one out)"
                )
        object.__setattr__(self, "schedule", tuple(points))

    def weight_tables(self) -> tuple[Mapping[str, float], ...]:
        """Every weights table of the mixture (one, or one per schedule point)."""
        if self.weights is not None:
            return (self.weights,)
        return tuple(w for _, w in self.schedule)

    def weights_at(self, step: int) -> dict[str, float]:
        """The mixture in force at `step`, normalised to sum 1."""
        check_int("step", step, low=0, fix="steps count from 0")
        if self.weights is not None:
            return _normalise(self.weights)
        steps = [s for s, _ in self.schedule]
        i = bisect.bisect_right(steps, step) - 1
        here = _normalise(self.schedule[i][1])
        if self.interpolate == Interpolate.STEP or i == len(steps) - 1:
            return here
        s0, s1 = steps[i], steps[i + 1]
        nxt = _normalise(self.schedule[i + 1][1])
        t = (step - s0) / (s1 - s0)
        return _normalise({k: here[k] + t * (nxt[k] - here[k]) for k in here})

    def to_dict(self) -> dict[str, Any]:
        """Plain dict in the shape of the TOML `[mix]` table."""
        if self.weights is not None:
            return {"weights": dict(self.weights)}
        schedule = [{"step": s, "weights": dict(w)} for s, w in self.schedule]
        return {"schedule": schedule, "interpolate": self.interpolate}

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> MixSpec:
        """Strict inverse of `to_dict`."""
        check_keys("[mix]", d, ("weights", "schedule", "interpolate"))
        schedule = d.get("schedule", ())
        if isinstance(schedule, Sequence) and not isinstance(schedule, str):
            points = []
            for i, p in enumerate(schedule):
                check_keys(f"[mix] schedule[{i}]", p, _POINT_KEYS)
                if "step" not in p or "weights" not in p:
                    raise ConfigError(f"[mix] schedule[{i}]={dict(p)!r} needs both step and weights")
                points.append((p["step"], p["weights"]))
            schedule = tuple(points)
        return cls(weights=d.get("weights"), schedule=schedule, interpolate=d.get("interpolate", "step"))
