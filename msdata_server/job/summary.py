"""The end-of-run summary of a job on this node: what its run delivered, in the figures a person checks first.

A pure function of the job's status (``job_status``) taken as the run closes, so the log line and ``status``
never disagree. The server logs it once per run when every rank left, the job failed or the server drains:
one INFO line in text, the same figures as the ``fields`` of a JSON log line (``[node] log_format = "json"``).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

__all__ = ["run_summary", "summary_text"]


def run_summary(status: Mapping[str, Any], *, why: str, wall_s: float, micro_batches: int) -> dict[str, Any]:
    """The summary of one run from its job status: ``steps_delivered`` (the furthest rank's micro-batches
    delivered over the job's ``micro_batches`` per step), ``micro_batches_delivered`` (all ranks here),
    ``wall_s``, rates, the mean ``imbalance`` and per source ``tokens_delivered``, the delivered and target
    mixture and ``bad_samples`` (read here) with the reason most of them had."""
    ranks = status.get("ranks_detail") or {}
    delivered = [int(r.get("micro_batches_delivered") or 0) for r in ranks.values()]
    sources: dict[str, dict[str, Any]] = {}
    acct, mix, read = status.get("accounting") or {}, status.get("mixture") or {}, status.get("sources") or {}
    for name in acct or mix:
        bad = (read.get(name) or {}).get("bad_samples") or {}
        reason = max(bad.items(), key=lambda kv: (kv[1], kv[0]))[0] if sum(bad.values()) else None
        sources[name] = {
            "tokens_delivered": (acct.get(name) or {}).get("tokens_delivered"),
            "delivered": (mix.get(name) or {}).get("delivered"),
            "target": (mix.get(name) or {}).get("target"),
            "epochs_completed": (mix.get(name) or {}).get("epochs_completed"),
            "bad_samples": sum(bad.values()),
            "bad_reason": reason,
        }
    return {
        "job": status.get("name"),
        "why": why,
        "steps_delivered": max(delivered, default=0) // max(1, micro_batches),
        "steps_planned": status.get("steps_planned"),
        "micro_batches_delivered": sum(delivered),
        "wall_s": round(wall_s, 3),
        "micro_batches_per_s": round(float(status.get("micro_batches_per_s") or 0.0), 2),
        "bytes_per_s": round(float(status.get("bytes_per_s") or 0.0)),
        "imbalance": None if status.get("imbalance") is None else round(float(status["imbalance"]), 4),
        "sources": sources,
    }


def _share(x: float | None) -> str:
    return "-" if x is None else f"{100 * x:.1f}%"


def summary_text(s: Mapping[str, Any]) -> str:
    """The summary in one line: run figures first, then one clause per source."""
    imb = "-" if s["imbalance"] is None else f"{s['imbalance']:.3f}"
    head = (
        f"job {s['job']} run ended ({s['why']}): {s['steps_delivered']} steps delivered "
        f"({s['micro_batches_delivered']} micro-batches, {s['steps_planned']} steps planned) in {s['wall_s']:.1f} s, "
        f"{s['micro_batches_per_s']:.1f} micro-batches/s, {s['bytes_per_s'] / 2**20:.1f} MiB/s, imbalance {imb}"
    )
    parts = []
    for name, f in s["sources"].items():
        bad = f"{f['bad_samples']} bad" + (f" (mostly {f['bad_reason']})" if f["bad_reason"] else "")
        parts.append(
            f"{name}: {f['tokens_delivered']} tokens, {_share(f['delivered'])} of the tokens "
            f"(target {_share(f['target'])}), {bad}"
        )
    return head + ("; " + "; ".join(parts) if parts else "")
