"""Process memory as the kernel accounts it: PSS and USS from /proc/PID/smaps_rollup (RSS overstates shared
pages, ARCHITECTURE §9); the process trees those are summed over and their CPU seconds (the benchmarks' too)."""

from __future__ import annotations

import os

__all__ = ["MEMORY_KINDS", "cpu_seconds", "node_sources_memory", "proc_memory", "tree_memory", "tree_pids"]

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


def tree_pids(pid: int) -> list[int]:
    """pid and all its live descendants, from /proc/PID/task/*/children."""
    out, todo = [], [pid]
    while todo:
        p = todo.pop()
        out.append(p)
        try:
            tasks = os.listdir(f"/proc/{p}/task")
        except OSError:
            continue
        for t in tasks:
            try:
                with open(f"/proc/{p}/task/{t}/children") as f:
                    todo.extend(int(c) for c in f.read().split())
            except OSError:
                pass
    return out


def cpu_seconds(pids) -> float:
    """CPU seconds (user + system) the processes have used so far (a gone one counts 0): a figure the machine's
    other load moves less than wall time."""
    tick, total = os.sysconf("SC_CLK_TCK"), 0
    for p in pids:
        try:
            with open(f"/proc/{p}/stat") as f:
                fields = f.read().rpartition(")")[2].split()  # state, ppid, ... utime (14th field), stime (15th)
            total += int(fields[11]) + int(fields[12])
        except (OSError, ValueError, IndexError):
            continue
    return total / tick


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
