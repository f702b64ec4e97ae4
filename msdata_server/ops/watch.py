"""`msdata-server status --watch`: a live text screen of one server (jobs, their stage imbalances with the
two-stage cost, ranks, sources, rings, memory).

``render`` is a pure function of the status dict (the one that ``status --json`` prints) that fits every line
into ``width`` columns; ``watch`` polls the server and redraws, clearing the screen only on a terminal (piped
output gets one frame after another, separated by a blank line).
"""

from __future__ import annotations

import shutil
import sys
import time
from collections.abc import Callable, Mapping
from typing import IO, Any

from ..errors import MsdataError

__all__ = ["render", "watch"]

MAX_RANKS = 16  # rank rows per job; the rest are summarised in one line
CLEAR = "\x1b[H\x1b[2J"


def _dur(s: Any) -> str:
    if not isinstance(s, (int, float)):
        return "-"
    if s < 1e-3:
        return f"{s * 1e6:.0f}us"
    if s < 1:
        return f"{s * 1e3:.1f}ms"
    return f"{s:.2f}s"


def _bytes(n: Any) -> str:
    if not isinstance(n, (int, float)):
        return "-"
    for unit in ("B", "KiB", "MiB", "GiB"):
        if abs(n) < 1024 or unit == "GiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return "-"  # not reached


def _uptime(s: Any) -> str:
    if not isinstance(s, (int, float)):
        return "-"
    s = int(s)
    if s < 3600:
        return f"{s // 60}m{s % 60:02d}s"
    return f"{s // 3600}h{s % 3600 // 60:02d}m"


def _pct(x: Any) -> str:
    return f"{x * 100:.1f}%" if isinstance(x, (int, float)) else "-"


def _f(x: Any, spec: str) -> str:
    """``x`` formatted with ``spec`` when it is a number, else "-" (a partial status never breaks the screen)."""
    return format(x, spec) if isinstance(x, (int, float)) and not isinstance(x, bool) else "-"


def _clip(line: str, width: int) -> str:
    return line if len(line) <= width else line[: width - 1] + "…"


def _header(st: Mapping[str, Any]) -> list[str]:
    mem = st.get("memory") or {}
    lines = [
        (
            f"{st.get('node')}  {st.get('role')}  pid {st.get('pid')}  up {_uptime(st.get('uptime_s'))}  "
            f"workers {st.get('workers')}  PSS {_bytes(mem.get('total_pss'))} "
            f"(server {_bytes(mem.get('server_pss'))})"
        )
    ]
    src, files = mem.get("sources"), mem.get("open_files")
    if isinstance(src, Mapping) and isinstance(files, Mapping):  # what the node's sources hold (ARCHITECTURE)
        lines.append(
            f"sources {_bytes(src.get('total'))} (read-ahead {_bytes(src.get('read_ahead'))}, handles "
            f"{_bytes(src.get('handles'))})  open files {files.get('open')}/{files.get('limit')}"
        )
    c = st.get("cluster")
    if isinstance(c, Mapping):
        t = c.get("traffic") or {}
        lines.append(
            f"leader {c.get('leader')} #{c.get('leader_token')}  members {len(c.get('members') or [])}  "
            f"links {len(c.get('links') or [])}  peer in {_bytes(t.get('bytes_in'))}  "
            f"out {_bytes(t.get('bytes_out'))}"
        )
    lines.extend(_storage(st.get("storage")))
    a = st.get("autoscale")
    if isinstance(a, Mapping) and a.get("sources"):
        from .scaletable import autoscale_table

        lines.extend(autoscale_table(a))
    return lines


def _storage(s: Any) -> list[str]:
    """The node's object-store counters (two lines), once it has made a request."""
    if not isinstance(s, Mapping) or not s.get("requests"):
        return []
    return [
        f"storage {s.get('requests')} req  {_bytes(s.get('bytes'))}  retries {s.get('retries')}  "
        f"throttled {s.get('throttled')}  errors {s.get('errors')}",
        f"  latency p50 {_f(s.get('latency_ms_p50'), '.1f')} ms  p99 {_f(s.get('latency_ms_p99'), '.1f')} ms  "
        f"cache {s.get('cache_hits')} hit / {s.get('cache_misses')} miss",
    ]


def _job(j: Mapping[str, Any]) -> list[str]:
    """One job's block of the screen: its state line, plan figures (and per-stage imbalance), ranks with their
    data wait, then its sources; every line within 80 columns."""
    imb = j.get("imbalance")
    lines = [
        (
            f"job {j.get('name')} [{j.get('state')}]  ranks {len(j.get('ranks') or [])}/{j.get('world_size')}  "
            f"steps {j.get('steps_planned')}  imbalance {_f(imb, '.3f')}  "
            f"padding {_pct(j.get('padding_fraction'))}"
        ),
        (
            f"  published {_f(j.get('micro_batches_per_s'), '.1f')} micro-batches/s  "
            f"{_f((j.get('bytes_per_s') or 0) / 1e9, '.2f')} GB/s"
        ),
    ]
    stages = _stages(j)
    if stages:
        lines.append(stages)
    if j.get("error"):
        lines.append(f"  error: {j['error']}")
    detail = j.get("ranks_detail") or {}
    if detail:
        lines.append(f"  {'rank':>5} {'step':>8} {'delivered':>10} {'waited':>9} {'p50':>8} {'p99':>8} {'wait%':>7}")
        ranks = sorted(detail, key=lambda r: int(r) if str(r).isdigit() else 0)
        for r in ranks[:MAX_RANKS]:
            d = detail[r]
            lines.append(
                f"  {r:>5} {d.get('step', '-'):>8} {d.get('delivered', '-'):>10} {_dur(d.get('wait_s')):>9} "
                f"{_dur(d.get('wait_p50_s')):>8} {_dur(d.get('wait_p99_s')):>8} {_pct(d.get('wait_frac')):>7}"
            )
        if len(ranks) > MAX_RANKS:
            worst = max(ranks, key=lambda r: detail[r].get("wait_frac") or 0.0)
            lines.append(
                f"  … {len(ranks) - MAX_RANKS} more ranks; most waiting: rank {worst} "
                f"{_pct(detail[worst].get('wait_frac'))}"
            )
    sources = j.get("sources") or {}
    if sources:
        lines.append(
            f"  {'source':<18} {'rate/s':>9} {'read':>10} {'held/bound':>13} {'fill':>5} {'bad':>6} {'err':>5}"
        )
        for name, s in sources.items():
            held = s.get("held", s.get("ready", "-"))
            bound = s.get("held_bound", s.get("readahead", "-"))
            bad = sum((s.get("bad_samples") or {}).values())
            lines.append(
                f"  {_clip(str(name), 18):<18} {_f(s.get('samples_per_s'), '.1f'):>9} "
                f"{_bytes(s.get('bytes_read')):>10} {f'{held}/{bound}':>13} "
                f"{_f(s.get('buffer_fill'), '.2f'):>5} "
                f"{bad:>6} {s.get('errors', '-'):>5}"
            )
    mix = j.get("mixture") or {}
    if mix:
        lines.append(f"  {'source':<18} {'target':>8} {'delivered':>10} {'epochs':>7} {'epoch read':>11}")
        for name, m in mix.items():
            lines.append(
                f"  {_clip(str(name), 18):<18} {_pct(m.get('target')):>8} {_pct(m.get('delivered')):>10} "
                f"{_f(m.get('epochs_completed'), 'd'):>7} {_pct(m.get('epoch_progress')):>11}"
            )
    groups: dict[Any, list[int]] = {}
    for r in j.get("rings") or []:
        g = groups.setdefault(r.get("group"), [0, 0, 0])
        g[0] += r.get("in_use", 0)
        g[1] += r.get("slots", 0)
        g[2] = max(g[2], r.get("slot_size", 0))
    if groups:
        lines.append(
            "  rings in use: "
            + "  ".join(f"g{g} {u}/{n}" for g, (u, n, _) in groups.items())
            + f"  (slot {_bytes(max(v[2] for v in groups.values()))})"
        )
    return lines


def _stages(j: Mapping[str, Any]) -> str:
    """The two-stage cost's imbalances (``cost = "vlm"``): mean over the steps, then the last step's; "" for a
    one-stage job (the status has None for them)."""
    enc, bb = j.get("encoder_imbalance"), j.get("backbone_imbalance")
    if enc is None and bb is None:
        return ""
    line = f"  stage imbalance: encoder {_f(enc, '.3f')}  backbone {_f(bb, '.3f')}"
    last = j.get("last_step") or {}
    l_enc, l_bb = last.get("encoder_imbalance"), last.get("backbone_imbalance")
    if l_enc is not None or l_bb is not None:
        line += f"  (last step {_f(l_enc, '.3f')} / {_f(l_bb, '.3f')})"
    return line


def render(status: Mapping[str, Any], width: int = 80) -> str:
    """The screen for one status dict; no line is longer than ``width`` (>= 20) columns."""
    if width < 20:
        raise ValueError(f"{width=} must be >= 20 columns")
    lines = _header(status)
    jobs = status.get("jobs") or []
    if not jobs:
        lines.append("no jobs")
    for j in jobs:
        lines.extend(_job(j))
    return "\n".join(_clip(line, width) for line in lines)


def watch(
    endpoint: str,
    interval: float = 2.0,
    *,
    iterations: int | None = None,
    stream: IO[str] | None = None,
    fetch: Callable[[], Mapping[str, Any]] | None = None,
) -> int:
    """Redraw ``render(status)`` every ``interval`` seconds until interrupted (or ``iterations`` frames).

    A server that is down or restarting is shown as such and polled again; this never raises for it.
    """
    if interval <= 0:
        raise ValueError(f"{interval=} must be > 0 seconds")
    out = sys.stdout if stream is None else stream
    tty = out.isatty()
    if fetch is None:
        fetch = _fetcher(endpoint)
    n = 0
    while True:
        width = shutil.get_terminal_size((80, 24)).columns if tty else 80
        try:
            text = render(fetch(), max(width, 20))
        except (OSError, MsdataError) as e:
            text = f"no server at {endpoint!r} ({e}); retrying every {interval:g}s"
        stamp = time.strftime("%H:%M:%S")
        title = _clip(f"{stamp}  msdata-server status {endpoint}", max(width, 20))
        out.write((CLEAR if tty else "") + f"{title}\n{text}\n" + ("" if tty else "\n"))
        out.flush()
        n += 1
        if iterations is not None and n >= iterations:
            return 0
        time.sleep(interval)


def _fetcher(endpoint: str) -> Callable[[], Mapping[str, Any]]:
    from msdata_client.wire import request

    def fetch() -> Mapping[str, Any]:
        reply = request(endpoint, {"t": "status"}, timeout=5.0)
        status = reply.get("status")
        if not isinstance(status, Mapping):
            raise OSError(f"the server answered {reply.get('t')!r}: {reply.get('message', '')}")
        return status

    return fetch
