"""Per-step plan statistics of a job: the recent ones (bounded) and running totals, for ``status``.

With the two-stage cost (``cost = "vlm"``) each stage's imbalance is averaged too: ``encoder_imbalance`` and
``backbone_imbalance`` (max / mean over ranks; None for a one-stage job)."""

from __future__ import annotations

import time
from typing import Protocol

from msdata_client.mesh import ClientPlaceTree
from msdata_client.spec import JobSpec

from ..ops.waits import WaitStats
from ..planner import PlanStats
from ..planner.accounting import accounting
from ..statedir import StateStore
from .mixview import mixture_view
from .ranks import RankRegistry
from .seams import PayloadSource, PlanFeed
from .steps import Group

__all__ = ["JobView", "PlanLog", "job_status", "waiting_for"]

_RECENT = 64


class PlanLog:
    """What the plans of a job's steps looked like: imbalance, padding, planning time, tokens per source."""

    def __init__(self) -> None:
        self.steps = 0
        self.recent: list[PlanStats] = []  # the newest _RECENT
        self._imbalance = self._padding = self._plan_ms = 0.0
        self._stages = [0.0, 0.0]  # summed encoder and backbone imbalance (two-stage plans)
        self._staged = 0  # plans that had them
        self._tokens: dict[str, int] = {}

    def record(self, st: PlanStats) -> None:
        self.steps += 1
        self.recent.append(st)
        del self.recent[:-_RECENT]
        self._imbalance += st.imbalance
        self._padding += st.padding_fraction
        self._plan_ms += st.plan_ms
        if st.encoder_imbalance is not None and st.backbone_imbalance is not None:
            self._stages[0] += st.encoder_imbalance
            self._stages[1] += st.backbone_imbalance
            self._staged += 1
        for name, n in st.tokens.items():
            self._tokens[name] = self._tokens.get(name, 0) + int(n)

    def summary(self) -> dict:
        n = self.steps
        last = self.recent[-1] if self.recent else None
        return {
            "steps_planned": n,
            "imbalance": self._imbalance / n if n else None,
            "padding_fraction": self._padding / n if n else None,
            "plan_ms": self._plan_ms / n if n else None,
            "encoder_imbalance": self._stages[0] / self._staged if self._staged else None,
            "backbone_imbalance": self._stages[1] / self._staged if self._staged else None,
            "last_step": last.to_dict() if last is not None else None,
            "tokens_per_source": dict(self._tokens),
            "tokens_planned": dict(self._tokens),  # the same, by the name the metrics and README use
        }


class JobView(Protocol):
    """What ``job_status`` reads of a ``Job`` (job.py calls it; this module does not import job.py).

    Size: the fields one status object shows, read-only; a protocol only so that status.py need not import job.py."""

    spec: JobSpec
    name: str
    digest: str
    state: str
    error: str | None
    mesh: ClientPlaceTree
    ranks: RankRegistry
    waits: WaitStats
    groups: list[Group]
    plans: PlanLog
    feed: PlanFeed | None
    payloads: PayloadSource | None
    source_sizes: dict[str, int]
    started_at: float | None
    saving: StateStore | None


def _ranks_text(ranks: list[int], most: int = 16) -> str:
    shown = ", ".join(map(str, ranks[:most]))
    return shown + (f" and {len(ranks) - most} more" if len(ranks) > most else "")


def waiting_for(job: JobView) -> str | None:
    """What keeps the job from delivering, in one line (None: nothing): the ranks its start barrier lacks, or a
    state_dir the planner state cannot be saved in. Shown by ``status``; a waiting client logs it."""
    if job.state == "waiting":
        ws = job.mesh.world_size
        here = job.ranks.connected_ranks()
        missing = sorted(set(range(ws)) - set(here))
        if missing:
            return (
                f"{len(here)} of {ws} ranks of job {job.name} registered here; missing ranks {_ranks_text(missing)} "
                f"(each rank of the mesh must start a DataClient: check WORLD_SIZE and the [mesh])"
            )
        return f"all {ws} ranks of job {job.name} registered; its start is being prepared"
    return job.saving.failing if job.saving is not None else None


def job_status(job: JobView) -> dict:
    """One job's part of ``status --json``: its state, ranks, plan statistics, rings, sources and accounting."""
    elapsed = (time.monotonic() - job.started_at) if job.started_at else 0.0
    published = sum(g.published for g in job.groups)
    nbytes = sum(g.bytes_published for g in job.groups)
    plans = job.plans.summary()
    newest = job.feed.newest_state() if job.feed else None
    acct = accounting(newest, job.spec, job.source_sizes)
    return {
        "name": job.name,
        "digest": job.digest[:16],
        "state": job.state,
        "error": job.error,
        "world_size": job.mesh.world_size,
        "mesh": job.mesh.to_dict(),
        "ranks": job.ranks.connected_ranks(),
        "ranks_away": sorted(job.ranks.away),
        "ranks_detail": job.waits.snapshot(),
        "waiting_for": waiting_for(job),
        "steps_planned": plans.pop("steps_planned"),
        "micro_batches_published": published,
        "micro_batches_per_s": published / elapsed if elapsed else 0.0,
        "bytes_per_s": nbytes / elapsed if elapsed else 0.0,
        **plans,
        "rings": [r for g in job.groups if g.rings is not None for r in g.rings.status()],
        "sources": job.payloads.status(job.feed.newest_state() if job.feed else None)
        if job.payloads is not None
        else {},
        "accounting": acct,
        "mixture": mixture_view(newest, job.spec.source_names(), job.source_sizes, acct),
    }
