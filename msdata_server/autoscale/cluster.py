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

Placement: a new run's partitions are weighed by their declared share x the measured worker seconds per token
(``measured_costs``) once every source was measured; the leader puts those costs in the run's ``jstart`` frame
(``placement_costs`` reads them there), so every node places alike.

Pure apart from ``Scaler.update`` (which returns the frames to send) and logging.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from ..planner.mixture import Mixture
from ..planner.spec import planner_config
from .demand import SourceDemand, job_demands, merge_demands

__all__ = [
    "LeaderTargets",
    "RunView",
    "Scaler",
    "measured_costs",
    "node_targets",
    "placement_costs",
    "run_view",
    "split_by_owner",
    "start_costs",
]

log = logging.getLogger(__name__)

BAND = 0.15  # a node's targets are re-sent when a source's need moves by more than this many workers


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
    owners: Mapping[str, Sequence[str]]  # source -> the node of each of its partitions


def _mean(xs: list[float]) -> float | None:
    return sum(xs) / len(xs) if xs else None


def node_targets(
    runs: Sequence[RunView], reports: Mapping[str, Mapping[str, Any]], *, lead_s: float
) -> tuple[dict[str, dict[str, SourceDemand]], bool]:
    """node -> source -> its demand there (priced at that node's measured cost, else the cluster's mean), and
    whether to hold (a job's pace or a source's cost is not measured yet: nodes give nothing back)."""
    profs: dict[str, dict[str, Mapping]] = {}
    for nid, rep in reports.items():
        for name, fig in (rep.get("sources") or {}).items():
            profs.setdefault(name, {})[nid] = fig

    def cluster_fig(name: str, key: str) -> float | None:
        return _mean([float(f[key]) for f in profs.get(name, {}).values() if f.get(key)])

    hold = False
    per_node: dict[str, list[SourceDemand]] = {nid: [] for nid in reports}
    for run in runs:
        rates = [float(r["rates"][run.name]) for r in reports.values() if (r.get("rates") or {}).get(run.name)]
        if not rates:
            hold = True  # no rank pulled yet: its consumption is unknown
            continue
        parts, held = job_demands(
            mixture=run.mixture,
            sources=run.sources,
            planned_step=run.planned_step,
            tokens_per_step=run.tokens_per_step,
            steps_per_s=max(rates),  # ranks step together: the fastest report is the freshest
            lead_s=lead_s,
            figures=lambda n: (cluster_fig(n, "tokens_per_sample"), cluster_fig(n, "worker_s_per_sample")),
        )
        hold = hold or held
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


class Scaler:
    """The leader's planner side of autoscaling (one per Coordinator): targets per node, sent on change."""

    def __init__(self) -> None:
        self.sent: dict[str, dict] = {}  # node -> the last targets frame sent it (by this leader)

    def reset(self) -> None:
        """A new leadership (or none): every node gets fresh targets with the new token."""
        self.sent.clear()

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


def run_view(spec, planner, placed: list[list[str]]) -> RunView:
    """A run as the autoscaler sizes it: its planner's cursor and mixture, and where its partitions are read
    (``placed[s][k]``: the node of partition k of source s)."""
    return RunView(
        name=spec.name,
        mixture=planner.mixture,
        sources=spec.source_names(),
        planned_step=planner.step,
        tokens_per_step=planner_config(spec).capacity,
        owners={name: placed[s] for s, name in enumerate(spec.source_names())},
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
