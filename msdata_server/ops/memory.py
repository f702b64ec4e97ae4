"""Process memory as the kernel accounts it: PSS and USS from /proc/PID/smaps_rollup (RSS overstates shared
pages, ARCHITECTURE §9)."""

from __future__ import annotations

import os

__all__ = ["proc_memory", "tree_memory"]


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
