"""The node's autoscaler: every ``[autoscale] interval`` seconds (and at once after a mixture change) it reads
the pool's per-source usage and each running job's signals, updates the profiles and demands, lets the policy
decide, and applies the decision to the one worker pool: its size (``resize``; new workers fork from the warm
forkserver) and the sources' weights (``set_quotas``). Every decision is logged once, with its reason.

With ``enabled = false`` it still profiles (``status`` shows the figures) and never touches the pool, which then
stays the fixed FIFO pool of ``[node] workers``. In a cluster the demand of a node depends on which partitions it
reads, which only the leader knows: the node reports its profile to the leader (``on_step``) and, once the
leader sent its targets (``follow``), decides from them instead of its own demand, through the same policy
(``acting`` true from then on); it keeps the last targets when the leader goes (see ``autoscale.cluster``).
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections import deque
from collections.abc import Callable, Iterable
from typing import TYPE_CHECKING

from .cluster import LeaderTargets
from .demand import ConsumptionMeter, SourceDemand, job_demands, merge_demands
from .policy import Decision, Partitioner, Policy, PolicyConfig, read_needs
from .profile import Counters, ProfileFigures, SourceProfile
from .signals import JobSignals, job_signals

if TYPE_CHECKING:
    from ..config import AutoscaleConfig
    from ..job import Job
    from ..pool import WorkerPool

__all__ = ["Autoscaler", "initial_size"]

log = logging.getLogger(__name__)

MAX_PARTITIONS = 4  # per source on one node
SPINUP_S = 0.2  # what a scale-up takes to bite (forking from the warm forkserver, the first task): look-ahead
SMOOTHING_S = 5.0  # time constant of the profiles and the consumption rate (at least 4 intervals)


def _cost(fig: ProfileFigures) -> float:
    """Worker seconds a sample occupies, for sizing: the wall time a worker spends on it (1 / the samples per
    second one worker supplies). On a shared machine that includes waiting for a core, which more workers do
    win back (the scheduler shares by runnable process), up to max_workers; the CPU time is what status shows."""
    return fig.worker_s_per_sample or fig.cpu_s_per_sample or 0.0


def initial_size(cfg: AutoscaleConfig, workers: int) -> int:
    """The pool's size at start: ``[node] workers``, within [min_workers, max] when autoscaling."""
    return min(cfg.max_size, max(cfg.min_workers, workers)) if cfg.enabled else workers


class Autoscaler:
    """One per node with a worker pool; ``run()`` is its loop (the node server owns the task)."""

    def __init__(
        self,
        pool: WorkerPool,
        cfg: AutoscaleConfig,
        jobs: Callable[[], Iterable[Job]],
        *,
        clock: Callable[[], float] = time.monotonic,
        cluster: bool = False,
    ):
        self.pool = pool
        self.cfg = cfg
        self.enabled = cfg.enabled
        # one node: it acts on its own demand; a cluster: once it follows a leader's targets (``leader``)
        self.acting = cfg.enabled and not cluster
        self.leader: LeaderTargets | None = LeaderTargets() if cluster else None
        self.on_step: list[Callable[[], None]] = []  # called after each decision in a cluster (the leader report)
        self.rates: dict[str, float] = {}  # job name -> its ranks' steps per second here (the last decision)
        self._jobs = jobs
        self._clock = clock
        self.policy = Policy(
            PolicyConfig(
                min_workers=cfg.min_workers, max_workers=cfg.max_size, headroom=cfg.headroom, cooldown_s=cfg.cooldown_s
            ),
            pool.size,
        )
        self.partitioner = Partitioner(
            PolicyConfig(min_workers=1, max_workers=MAX_PARTITIONS, headroom=cfg.headroom, cooldown_s=cfg.cooldown_s)
        )
        self._splits: dict[str, tuple] = {}  # source -> (from, to, reason): partition changes to apply
        tau = max(SMOOTHING_S, 4.0 * cfg.interval)
        self._tau = tau
        self.profiles: dict[str, SourceProfile] = {}
        self._meters: dict[str, ConsumptionMeter] = {}
        self._partitions: dict[str, int] = {}
        self.demands: dict[str, SourceDemand] = {}
        self.decisions: deque[dict] = deque(maxlen=32)
        self._wake = asyncio.Event()
        self._why: list[str] = []
        self._planned: dict[str, int] = {}  # job -> the next step its planner plans (at the last decision)

    # ---- the loop ---------------------------------------------------------------------------------------
    async def run(self) -> None:
        while True:
            try:
                async with asyncio.timeout(self.cfg.interval):
                    await self._wake.wait()
            except TimeoutError:
                pass
            self._wake.clear()
            why, self._why = "; ".join(self._why), []
            try:
                dec = self.step(self._clock(), why=why)
                if dec is not None:
                    await self.apply(dec)
                if self._splits:
                    await self.repartition()
            except Exception:  # a failed decision (a worker that cannot start) must not end autoscaling
                log.exception("autoscale: the decision failed; the pool stays as it is until the next one")

    def mixture_changed(self, job: str, cut: int) -> None:
        """A job's mixture changes from step ``cut``: decide now, not at the next interval."""
        self._why.append(f"job {job}: mixture changed from step {cut}")
        self._wake.set()

    # ---- one decision -----------------------------------------------------------------------------------
    def step(self, now: float, *, why: str = "") -> Decision | None:
        """Observe, update demands, decide (pure apart from reading the pool and the jobs)."""
        signals = [s for s in (job_signals(j) for j in self._jobs()) if s is not None]
        self._planned = {s.name: s.planned_step for s in signals}
        self._observe(now, signals)
        parts: list[SourceDemand] = []
        hold = False
        rates: dict[str, float] = {}
        lead_s = self.cfg.interval + SPINUP_S  # until the next decision, and the new workers start
        for sig in signals:
            rate = self._meter(sig).observe(now, sig.rank_step, sig.rank_wait_s) if sig.rank_step is not None else None
            if rate is None:
                hold = True  # a job whose consumption is not measured yet: give nothing back
                continue
            rates[sig.name] = rate
            got, held = job_demands(
                mixture=sig.mixture,
                sources=sig.sources,
                planned_step=sig.planned_step,
                tokens_per_step=sig.tokens_per_step,
                steps_per_s=rate,
                lead_s=lead_s,
                figures=self._figures,
            )
            parts += got
            hold = hold or held
        self.rates = rates
        live = {s.key for s in signals}
        for k in set(self._meters) - live:
            del self._meters[k]
        self.demands = merge_demands(parts)
        if self.leader is not None:  # a cluster: the leader's targets are this node's demand
            for hook in self.on_step:
                hook()  # the profile goes to the leader with the next report
            if self.leader.demands is None or not self.enabled:
                return None
            self.acting = True
            dec = self.policy.decide(now, self.leader.demands, why=why, hold=self.leader.hold)
            self.pool.set_quotas(self.policy.weights if any(self.policy.weights.values()) else None)
            return dec  # a cluster: the leader splits and merges partitions (Scaler.repartition), not a node
        if not self.acting:
            return None
        dec = self.policy.decide(now, self.demands, why=why, hold=hold)
        self.pool.set_quotas(self.policy.weights if any(self.policy.weights.values()) else None)
        reads = read_needs(
            self.demands, lambda n: self.profiles[n].figures().read_s_per_sample if n in self.profiles else None
        )
        self._splits = self.partitioner.decide(now, reads, hold=hold)
        return dec

    async def repartition(self) -> None:
        """Split or merge the sources the partitioner moved, in every job here that reads them (logged once)."""
        splits, self._splits = self._splits, {}
        for name, (a, b, reason) in sorted(splits.items()):
            d = self.demands.get(name)
            log.info(
                "autoscale: source %s partitions %d -> %d: %s (demand %.1f samples/s)",
                name,
                a,
                b,
                reason,
                d.samples_s if d else 0.0,
            )
            for job in self._jobs():
                if job.payloads is not None and name in (s.name for s in job.spec.sources):
                    await job.payloads.repartition(name, b)  # a cluster's answer False: its leader splits

    def _figures(self, name: str) -> tuple[float | None, float | None]:
        """(tokens per sample, worker seconds per sample) of a source here; None while unmeasured."""
        fig = self.profiles[name].figures() if name in self.profiles else None
        return (fig.tokens_per_sample, _cost(fig)) if fig is not None else (None, None)

    def follow(self, frame: dict) -> None:
        """A leader's ``scale`` frame (its targets for this node): the next decision follows it, at once."""
        if self.leader is None:
            log.warning("autoscale: ignored a leader's targets: this node is not in a cluster")
            return
        if not self.leader.accept(frame):
            log.info(
                "autoscale: ignored targets of token %s: older than the leader followed (token %d)",
                frame.get("token"),
                self.leader.token,
            )
            return
        self._why.append(f"targets from the leader (token {self.leader.token})")
        self._wake.set()

    def _meter(self, sig: JobSignals) -> ConsumptionMeter:
        m = self._meters.get(sig.key)
        if m is None:
            m = self._meters[sig.key] = ConsumptionMeter(tau=self._tau)
            if sig.started is not None:  # the job's start is the first point: ranks that ran all they will
                m.observe(sig.started[0], sig.started[1], 0.0)  # before we first looked still give a pace
        return m

    def _observe(self, now: float, signals: list[JobSignals]) -> None:
        usage = self.pool.usage()
        per: dict[str, dict[str, float]] = {}
        parts: dict[str, int] = {}
        for sig in signals:
            for name, fig in sig.loaders.items():
                acc = per.setdefault(name, {})
                for k in ("samples_done", "read_s", "bytes_read", "tokens_read", "memory_bytes"):
                    acc[k] = acc.get(k, 0) + (fig.get(k) or 0)
                parts[name] = parts.get(name, 0) + int(fig.get("partitions", 1) or 1)
        self._partitions = parts
        for name in set(per) | set(usage):
            u, acc = usage.get(name), per.get(name, {})
            c = Counters(
                samples_transformed=u.samples if u else 0,
                cpu_s=u.cpu_s if u else 0.0,
                worker_s=u.wall_s if u else 0.0,
                samples_read=int(acc.get("samples_done", 0)),
                read_s=float(acc.get("read_s", 0.0)),
                bytes_read=int(acc.get("bytes_read", 0)),
                tokens_read=int(acc.get("tokens_read", 0)),
                memory_bytes=int(acc.get("memory_bytes", 0)),
            )
            prof = self.profiles.get(name)
            if prof is None:
                prof = self.profiles[name] = SourceProfile(tau=self._tau)
            prof.observe(now, c)

    async def apply(self, dec: Decision) -> None:
        """Resize the pool to the decision (growing forks from the warm forkserver) and log it once."""
        rec = self._record(dec)
        log.info("autoscale: %s", rec["message"])
        if dec.size_to != self.pool.size:
            await self.pool.resize(dec.size_to)

    def _record(self, dec: Decision) -> dict:
        parts = []
        for name, (a, b) in dec.changes().items():
            d = dec.demands.get(name)
            prof = self.profiles.get(name)
            supply = prof.figures().supply_samples_s if prof is not None else 0.0
            demand = (
                f"demand {d.samples_s:.1f} samples/s (share {d.share_now:.2f}, ahead {d.share_ahead:.2f})"
                if d
                else "no demand"
            )
            parts.append(f"source {name} workers {a} -> {b} ({demand}, supply {supply:.1f} samples/s)")
        at = ", ".join(f"job {j} planning step {s}" for j, s in self._planned.items())
        msg = f"pool {dec.size_from} -> {dec.size_to} workers ({at}): {dec.reason}" + (
            "; " + "; ".join(parts) if parts else ""
        )
        rec = {
            "t": dec.at,
            "size_from": dec.size_from,
            "size_to": dec.size_to,
            "workers_from": dec.workers_from,
            "workers_to": dec.workers_to,
            "need": round(dec.need, 4),
            "reason": dec.reason,
            "planned": dict(self._planned),
            "ahead": {n: round(d.share_ahead, 4) for n, d in dec.demands.items()},
            "message": msg,
        }
        self.decisions.append(rec)
        return rec

    # ---- status -----------------------------------------------------------------------------------------
    def status(self) -> dict:
        """The ``autoscale`` object of ``status --json`` (ARCHITECTURE §4.6)."""
        usage = self.pool.usage()
        sources: dict[str, dict] = {}
        following = self.leader.demands if self.leader is not None and self.leader.demands is not None else None
        targeted = set(following or ())
        for name in sorted(set(self.profiles) | set(self.demands) | targeted):
            fig = self.profiles[name].figures() if name in self.profiles else None
            d = following.get(name) if following is not None else self.demands.get(name)
            u = usage.get(name)
            sources[name] = {
                "workers": self.policy.workers.get(name, 0) if self.acting else self.pool.size,
                "need_partitions": self.partitioner.partitions(name),
                "partitions": self._partitions.get(name, 0),
                "demand_samples_s": round(d.samples_s, 3) if d else 0.0,
                "supply_samples_s": round(fig.supply_samples_s, 3) if fig else 0.0,
                "cpu_s_per_sample": fig.cpu_s_per_sample if fig else None,
                "worker_s_per_sample": fig.worker_s_per_sample if fig else None,
                "read_s_per_sample": fig.read_s_per_sample if fig else None,
                "bytes_per_sample": fig.bytes_per_sample if fig else None,
                "tokens_per_sample": fig.tokens_per_sample if fig else None,
                "memory_bytes": fig.memory_bytes if fig else 0,
                "need_workers": round(d.workers, 4) if d else 0.0,
                "share": d.share_now if d else 0.0,
                "share_ahead": d.share_ahead if d else 0.0,
                "cpu_s": round(u.cpu_s, 3) if u else 0.0,
                "busy": u.busy if u else 0,
                "queued": u.queued if u else 0,
            }
            if self.leader is not None:  # a cluster: the leader's targets for this node (None: none yet)
                sources[name]["target"] = self.leader.status(name)
        return {
            "enabled": self.enabled,
            "acting": self.acting,
            "size": self.pool.size,
            "min_workers": self.policy.cfg.min_workers,
            "max_workers": self.policy.cfg.max_workers,
            "interval": self.cfg.interval,
            "worker_s": round(self.pool.worker_seconds(), 3),
            "sources": sources,
            "decisions": list(self.decisions),
            **({"leader_token": self.leader.token} if self.leader is not None else {}),
        }

    def report(self) -> dict:
        """What a node tells the leader: its budget, its profile per source, and the pace of the jobs ranked here."""
        sources = {}
        for name, prof in self.profiles.items():
            fig = prof.figures()
            sources[name] = {
                "cpu_s_per_sample": fig.cpu_s_per_sample,
                "worker_s_per_sample": fig.worker_s_per_sample or fig.cpu_s_per_sample,
                "tokens_per_sample": fig.tokens_per_sample,
                "read_s_per_sample": fig.read_s_per_sample,
                "supply_samples_s": round(fig.supply_samples_s, 3),
            }
        return {
            "enabled": self.enabled,
            "min_workers": self.policy.cfg.min_workers,
            "max_workers": self.policy.cfg.max_workers,
            "workers": self.pool.size,
            "sources": sources,
            "rates": {name: round(r, 4) for name, r in self.rates.items()},
        }
