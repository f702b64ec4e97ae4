"""Mixture weights over training steps: constant, scheduled (step or linear), with run-time overrides.

A Mixture is an immutable value; `with_override` returns a new one, so a planner's state can hold it
and a checkpoint can record it (`to_dict` / `from_dict`) including every override made at run time.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import numpy as np

from msdata_client._validate import finite_sum
from msdata_client.choices import Interpolate
from msdata_server.errors import ConfigError

__all__ = ["Interpolate", "Mixture"]

_KEYS = frozenset({"interpolate", "points", "overrides"})

Weights = tuple[tuple[str, float], ...]  # sorted by name, normalised to sum 1


def _normalise(weights: Mapping[str, float], where: str, *, exact: bool = False) -> Weights:
    """Validate one weights mapping and return it sorted by name and normalised to sum 1.

    With `exact` (restoring a dict we wrote) the values are kept bit for bit, so a restored
    mixture plans exactly as the saved one did; they must then already sum to 1.
    """
    if not isinstance(weights, Mapping) or not weights:
        raise ConfigError(f"{where}: weights must be a non-empty mapping of source name to share, got {weights!r}")
    items = []
    for name, w in weights.items():
        if not isinstance(name, str) or not name:
            raise ConfigError(f"{where}: source names must be non-empty strings, got {name!r}")
        if isinstance(w, bool) or not isinstance(w, (int, float)):
            raise ConfigError(f"{where}: weight of {name!r} must be a number, got {w!r}")
        w = float(w)
        if not math.isfinite(w) or w < 0:
            raise ConfigError(f"{where}: weight of {name!r} must be finite and >= 0, got {w!r}")
        items.append((name, w))
    items.sort()
    total = finite_sum(w for _, w in items)
    if total is None:
        raise ConfigError(f"{where}: weights {dict(items)!r} sum to more than a float holds; scale them down")
    if total <= 0:
        raise ConfigError(f"{where}: weights must not all be 0, got {dict(items)!r}; give some source a share > 0")
    if exact:
        if abs(total - 1.0) > 1e-9:
            raise ConfigError(f"{where}: stored weights must sum to 1, got {total!r}")
        return tuple(items)
    return tuple((name, w / total) for name, w in items)


def _check_step(step: object, where: str) -> int:
    if isinstance(step, bool) or not isinstance(step, int) or step < 0:
        raise ConfigError(f"{where}: step must be an int >= 0, got {step!r}")
    return step


@dataclass(frozen=True, slots=True)
class Mixture:
    """Share of tokens per source as a function of the step; build with `constant` or `schedule`."""

    points: tuple[tuple[int, Weights], ...]
    interpolate: Interpolate = Interpolate.STEP
    overrides: tuple[tuple[int, Weights], ...] = ()

    def __post_init__(self) -> None:
        if not self.points:
            raise ConfigError("a mixture needs at least one (step, weights) point")
        steps = [s for s, _ in self.points]
        if any(b <= a for a, b in itertools.pairwise(steps)):
            raise ConfigError(f"mixture schedule steps must be strictly increasing, got {steps}; sort the points")
        osteps = [s for s, _ in self.overrides]
        if any(b <= a for a, b in itertools.pairwise(osteps)):
            raise ConfigError(f"mixture override steps must be strictly increasing, got {osteps}")

    @classmethod
    def constant(cls, weights: Mapping[str, float]) -> Mixture:
        """The same weights at every step."""
        return cls(points=((0, _normalise(weights, "mixture")),))

    @classmethod
    def schedule(cls, points: Sequence[tuple[int, Mapping[str, float]]], interpolate: str = "step") -> Mixture:
        """Weights that change at the given steps (`"step"`) or blend between them (`"linear"`)."""
        mode = Interpolate.parse(interpolate, "interpolate", brief=True)
        if isinstance(points, (str, bytes, Mapping)) or not isinstance(points, Sequence) or not points:
            raise ConfigError(f"a mixture schedule is a non-empty list of (step, weights), got {points!r}")
        norm = []
        for i, point in enumerate(points):
            if not isinstance(point, Sequence) or isinstance(point, (str, bytes)) or len(point) != 2:
                raise ConfigError(f"schedule point {i} must be (step, weights), got {point!r}")
            step = _check_step(point[0], f"schedule point {i}")
            norm.append((step, _normalise(point[1], f"schedule point {i} (step {step})")))
        return cls(points=tuple(norm), interpolate=mode)

    def names(self) -> frozenset[str]:
        """Every source name that any point or override mentions."""
        return frozenset(n for _, w in self.points + self.overrides for n, _ in w)

    def with_override(self, step: int, weights: Mapping[str, float]) -> Mixture:
        """A new mixture that uses `weights` from `step` on (replacing later overrides): run-time set_mixture."""
        step = _check_step(step, "mixture override")
        kept = tuple(o for o in self.overrides if o[0] < step)
        return Mixture(
            points=self.points,
            interpolate=self.interpolate,
            overrides=(*kept, (step, _normalise(weights, f"mixture override at step {step}"))),
        )

    def since(self, step: int) -> Mixture:
        """The same weights at ``step`` and after, without the overrides that only earlier steps used.

        A planner state at ``step`` holds this, so its size does not grow with every ``set_mixture`` of a long
        run (the server keeps a window of recent states; each held the whole override history before).
        """
        past = [i for i, (s, _) in enumerate(self.overrides) if s <= step]
        if len(past) <= 1:
            return self
        return Mixture(points=self.points, interpolate=self.interpolate, overrides=self.overrides[past[-1] :])

    def weights_at(self, step: int, sources: tuple[str, ...]) -> np.ndarray:
        """Normalised float64 weights of `sources` (in that order) at `step`; unnamed sources get 0."""
        step = _check_step(step, "weights_at")
        unknown = self.names().difference(sources)
        if unknown:
            raise ConfigError(f"mixture names unknown sources {sorted(unknown)}; the job's sources are {list(sources)}")
        index = {name: i for i, name in enumerate(sources)}
        out = np.zeros(len(sources), dtype=np.float64)
        for ostep, w in reversed(self.overrides):
            if ostep <= step:
                for name, v in w:
                    out[index[name]] = v
                return out
        steps = [s for s, _ in self.points]
        pos = int(np.searchsorted(np.asarray(steps), step, side="right")) - 1
        if pos < 0:
            pos = 0  # before the first point: its weights
        lo_step, lo = self.points[pos]
        for name, v in lo:
            out[index[name]] = v
        if self.interpolate is Interpolate.LINEAR and pos + 1 < len(self.points) and step > lo_step:
            hi_step, hi = self.points[pos + 1]
            t = (step - lo_step) / (hi_step - lo_step)
            upper = np.zeros_like(out)
            for name, v in hi:
                upper[index[name]] = v
            out = (1.0 - t) * out + t * upper
        total = float(out.sum())
        if total <= 0:  # cannot happen with normalised points; guards rounding
            raise ConfigError(f"mixture weights at step {step} sum to {total}")
        return out / total

    def to_dict(self) -> dict:
        """A JSON-able dict (sorted names, plain floats) that `from_dict` restores exactly."""

        def enc(pts: tuple[tuple[int, Weights], ...]) -> list:
            return [[s, {n: v for n, v in w}] for s, w in pts]

        return {"interpolate": self.interpolate.value, "points": enc(self.points), "overrides": enc(self.overrides)}

    @classmethod
    def from_dict(cls, d: Mapping) -> Mixture:
        """Strict inverse of `to_dict`: unknown or missing keys raise ConfigError."""
        if not isinstance(d, Mapping):
            raise ConfigError(f"a mixture dict must be a mapping, got {type(d).__name__}")
        keys = set(d)
        if keys != _KEYS:
            raise ConfigError(
                f"mixture dict keys {sorted(keys)} differ from {sorted(_KEYS)}"
                f" (unknown: {sorted(keys - _KEYS)}, missing: {sorted(_KEYS - keys)})"
            )

        def dec(raw: object, what: str) -> tuple[tuple[int, Weights], ...]:
            if not isinstance(raw, list):
                raise ConfigError(f"mixture {what} must be a list, got {type(raw).__name__}")
            out = []
            for i, p in enumerate(raw):
                if not isinstance(p, (list, tuple)) or len(p) != 2:
                    raise ConfigError(f"mixture {what}[{i}] must be [step, weights], got {p!r}")
                step = _check_step(p[0], f"mixture {what}[{i}]")
                out.append((step, _normalise(p[1], f"mixture {what}[{i}]", exact=True)))
            return tuple(out)

        mode = Interpolate.parse(d["interpolate"], "interpolate", brief=True)
        return cls(points=dec(d["points"], "points"), interpolate=mode, overrides=dec(d["overrides"], "overrides"))
