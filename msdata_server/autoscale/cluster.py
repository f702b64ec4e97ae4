"""The autoscaler in a cluster: nodes report their profiles and budgets, the leader sizes every node's workers.

A node's demand depends on which partitions it reads, which only the leader knows. So each node adds to its
leader report (``cluster.report``) its per-source profile (cost per sample, tokens per sample, supply) and
budget (``Autoscaler.report``), and the consumption rate of the jobs whose ranks it hosts. The leader (``Scaler``,
owned by ``cluster.coordinator``) computes each job run's demand per source with the one demand rule of a
single node (``demand.job_demands``: the ranks' pace x the mixture ahead of its planner), splits it over the
nodes by the partitions each owns (``split_by_owner``), prices it at each node's own cost, and sends every node
its targets (a ``scale`` frame with the leader's fencing token: the node's fence drops those of an older
leader). The node feeds them to its policy, as its own demand on one node (``LeaderTargets``): the same
hysteresis, cooldown and [min_workers, max_workers]. A node that loses its leader keeps its last targets.

Partitions (source auto-partitioning): the leader also sizes each run's partitions per source with the one
rule of a single node (``Scaler.repartition``: ``policy.Partitioner`` over ``policy.read_needs`` of the run's
cluster-wide demand and the nodes' mean read seconds per sample; hysteresis, cooldown), from the run's first
count (one partition per node at its start) up to ``MAX_PARTITIONS``. Each change (a ``Split``) carries the
reading cost of one new partition (measured cost x share) and every node's reading load and worker budget; the
coordinator places it (``placement.place_split``) and the run applies it at its next planned step
(``cluster.parts``).

Placement: a new run's partitions are weighed by their declared share x the measured worker seconds per token
(``measured_costs``) once every source was measured; the leader puts those costs in the run's ``jstart`` frame
(``placement_costs`` reads them there), so every node places alike.

Pure apart from ``Scaler.update`` (which returns the frames to send) and logging.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

from ..planner.mixture import Mixture
from ..planner.spec import planner_config
from .demand import SourceDemand, job_demands, merge_demands
from .policy import Partitioner, PolicyConfig, read_needs

__all__ = [
    "LeaderTargets",
    "MAX_PARTITIONS",
    "RunView",
    "Scaler",
    "Split",
    "measured_costs",
    "node_targets",
    "placement_costs",
    "reading_load",
    "run_view",
    "split_by_owner",
    "start_costs",
]

log = logging.getLogger(__name__)

BAND = 0.15  # a node's targets are re-sent when a source's need moves by more than this many workers
MAX_PARTITIONS = 16  # per source and run in a cluster (``job.parts.MAX_PARTITIONS`` on one node)


def split_by_owner(samples_s: Mapping[str, float], owners: Mapping[str, Sequence[str]]) -> dict[str, dict[str, float]]:
    """node -> source -> samples/s: each source's demand split over its partitions' owners (``owners[source]``
    names the node of each partition; partitions are equal slices of a source's deterministic order)."""
    out: dict[str, dict[str, float]] = {}
    for name, rate in samples_s.items():
        row = owners.get(name) or ()
        if not row:
            raise ValueError(f"source {name!r} has demand but no partition placed on any node")
        for nid in row:
            per = out.setdefault(nid, {})
            per[name] = per.get(name, 0.0) + rate / len(row)
    return out


@dataclass(frozen=True, slots=True, kw_only=True)
class RunView:
    """One job run as the leader's planner sees it."""

    name: str
    mixture: Mixture
    sources: tuple[str, ...]
    planned_step: int
    tokens_per_step: int
    owners: Mapping[str, Sequence[str]]  # source -> the node of each partition it reads with now
    run_id: str = ""
    base: int = 1  # partitions per source at the run's start (a merge goes no lower)
    costs: Mapping[str, float] = field(default_factory=dict)  # source -> placement cost of one first partition

    def part_cost(self, name: str, costs: Mapping[str, float] | None = None) -> float:
        """The reading cost of one partition of ``name`` now (of the first partitions' ``costs``, default the
        run's): the source's cost spread over the partitions it reads with."""
        return (costs or self.costs).get(name, 0.0) * self.base / max(1, len(self.owners.get(name) or ()))


def _mean(xs: list[float]) -> float | None:
    return sum(xs) / len(xs) if xs else None


def _profiles(reports: Mapping[str, Mapping[str, Any]]) -> dict[str, dict[str, Mapping]]:
    """source -> node -> its profile figures, from the nodes' reports."""
    profs: dict[str, dict[str, Mapping]] = {}
    for nid, rep in reports.items():
        for name, fig in (rep.get("sources") or {}).items():
            profs.setdefault(name, {})[nid] = fig
    return profs


def _cluster_fig(profs: Mapping[str, Mapping[str, Mapping]], name: str, key: str) -> float | None:
    """The mean of one figure of a source over the nodes that measured it."""
    return _mean([float(f[key]) for f in profs.get(name, {}).values() if f.get(key)])


def run_demands(
    run: RunView, reports: Mapping[str, Mapping[str, Any]], *, lead_s: float
) -> tuple[list[SourceDemand] | None, bool]:
    """A run's cluster-wide demand per source by the one rule of a single node (``demand.job_demands``: the
    ranks' pace x the mixture ahead x the cluster's mean figures), and whether some figure is unmeasured; None
    while no rank pulled yet."""
    profs = _profiles(reports)
    rates = [float(r["rates"][run.name]) for r in reports.values() if (r.get("rates") or {}).get(run.name)]
    if not rates:
        return None, True
    return job_demands(
        mixture=run.mixture,
        sources=run.sources,
        planned_step=run.planned_step,
        tokens_per_step=run.tokens_per_step,
        steps_per_s=max(rates),  # ranks step together: the fastest report is the freshest
        lead_s=lead_s,
        figures=lambda n: (_cluster_fig(profs, n, "tokens_per_sample"), _cluster_fig(profs, n, "worker_s_per_sample")),
    )


def node_targets(
    runs: Sequence[RunView], reports: Mapping[str, Mapping[str, Any]], *, lead_s: float
) -> tuple[dict[str, dict[str, SourceDemand]], bool]:
    """node -> source -> its demand there (priced at that node's measured cost, else the cluster's mean), and
    whether to hold (a job's pace or a source's cost is not measured yet: nodes give nothing back)."""
    profs = _profiles(reports)
    hold = False
    per_node: dict[str, list[SourceDemand]] = {nid: [] for nid in reports}
    for run in runs:
        parts, held = run_demands(run, reports, lead_s=lead_s)
        hold = hold or held
        if parts is None:
            continue  # no rank pulled yet: its consumption is unknown
        by_name = {d.name: d for d in parts}
        split = split_by_owner({d.name: d.samples_s for d in parts}, run.owners)
        for nid, rates_here in split.items():
            for name, samples_s in rates_here.items():
                d = by_name[name]
                own = (profs.get(name, {}).get(nid) or {}).get("worker_s_per_sample")
                per_node.setdefault(nid, []).append(
                    SourceDemand(
                        name=name,
                        samples_s=samples_s,
                        worker_s_per_sample=float(own) if own else d.worker_s_per_sample,
                        share_now=d.share_now,
                        share_ahead=d.share_ahead,
                    )
                )
    return {nid: merge_demands(parts) for nid, parts in per_node.items()}, hold


def measured_costs(
    sources: Sequence[str], declared: Sequence[float], reports: Mapping[str, Mapping[str, Any]]
) -> list[float] | None:
    """The placement cost of one partition of each source: its declared cost (its share of the tokens over its
    partitions, ``placement.partition_costs``) x the worker seconds a token of it measured (the mean over the
    nodes that measured it). None unless every source was measured: placement then weighs the share only."""
    out = []
    for name, share in zip(sources, declared):
        per_token = []
        for rep in reports.values():
            fig = (rep.get("sources") or {}).get(name) or {}
            w, t = fig.get("worker_s_per_sample"), fig.get("tokens_per_sample")
            if w and t:
                per_token.append(float(w) / float(t))
        if not per_token:
            return None
        out.append(share * sum(per_token) / len(per_token))
    return out


def placement_costs(frame: Mapping[str, Any], n_sources: int) -> list[float] | None:
    """The measured partition costs a ``jstart`` frame carries (None: none, or malformed, named once)."""
    costs = frame.get("costs")
    if costs is None:
        return None
    try:
        vals = [float(c) for c in costs]
    except (TypeError, ValueError):
        vals = []
    if len(vals) != n_sources or not all(math.isfinite(c) and c >= 0 for c in vals):
        log.warning("ignored the partition costs of a run start: %r is not one cost >= 0 per source", costs)
        return None
    return vals


def targets_frame(demands: Mapping[str, SourceDemand], *, hold: bool, token: int) -> dict:
    """The ``scale`` frame of one node's targets."""
    return {
        "t": "scale",
        "token": token,
        "hold": hold,
        "sources": {
            n: {
                "samples_s": round(d.samples_s, 4),
                "worker_s_per_sample": d.worker_s_per_sample,
                "workers": round(d.workers, 4),
                "share": round(d.share_now, 4),
                "share_ahead": round(d.share_ahead, 4),
            }
            for n, d in sorted(demands.items())
        },
    }


def _moved(old: Mapping[str, Any] | None, new: Mapping[str, Any]) -> str | None:
    """Why a node's targets must be sent again (None: within the band of the last ones sent)."""
    if old is None:
        return "first targets from this leader"
    if old["hold"] != new["hold"]:
        return "demand measured" if not new["hold"] else "demand not measured yet"
    a, b = old["sources"], new["sources"]
    if set(a) != set(b):
        return "its sources changed"
    moved = [
        n for n in b if abs(b[n]["workers"] - a[n]["workers"]) > BAND or b[n]["share_ahead"] != a[n]["share_ahead"]
    ]
    return f"need of {', '.join(moved)} moved" if moved else None


@dataclass(frozen=True, slots=True, kw_only=True)
class Split:
    """The leader's decision to read a source of a run in ``n_to`` partitions instead of ``n_from`` (a split or a
    merge), with what placing them needs: the reading cost of one new partition (measured cost x share), every
    node's reading load now (the source's current partitions left out) and its worker budget (max workers)."""

    run_id: str
    source: str
    n_from: int
    n_to: int
    cost: float
    load: dict[str, float]
    budget: dict[str, float]
    reason: str


class Scaler:
    """The leader's planner side of autoscaling (one per Coordinator): targets per node, sent on change; the
    partitions of each run's sources (``repartition``)."""

    def __init__(self, *, headroom: float = 0.25, cooldown_s: float = 6.0) -> None:
        self.sent: dict[str, dict] = {}  # node -> the last targets frame sent it (by this leader)
        self.headroom, self.cooldown_s = headroom, cooldown_s
        self.parts: dict[str, Partitioner] = {}  # run id -> its sources' partition levels (this leadership)

    def reset(self) -> None:
        """A new leadership (or none): every node gets fresh targets with the new token."""
        self.sent.clear()
        self.parts.clear()

    def repartition(
        self, runs: Sequence[RunView], reports: Mapping[str, Mapping[str, Any]], *, now: float, lead_s: float
    ) -> list[Split]:
        """The sources whose partitions change (see the module docstring), in run and source order."""
        scaling = {nid: r for nid, r in reports.items() if r.get("enabled")}
        for rid in set(self.parts) - {r.run_id for r in runs}:
            del self.parts[rid]
        if not scaling:
            return []
        profs = _profiles(scaling)
        costs = {r.run_id: _measured(r, scaling) for r in runs}
        out = []
        for run in runs:
            demands, held = run_demands(run, scaling, lead_s=lead_s)
            if demands is None or not run.run_id:
                continue
            by_name = {d.name: d for d in demands}
            need = read_needs(by_name, lambda n: _cluster_fig(profs, n, "read_s_per_sample"))
            p = self.parts.get(run.run_id)
            if p is None:
                top = max(run.base, MAX_PARTITIONS)
                cfg = PolicyConfig(
                    min_workers=run.base, max_workers=top, headroom=self.headroom, cooldown_s=self.cooldown_s
                )
                p = self.parts[run.run_id] = Partitioner(cfg)
            current = {n: len(run.owners.get(n) or ()) for n in run.sources}
            for name, (a, b, why) in sorted(p.decide(now, need, hold=held, current=current).items()):
                load = reading_load(runs, costs, scaling, skip=(run.run_id, name))
                d = by_name[name]
                out.append(
                    Split(
                        run_id=run.run_id,
                        source=name,
                        n_from=a,
                        n_to=b,
                        cost=costs[run.run_id].get(name, 0.0) * run.base / b,
                        load=load,
                        budget={nid: float(r.get("max_workers") or 1) for nid, r in scaling.items()},
                        reason=f"{why} (demand {d.samples_s:.1f} samples/s, read need {need[name]:.2f} readers)",
                    )
                )
        return out

    def forget(self, nid: str) -> None:
        self.sent.pop(nid, None)

    def update(
        self, runs: Sequence[RunView], reports: Mapping[str, Mapping[str, Any]], *, token: int, lead_s: float
    ) -> dict[str, dict]:
        """node -> the targets frame to send it now (only nodes whose targets moved); each logged once."""
        scaling = {nid: r for nid, r in reports.items() if r.get("enabled")}
        if not scaling:
            return {}  # no job running: every node gets "no demand" (its workers go back after the cooldown)
        demands, hold = node_targets(runs, scaling, lead_s=lead_s)
        out = {}
        for nid in sorted(scaling):
            frame = targets_frame(demands.get(nid, {}), hold=hold, token=token)
            why = _moved(self.sent.get(nid), frame)
            if why is None:
                continue
            self.sent[nid] = out[nid] = frame
            parts = [
                f"source {n} {s['workers']:.2f} workers ({s['samples_s']:.1f} samples/s, share ahead "
                f"{s['share_ahead']:.2f})"
                for n, s in frame["sources"].items()
            ]
            log.info(
                "autoscale: leader (token %d): node %s targets: %s%s (%s)",
                token,
                nid,
                "; ".join(parts) or "no demand",
                ", holding" if hold else "",
                why,
            )
        return out


class LeaderTargets:
    """A node's side: the targets of the newest leader it heard from, kept when that leader goes."""

    def __init__(self) -> None:
        self.demands: dict[str, SourceDemand] | None = None  # None until a leader sent targets
        self.hold = False
        self.token = 0
        self.frame: dict | None = None

    def accept(self, frame: Mapping[str, Any]) -> bool:
        """Take a ``scale`` frame; False (ignored) when it comes from a leader older than the last one heard."""
        token = int(frame.get("token") or 0)
        if token < self.token:
            return False
        demands = {}
        for name, t in dict(frame["sources"]).items():
            cost = t.get("worker_s_per_sample")
            demands[str(name)] = SourceDemand(
                name=str(name),
                samples_s=float(t["samples_s"]),
                worker_s_per_sample=None if cost is None else float(cost),
                share_now=float(t.get("share", 0.0)),
                share_ahead=float(t.get("share_ahead", 0.0)),
            )
        self.demands, self.hold, self.token, self.frame = demands, bool(frame.get("hold")), token, dict(frame)
        return True

    def status(self, name: str) -> dict | None:
        """The targets of one source as status shows them (None: no targets for it)."""
        if self.frame is None:
            return None
        t = self.frame["sources"].get(name)
        if t is None:
            return None
        return {"samples_s": t["samples_s"], "workers": t["workers"], "token": self.token}


def reading_load(
    runs: Sequence[RunView], costs: Mapping[str, Mapping[str, float]], nodes, *, skip: tuple[str, str]
) -> dict[str, float]:
    """node -> the reading cost of the partitions it reads now, over every run (``costs``: run id -> source ->
    the cost of one first partition), for ``nodes`` only; ``skip``: a (run id, source) being re-placed."""
    load = dict.fromkeys(nodes, 0.0)
    for run in runs:
        for name, owners in run.owners.items():
            if (run.run_id, name) == skip:
                continue
            for nid in owners:
                if nid in load:
                    load[nid] += run.part_cost(name, costs[run.run_id])
    return load


def _measured(run: RunView, reports: Mapping[str, Mapping[str, Any]]) -> dict[str, float]:
    """The placement cost of one first partition of each source of a run: measured cost x share when every
    source was measured (``measured_costs``), else the run's own."""
    got = measured_costs(run.sources, [run.costs.get(n, 0.0) for n in run.sources], reports)
    return dict(zip(run.sources, got)) if got is not None else dict(run.costs)


class Layout(Protocol):
    """What ``run_view`` reads of a run's partition layout (``cluster.placement.PartitionLayout``)."""

    nparts: int
    costs: list[float]
    table: Any  # cluster.parts.PartsTable: newest(s)

    def placement(self) -> list[list[str]]: ...


def run_view(spec, planner, where: Layout, run_id: str = "") -> RunView:
    """A run as the autoscaler sizes it: its planner's cursor and mixture, and the nodes of the partitions each
    source reads with now (its newest generation in ``where``, the run's partition layout)."""
    placed, names = where.placement(), spec.source_names()
    return RunView(
        name=spec.name,
        mixture=planner.mixture,
        sources=names,
        planned_step=planner.step,
        tokens_per_step=planner_config(spec).capacity,
        owners={name: [placed[s][k] for k in where.table.newest(s)] for s, name in enumerate(names)},
        run_id=run_id,
        base=where.nparts,
        costs=dict(zip(names, where.costs)),
    )


def start_costs(
    job: str, names: Sequence[str], declared: Sequence[float], reports: Mapping[str, Mapping]
) -> list[float] | None:
    """A new run's partition costs: the declared ones (share) weighed by the measured cost per token, when every
    source has been measured by some node (``reports``: the nodes' leader reports); None: not yet."""
    auto = {n: r["autoscale"] for n, r in reports.items() if isinstance(r.get("autoscale"), dict)}
    costs = measured_costs(names, list(declared), auto)
    if costs is not None:
        log.info(
            "job %s: partitions placed by measured cost x share (%s)",
            job,
            ", ".join(f"{n} {c:.3g}" for n, c in zip(names, costs)),
        )
    return costs
