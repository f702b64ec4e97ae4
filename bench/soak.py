# .venv/bin/python bench/soak.py --quick        (3 minutes; the full soak: --minutes 30)
"""Soak (issues 14 and 16): the demo's job at full rate for a long while, the way a real run treats a server.

Two ranks iterate the demo job (examples/demo_job.toml) as fast as they can; rank 0 changes the mixture
every minute (alternating two mixtures) and saves its ``state_dict()`` every 200 steps; every five minutes
both ranks are killed and started again from the newest saved state, as a launcher restarts a job after a
failure. Every 10 s the driver samples the server's and its workers' PSS and USS, the server's open file
descriptors and threads, the bytes of this server's segments in /dev/shm, and the ranks' data wait (from
``status``), sampling before a due restart, never in the moment after one. After a warm-up (the first run, in
which every bounded cache fills for the first time; without restarts, the first fifth and at least 60 s) it fits a
line to each series over whole runs and reports the growth per hour; a PNG plot goes to bench/out/soak.png.

Targets: server PSS growth under 2 % per hour after warm-up in the 30-minute run; fds and /dev/shm flat.
The last line is one JSON object (``pss_growth_pct_per_hour``, ``fd_growth``, ``shm_growth_bytes``, ...);
the series goes to bench/out/soak_series.json.

Reading the figures: PSS splits each shared-library page over every process mapping it, so the server's file
share (``Pss_File``, about a fifth of its PSS) moves whenever ranks, workers or unrelated processes on the
machine start and stop, by megabytes and in steps. The anonymous part (``Pss_Anon``) is the server's own
memory: a leak shows there. Each growth is given twice: the least-squares slope, and the Theil-Sen slope (the
median of the slopes between every two samples), which a few steps of the file share cannot tilt.
"""

from __future__ import annotations

import argparse
import json
import os
import secrets
import shutil
import signal
import subprocess
import sys
import tempfile
import textwrap
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))

from progress import bar, say  # noqa: E402

from msdata_client.wire import request  # noqa: E402

JOB = ROOT / "examples" / "demo_job.toml"
OUT = ROOT / "bench" / "out"

RANK = textwrap.dedent("""\
    import json, os, sys, time
    import msdata_client as msd
    job, ep, rank, statefile = sys.argv[1], sys.argv[2], int(sys.argv[3]), sys.argv[4]
    mix_every, save_every = float(sys.argv[5]), int(sys.argv[6])
    spec = msd.DGraph.from_toml(job).plan()
    mixes = [{"chat": 0.3, "web": 0.5, "code": 0.2}, {"chat": 0.5, "web": 0.3, "code": 0.2}]
    with msd.DataClient(spec, endpoint=ep, rank=rank, world_size=spec.mesh.world_size, connect_timeout=120) as dc:
        if os.path.exists(statefile):
            with open(statefile) as f:
                dc.load_state_dict(json.load(f))
        last_mix, n = time.monotonic(), 0
        while True:
            b = next(dc)
            del b
            n += 1
            if rank == 0 and time.monotonic() - last_mix > mix_every:
                last_mix = time.monotonic()
                dc.set_mixture(mixes[int(last_mix // mix_every) % 2])
            if rank == 0 and n % (save_every * spec.micro_batches) == 0:
                tmp = statefile + ".tmp"
                with open(tmp, "w") as f:
                    json.dump(dc.state_dict(), f)
                os.replace(tmp, statefile)
    """)


def smaps(pid: int) -> dict[str, int]:
    out = {}
    for ln in Path(f"/proc/{pid}/smaps_rollup").read_text().splitlines()[1:]:
        k, v = ln.split(":", 1)
        out[k] = int(v.split()[0]) * 1024
    return out


def children(pid: int) -> list[int]:
    """Every descendant of pid (the pool's forkserver and its workers), from the parent ids in /proc."""
    parent: dict[int, int] = {}
    for d in Path("/proc").iterdir():
        if d.name.isdigit():
            try:
                parent[int(d.name)] = int((d / "stat").read_text().rsplit(")", 1)[1].split()[1])
            except (OSError, IndexError, ValueError):
                continue
    out, todo = [], [pid]
    while todo:
        p = todo.pop()
        kids = [c for c, pp in parent.items() if pp == p]
        out += kids
        todo += kids
    return out


def sample(server: subprocess.Popen, prefix: str, socket: str) -> dict:
    pid = server.pid
    me = smaps(pid)
    workers = [smaps(k) for k in children(pid) if Path(f"/proc/{k}").exists()]
    threads = int(
        next(ln.split()[1] for ln in Path(f"/proc/{pid}/status").read_text().splitlines() if ln.startswith("Threads:"))
    )
    shm = sum(p.stat().st_size for p in Path("/dev/shm").glob(f"{prefix}*"))
    wait = None
    try:
        st = request(socket, {"t": "status"}, timeout=30)["status"]
        jobs = st.get("jobs") or []
        if jobs:
            det = jobs[0].get("ranks_detail") or {}
            fr = [d.get("wait_frac") for d in det.values() if d.get("wait_frac") is not None]
            wait = max(fr) if fr else None
    except OSError:
        pass
    return {
        "pss": me.get("Pss", 0),
        "pss_anon": me.get("Pss_Anon", 0),  # what the server allocated, without shared library pages
        "pss_file": me.get("Pss_File", 0),  # its share of the library pages: moves with other processes
        "uss": me.get("Private_Clean", 0) + me.get("Private_Dirty", 0),
        "workers_pss": sum(w.get("Pss", 0) for w in workers),
        "fds": len(os.listdir(f"/proc/{pid}/fd")),
        "threads": threads,
        "shm": shm,
        "wait_frac": wait,
    }


def slope_per_hour(ts: list[float], ys: list[float]) -> float:
    """Least-squares slope of ys over ts (seconds), per hour."""
    n = len(ts)
    if n < 2:
        return 0.0
    mt, my = sum(ts) / n, sum(ys) / n
    var = sum((t - mt) ** 2 for t in ts)
    return 3600 * sum((t - mt) * (y - my) for t, y in zip(ts, ys)) / var if var else 0.0


def robust_slope_per_hour(ts: list[float], ys: list[float]) -> float:
    """Theil-Sen slope of ys over ts (seconds), per hour: the median of the slopes between every two samples."""
    slopes = sorted((ys[j] - ys[i]) / (ts[j] - ts[i]) for i in range(len(ts)) for j in range(i + 1, len(ts)))
    if not slopes:
        return 0.0
    mid = len(slopes) // 2
    return 3600 * (slopes[mid] if len(slopes) % 2 else (slopes[mid - 1] + slopes[mid]) / 2)


def plot(rows: list[dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    t = [r["t"] / 60 for r in rows]
    fig, ax = plt.subplots(2, 2, figsize=(9, 5.5))
    ax[0][0].plot(t, [r["pss"] / 2**20 for r in rows], label="server PSS")
    ax[0][0].plot(t, [r["pss_anon"] / 2**20 for r in rows], label="server PSS, anonymous")
    ax[0][0].plot(t, [r["pss_file"] / 2**20 for r in rows], label="server PSS, library pages")
    ax[0][0].plot(t, [r["workers_pss"] / 2**20 for r in rows], label="workers PSS")
    ax[0][0].set_ylabel("MiB")
    ax[0][0].legend(fontsize=7)
    ax[0][1].plot(t, [r["fds"] for r in rows], label="fds")
    ax[0][1].plot(t, [r["threads"] for r in rows], label="threads")
    ax[0][1].legend(fontsize=7)
    ax[1][0].plot(t, [r["shm"] / 2**20 for r in rows])
    ax[1][0].set_ylabel("/dev/shm MiB")
    ax[1][1].plot(t, [r["wait_frac"] if r["wait_frac"] is not None else float("nan") for r in rows])
    ax[1][1].set_ylabel("max rank data-wait fraction")
    for a in ax.flat:
        a.set_xlabel("minutes")
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=80)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--minutes", type=float, default=30.0)
    ap.add_argument("--quick", action="store_true", help="3 minutes")
    ap.add_argument("--every", type=float, default=10.0, help="seconds between samples")
    ap.add_argument("--mix-every", type=float, default=60.0)
    ap.add_argument("--restart-every", type=float, default=300.0)
    ap.add_argument("--save-every", type=int, default=200, help="steps between rank 0's saved states")
    ap.add_argument("--out", default=str(OUT), help="folder of the series and the plot")
    ap.add_argument("--smoke", action="store_true", help="seconds: 12 s, mixture changes, 2 restarts, a temp --out")
    args = ap.parse_args()
    if args.smoke:
        args.minutes, args.quick, args.every, args.mix_every, args.restart_every, args.save_every = (
            0.2,
            False,
            1,
            1.5,
            4,
            20,
        )
    # a soak stopped with SIGTERM (kill, a CI timeout) still stops its ranks and server (the finally below)
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    minutes = 3.0 if args.quick else args.minutes
    base = Path(tempfile.mkdtemp(prefix="mssoak-", dir="/tmp"))
    prefix = "sk" + secrets.token_hex(3)
    sock = str(base / "msdata.sock")
    cfg = base / "node.toml"
    cfg.write_text(
        textwrap.dedent(f"""\
        [node]
        id = "soak"
        socket = "{sock}"
        shm_prefix = "{prefix}"
        workers = 2
        state_dir = "{base / "state"}"
        """)
    )
    statefile = str(base / "rank0-state.json")
    log = open(base / "server.log", "ab")  # noqa: SIM115  (the server's log: open while it runs, closed when it stops)
    server = subprocess.Popen(
        [sys.executable, "-m", "msdata_server", "serve", "--config", str(cfg)],
        stdout=subprocess.PIPE,
        stderr=log,
        cwd=str(ROOT),
    )
    if not server.stdout.readline():
        raise SystemExit(f"the server did not start; see {base / 'server.log'}")

    def start_ranks() -> list[subprocess.Popen]:
        return [
            subprocess.Popen(
                [
                    sys.executable,
                    "-c",
                    RANK,
                    str(JOB),
                    sock,
                    str(r),
                    statefile,
                    str(args.mix_every),
                    str(args.save_every),
                ],
                stderr=log,
                cwd=str(ROOT),
            )
            for r in range(2)
        ]

    ranks = start_ranks()
    rows: list[dict] = []
    restarts = 0
    t0 = time.monotonic()
    last_restart = t0
    total = minutes * 60
    prog = bar(int(total), "soak", "s")
    try:
        while (now := time.monotonic()) - t0 < total:
            time.sleep(args.every)  # the sampling period
            if any(p.poll() is not None for p in ranks) and now - last_restart > 5:
                raise SystemExit(f"a rank exited on its own; see {base / 'server.log'}")
            # sample before a due restart: right after one, the ranks are gone and the server's share of the
            # library pages they mapped jumps for a moment (each such sample was ~3 MiB high in PSS)
            rows.append({"t": time.monotonic() - t0, "run": restarts, **sample(server, prefix, sock)})
            last = time.monotonic() - t0 + args.every >= total
            if time.monotonic() - last_restart > args.restart_every and not last:
                for p in ranks:
                    p.send_signal(signal.SIGKILL)
                    p.wait()
                ranks = start_ranks()
                restarts += 1
                last_restart = time.monotonic()
            prog.update(int(args.every))
            if not sys.stdout.isatty() and len(rows) % 6 == 0:  # a log line a minute
                r = rows[-1]
                say(
                    f"{r['t'] / 60:5.1f} min  PSS {r['pss'] / 2**20:6.1f} MiB  fds {r['fds']}  "
                    f"shm {r['shm'] / 2**20:.1f} MiB"
                )
    finally:
        prog.close()
        for p in ranks:
            if p.poll() is None:
                p.kill()
            p.wait()
        server.terminate()
        server.wait(60)
        server.stdout.close()
        log.close()
        left = list(Path("/dev/shm").glob(f"{prefix}*"))
        shutil.rmtree(base, ignore_errors=True)
    # with restarts, warm-up is the first run: every bounded cache fills for the first time there. The fit then covers
    # whole runs only; memory rises within a run and drops when it closes, and a window cut mid-run tilts the slope.
    steady = [r for r in rows if r["run"] >= 1] if restarts else [r for r in rows if r["t"] >= max(60.0, total / 5)]
    ts = [r["t"] for r in steady]

    def growth(key: str, fit=slope_per_hour) -> float:
        ys = [r[key] for r in steady]
        return fit(ts, ys) if ys else 0.0

    def pct(key: str, fit=slope_per_hour) -> float | None:
        """Growth per hour as a percentage of the server's mean PSS (one denominator: the parts add up)."""
        return round(100 * growth(key, fit) / mean_pss, 2) if mean_pss else None

    mean_pss = sum(r["pss"] for r in steady) / max(len(steady), 1)
    out = {
        "minutes": minutes,
        "samples": len(rows),
        "restarts": restarts,
        "pss_growth_pct_per_hour": pct("pss"),
        "pss_growth_robust_pct_per_hour": pct("pss", robust_slope_per_hour),
        "pss_anon_growth_pct_per_hour": pct("pss_anon"),
        "pss_anon_growth_robust_pct_per_hour": pct("pss_anon", robust_slope_per_hour),
        "pss_file_mib_range": [
            round(min(r["pss_file"] for r in steady) / 2**20, 1),
            round(max(r["pss_file"] for r in steady) / 2**20, 1),
        ]
        if steady
        else None,
        "uss_growth_pct_per_hour": round(100 * growth("uss") / max(1, sum(r["uss"] for r in steady) / len(steady)), 2)
        if steady
        else None,
        "workers_pss_growth_mib_per_hour": round(growth("workers_pss") / 2**20, 2),
        "pss_warm_mib": round(steady[0]["pss"] / 2**20, 1) if steady else None,
        "pss_end_mib": round(steady[-1]["pss"] / 2**20, 1) if steady else None,
        "fd_growth": (steady[-1]["fds"] - steady[0]["fds"]) if steady else None,
        "threads_growth": (steady[-1]["threads"] - steady[0]["threads"]) if steady else None,
        "shm_growth_bytes": (steady[-1]["shm"] - steady[0]["shm"]) if steady else None,
        "max_wait_frac": max((r["wait_frac"] for r in steady if r["wait_frac"] is not None), default=None),
        "shm_left_after_stop": len(left),
    }
    if rows:
        out_dir = Path(tempfile.mkdtemp(prefix="mssoak-out-")) if args.smoke else Path(args.out)
        out_dir.mkdir(parents=True, exist_ok=True)
        (out_dir / "soak_series.json").write_text(json.dumps(rows))
        plot(rows, out_dir / "soak.png")
        print(f"plot: {out_dir / 'soak.png'}")
        if args.smoke:  # drawn (the code path runs), then dropped
            shutil.rmtree(out_dir)
    print(json.dumps(out))


if __name__ == "__main__":
    main()
