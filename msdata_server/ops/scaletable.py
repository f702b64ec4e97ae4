"""The ``autoscale`` object of ``status --json`` as a text table (the human ``status`` and ``--watch``)."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

__all__ = ["autoscale_table"]

_COLS = (
    ("source", "{}"),
    ("workers", "{}"),
    ("parts", "{}"),
    ("demand/s", "{:.1f}"),
    ("supply/s", "{:.1f}"),
    ("cpu ms/sample", "{:.3f}"),
    ("share", "{:.2f}"),
    ("ahead", "{:.2f}"),
)


def _cell(fmt: str, v: Any) -> str:
    if v is None or (isinstance(v, bool)):
        return "-"
    try:
        return fmt.format(v)
    except (TypeError, ValueError):
        return "-"


def autoscale_table(a: Any) -> list[str]:
    """Lines: a header (on/off, pool size and bounds, worker-seconds), then one row per source."""
    if not isinstance(a, Mapping):
        return []
    on = "on" if a.get("enabled") else "off (fixed pool)"
    head = f"autoscale {on}"
    if "size" in a:
        head += (
            f": pool {a.get('size')} workers (min {a.get('min_workers')}, max {a.get('max_workers')}), "
            f"{_cell('{:.0f}', a.get('worker_s'))} worker-s"
        )
    if a.get("enabled") and "leader_token" in a:  # a cluster node: its demand is the leader's targets
        following = f"; following the leader's targets (token {a['leader_token']})"
        head += following if a.get("acting") else "; no leader's targets yet"
    sources = a.get("sources") or {}
    if not isinstance(sources, Mapping) or not sources:
        return [head]
    rows = [[h for h, _ in _COLS]]
    for name, s in sources.items():
        if not isinstance(s, Mapping):
            continue
        cpu = s.get("cpu_s_per_sample")
        vals = (
            name,
            s.get("workers"),
            s.get("partitions"),
            s.get("demand_samples_s"),
            s.get("supply_samples_s"),
            cpu * 1e3 if isinstance(cpu, (int, float)) else None,
            s.get("share"),
            s.get("share_ahead"),
        )
        rows.append([_cell(fmt, v) for (_, fmt), v in zip(_COLS, vals)])
    widths = [max(len(r[i]) for r in rows) for i in range(len(_COLS))]
    lines = [head]
    for r in rows:
        lines.append("  " + "  ".join(c.ljust(w) if i == 0 else c.rjust(w) for i, (c, w) in enumerate(zip(r, widths))))
    last = (a.get("decisions") or [None])[-1]
    if isinstance(last, Mapping) and last.get("message"):
        lines.append(f"  last decision: {last['message']}")
    return lines
