"""Process memory as the kernel accounts it: PSS and USS from /proc/PID/smaps_rollup (RSS overstates shared
pages, ARCHITECTURE §9)."""

from __future__ import annotations

import os

__all__ = ["MEMORY_KINDS", "node_sources_memory", "proc_memory", "tree_memory"]

# what a source holds, by kind (status ``sources[...].memory``; loader.loader.LoaderStats)
MEMORY_KINDS = ("read_ahead", "order", "metadata", "handles", "decoded")


def proc_memory(pid: int | None = None) -> dict[str, int]:
    """{"rss", "pss", "uss"} in bytes for one process (zeros if it is gone or unreadable)."""
    pid = os.getpid() if pid is None else pid
    out = {"rss": 0, "pss": 0, "uss": 0}
    try:
        with open(f"/proc/{pid}/smaps_rollup") as f:
            for line in f:
                key, _, rest = line.partition(":")
                parts = rest.split()
                if not parts or not parts[0].isdigit():
                    continue
                kib = int(parts[0]) * 1024
                if key == "Rss":
                    out["rss"] = kib
                elif key == "Pss":
                    out["pss"] = kib
                elif key in ("Private_Clean", "Private_Dirty"):
                    out["uss"] += kib
    except OSError:
        pass
    return out


def tree_memory(pids) -> dict[str, int]:
    """Sum of proc_memory over several processes (PSS sums correctly across processes; RSS does not)."""
    tot = {"rss": 0, "pss": 0, "uss": 0}
    for p in pids:
        m = proc_memory(p)
        for k in tot:
            tot[k] += m[k]
    return tot


def node_sources_memory(jobs: list[dict]) -> dict:
    """The node's totals for status ``memory``: ``sources``, bytes by kind summed over every job's sources (their
    ``memory``), with ``total``; ``read_ahead_budget`` (loader/budget.py) and ``open_files`` (the node's LRU of
    handles: open, limit, evictions). Imports the server's modules lazily: the rest of this module is stdlib."""
    from ..loader.budget import node_budget
    from ..sources.handles import node_handles

    tot = dict.fromkeys(MEMORY_KINDS, 0)
    for j in jobs:
        for src in (j.get("sources") or {}).values():
            for k, v in (src.get("memory") or {}).items():
                tot[k] = tot.get(k, 0) + int(v)
    tot["total"] = sum(tot.values())
    return {"sources": tot, "read_ahead_budget": node_budget().figures(), "open_files": node_handles().figures()}
