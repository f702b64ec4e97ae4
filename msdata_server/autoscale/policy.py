"""How many workers the node's pool has, and each source's share of them: from the demands, with hysteresis
and a cooldown so that it never oscillates.

Pure (the clock is an argument). Going up is immediate: a starved trainer costs more than an idle worker, and a
rise the mixture look-ahead announced must be met before its first step. Going down needs the demand to fit
``size - 1`` workers with a margin (``band``) for ``cooldown_s`` seconds on end, and no change within the
cooldown before: a demand that wobbles around a threshold goes up once and stays. Sources share the pool by
weight (their fractional need): the pool schedules by them (``WorkerPool.set_quotas``), and their whole-worker
apportionment (largest remainder, summing to the pool size) is what ``status`` shows; it is redrawn when the
size changes, a source comes or goes, a source's cost is first measured (until then its need counts as 0), or a
need drifts by more than ``band`` of a worker.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field

from .demand import SourceDemand

__all__ = ["Decision", "Level", "Partitioner", "Policy", "PolicyConfig", "apportion", "read_needs"]


@dataclass(frozen=True, slots=True, kw_only=True)
class PolicyConfig:
    min_workers: int
    max_workers: int
    headroom: float = 0.25
    band: float = 0.15  # hysteresis: going down needs need x (1 + headroom) <= (size - 1) x (1 - band)
    cooldown_s: float = 6.0

    def __post_init__(self) -> None:
        if not 0 <= self.min_workers <= self.max_workers:
            raise ValueError(f"need 0 <= min_workers ({self.min_workers}) <= max_workers ({self.max_workers})")
        if not 0 <= self.band < 1:
            raise ValueError(f"band = {self.band} must be in [0, 1)")

    def clamp(self, n: int) -> int:
        return min(self.max_workers, max(self.min_workers, n))


@dataclass(frozen=True, slots=True, kw_only=True)
class Decision:
    """A change of the pool size or of the sources' whole-worker apportionment, and why."""

    at: float
    size_from: int
    size_to: int
    workers_from: dict[str, int]
    workers_to: dict[str, int]
    need: float  # fractional workers the demand keeps busy
    reason: str
    demands: dict[str, SourceDemand] = field(default_factory=dict)

    def changes(self) -> dict[str, tuple[int, int]]:
        """Sources whose whole workers changed: name -> (from, to)."""
        names = sorted(set(self.workers_from) | set(self.workers_to))
        return {
            n: (self.workers_from.get(n, 0), self.workers_to.get(n, 0))
            for n in names
            if self.workers_from.get(n, 0) != self.workers_to.get(n, 0)
        }


def apportion(total: int, weights: Mapping[str, float]) -> dict[str, int]:
    """``total`` whole workers over sources in proportion to ``weights`` (largest remainder; ties by name)."""
    pos = {n: max(0.0, w) for n, w in weights.items()}
    s = sum(pos.values())
    if total <= 0 or not pos:
        return dict.fromkeys(weights, 0)
    if s <= 0:
        pos, s = dict.fromkeys(weights, 1.0), float(len(weights))
    exact = {n: total * w / s for n, w in pos.items()}
    out = {n: math.floor(x) for n, x in exact.items()}
    left = total - sum(out.values())
    for n in sorted(exact, key=lambda n: (-(exact[n] - out[n]), n))[:left]:
        out[n] += 1
    return out


class Level:
    """A whole number (workers, partitions) driven by a fractional need, with the hysteresis and cooldown of the
    module docstring: up at once to ceil(need x (1 + headroom)); down only to what fits with the ``band``
    margin, after ``cooldown_s`` of lower need and not within ``cooldown_s`` of its last change."""

    def __init__(self, cfg: PolicyConfig, value: int, unit: str = "workers"):
        self.cfg = cfg
        self.value = cfg.clamp(value)
        self.unit = unit
        self._low_since: float | None = None
        self._changed_at = -math.inf

    def update(self, now: float, need: float, *, hold: bool = False, known: bool = False) -> str | None:
        """Apply one interval's need; the reason when the value changed (``self.value`` is the new one).
        ``known``: the need fell because the mixture ahead says so (not a measurement), so it need not last a
        cooldown before the value goes down (the band and the cooldown after the last change still apply)."""
        cfg = self.cfg
        want = need * (1.0 + cfg.headroom)
        up = cfg.clamp(math.ceil(want - 1e-9))
        if up > self.value:
            reason = f"demand needs {want:.2f} {self.unit} (with headroom) > {self.value}"
            self._set(now, up)
            return reason
        fit = cfg.clamp(math.ceil(want / (1.0 - cfg.band) - 1e-9))
        if fit >= self.value or hold:
            self._low_since = None
            return None
        if self._low_since is None:
            self._low_since = now
        if (now - self._low_since < cfg.cooldown_s and not known) or now - self._changed_at < cfg.cooldown_s:
            return None
        idle = "no demand" if need <= 0 else f"demand needs {want:.2f} {self.unit} (with headroom)"
        self._set(now, fit)
        return (
            f"{idle} from the mixture ahead; {fit} suffice"
            if known
            else f"{idle} for {cfg.cooldown_s:g}s; {fit} suffice"
        )

    def _set(self, now: float, value: int) -> None:
        self.value = value
        self._low_since = None
        self._changed_at = now


def read_needs(demands: Mapping[str, SourceDemand], read_s: Callable[[str], float | None]) -> dict[str, float]:
    """Readers each source keeps busy: its demand (samples/s) x its read seconds per sample (unmeasured: 0).
    What the ``Partitioner`` sizes, on one node and on the leader of a cluster."""
    return {name: d.samples_s * (read_s(name) or 0.0) for name, d in demands.items()}


class Partitioner:
    """Partitions per source: a source whose reading keeps more than one reader busy (demand x read seconds
    per sample, ``read_needs``) is split, with the same hysteresis as the workers; merged back when the demand
    falls (never below ``cfg.min_workers`` partitions)."""

    def __init__(self, cfg: PolicyConfig):
        self.cfg = cfg
        self.levels: dict[str, Level] = {}

    def decide(
        self,
        now: float,
        read_need: Mapping[str, float],
        *,
        hold: bool = False,
        current: Mapping[str, int] | None = None,
    ) -> dict[str, tuple]:
        """source -> (from, to, reason) for the sources whose partitions change; sources gone are forgotten.
        ``current``: the partitions a source first seen here has (default 1)."""
        out = {}
        for name in set(self.levels) - set(read_need):
            del self.levels[name]
        for name, need in read_need.items():
            lv = self.levels.get(name)
            if lv is None:
                lv = self.levels[name] = Level(self.cfg, (current or {}).get(name, 1), "readers")
            before = lv.value
            reason = lv.update(now, need, hold=hold)
            if reason is not None:
                out[name] = (before, lv.value, reason)
        return out

    def partitions(self, name: str) -> int:
        lv = self.levels.get(name)
        return lv.value if lv is not None else 1


class Policy:
    """The decision rule (see the module docstring); one per node."""

    def __init__(self, cfg: PolicyConfig, size: int):
        self.cfg = cfg
        self._size = Level(cfg, size)
        self.workers: dict[str, int] = {}
        self.weights: dict[str, float] = {}
        self._basis: dict[str, float] = {}  # needs at the last apportionment
        self._ahead: dict[str, float] = {}  # each source's share ahead at the last decision
        self._measured: set[str] = set()  # sources whose cost was known at the last decision

    @property
    def size(self) -> int:
        return self._size.value

    def decide(
        self, now: float, demands: Mapping[str, SourceDemand], *, why: str = "", hold: bool = False
    ) -> Decision | None:
        """Apply one interval's demands; a Decision when the size or the apportionment changed, else None.
        ``why`` names what prompted an out-of-turn decision (a mixture change): that one is always a Decision,
        also when the pool stays as it is, so its cause and outcome are logged; ``hold``: some demand is not
        measured yet, so give nothing back."""
        need = sum(d.workers for d in demands.values())
        before = self._size.value
        known = any(d.share_ahead < self._ahead.get(n, 0.0) - 1e-9 for n, d in demands.items())
        self._ahead = {n: d.share_ahead for n, d in demands.items()}
        reason = self._size.update(now, need, hold=hold, known=known) or ""
        size = self._size.value
        self.weights = {n: d.workers for n, d in demands.items()}
        # a source drawn while its cost was unknown (need 0) is drawn again once it is known, however small
        measured = {n for n, d in demands.items() if d.worker_s_per_sample is not None}
        came, self._measured = measured - self._measured, measured
        redraw = size != before or set(demands) != set(self.workers) or bool(came or why) or self._drifted(demands)
        if not redraw:
            return None
        workers = apportion(size, {n: d.workers for n, d in demands.items()})
        if size == before and workers == self.workers and not why:
            self._basis = {n: d.workers for n, d in demands.items()}
            return None
        if size == before and workers == self.workers:
            reason = f"the pool stays at {size} workers (demand needs {need * (1 + self.cfg.headroom):.2f})"
        dec = Decision(
            at=now,
            size_from=before,
            size_to=size,
            workers_from=dict(self.workers),
            workers_to=workers,
            need=need,
            reason="; ".join(r for r in (why, reason) if r) or _moved(self.workers, workers, came),
            demands=dict(demands),
        )
        self.workers = workers
        self._basis = {n: d.workers for n, d in demands.items()}
        return dec

    def _drifted(self, demands: Mapping[str, SourceDemand]) -> bool:
        return any(abs(d.workers - self._basis.get(n, 0.0)) > self.cfg.band for n, d in demands.items())


def _moved(old: Mapping[str, int], new: Mapping[str, int], measured: set[str]) -> str:
    """Why the apportionment changed when the size did not (``measured``: sources whose cost is newly known)."""
    came, left = sorted(set(new) - set(old)), sorted(set(old) - set(new))
    parts = [f"source {n} has demand" for n in came] + [f"source {n} has none (its job left)" for n in left]
    parts += [f"source {n}'s cost is measured" for n in sorted(measured - set(came))]
    return "; ".join(parts) or "the sources' needs moved"
