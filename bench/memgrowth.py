# .venv/bin/python bench/memgrowth.py --quick                 (30k steps; A/B: --baseline REV; soak: --minutes 30)
"""Server memory over a long run (issue 16): does the node server's private memory stay flat at full rate?

The demo's job (examples/demo_job.toml: three synthetic sources, dp 2, seq_len 2048, documents up to 16k
tokens, so long ones are split into pieces that the planner may spread over steps) is served to two ranks
that only iterate, as fast as they can. Every few seconds the driver reads the server's USS (private memory,
/proc/PID/smaps_rollup) and the job's step. Reported: USS at step ~2k (after warm-up) and at the end, the
growth per 10k steps, and, for a timed soak, the growth after warm-up in percent.

``--baseline REV`` runs a server from that git revision (a temporary worktree) side by side, in the same
process tree and at the same time, with its own two ranks: both arms see the same machine noise, and the
growth of each is quoted with the ratio. The driver imports msdata_client only (for the status request).
The last line is one JSON object.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import secrets
import shutil
import subprocess
import sys
import tempfile
import textwrap
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from progress import bar, say  # noqa: E402

from msdata_client.wire import request  # noqa: E402

JOB = ROOT / "examples" / "demo_job.toml"
WARM_STEP = 2000  # the first sample at or past this step is the reference (read-ahead and rings are full)

RANK = textwrap.dedent("""\
    import sys, time
    import msdata_client as msd
    job, ep, rank, steps, deadline = sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4]), float(sys.argv[5])
    spec = msd.DGraph.from_toml(job).plan()
    with msd.DataClient(spec, endpoint=ep, rank=rank, world_size=spec.mesh.world_size) as dc:
        for i in range(steps * spec.micro_batches):
            b = next(dc)
            del b
            if i % 256 == 0 and time.time() > deadline:
                break
    """)


def uss(pid: int) -> int:
    """Private memory of one process (bytes), from smaps_rollup."""
    lines = Path(f"/proc/{pid}/smaps_rollup").read_text().splitlines()[1:]
    fields = {ln.split(":")[0]: int(ln.split()[1]) for ln in lines}
    return (fields.get("Private_Clean", 0) + fields.get("Private_Dirty", 0)) * 1024


class Arm:
    """One server (from a source tree) and its two ranks."""

    def __init__(self, name: str, tree: Path, base: Path, steps: int, deadline: float):
        self.name, self.tree = name, tree
        self.dir = base / name
        self.dir.mkdir()
        self.socket = str(self.dir / "msdata.sock")
        cfg = self.dir / "node.toml"
        cfg.write_text(
            textwrap.dedent(f"""\
            [node]
            id = "{re.sub(r"[^A-Za-z0-9_.-]", "_", name)}"
            socket = "{self.socket}"
            shm_prefix = "mg{secrets.token_hex(3)}"
            workers = 2
            state_dir = "{self.dir / "state"}"
            """)
        )
        env = dict(os.environ, PYTHONUNBUFFERED="1", PYTHONPATH=str(tree))
        self.log = open(self.dir / "server.log", "ab")  # noqa: SIM115  (the server's log: open while it runs, closed when it stops)
        self.server = subprocess.Popen(
            [sys.executable, "-m", "msdata_server", "serve", "--config", str(cfg)],
            stdout=subprocess.PIPE,
            stderr=self.log,
            env=env,
            cwd=str(tree),
        )
        line = self.server.stdout.readline()
        if not line:
            # the run's directory is removed on the way out: quote the log's end, not its path
            tail = (self.dir / "server.log").read_text(errors="replace").strip().splitlines()[-5:]
            raise SystemExit(f"{name}: the server did not start:\n" + "\n".join(tail))
        self.ranks = [
            subprocess.Popen(
                [sys.executable, "-c", RANK, str(JOB), self.socket, str(r), str(steps), str(deadline)],
                stderr=self.log,
                cwd=str(ROOT),
            )
            for r in range(2)
        ]
        self.samples: list[tuple[float, int, int]] = []  # (seconds, step, server USS bytes)

    def sample(self, t0: float) -> None:
        try:
            st = request(self.socket, {"t": "status"}, timeout=30)["status"]
        except OSError:
            return
        jobs = st.get("jobs") or []
        if jobs:
            self.samples.append((time.monotonic() - t0, int(jobs[0]["steps_planned"]), uss(self.server.pid)))

    def running(self) -> bool:
        return any(p.poll() is None for p in self.ranks)

    def close(self) -> None:
        for p in self.ranks:
            if p.poll() is None:
                p.kill()
            p.wait()
        self.server.terminate()
        try:
            self.server.wait(30)
        except subprocess.TimeoutExpired:
            self.server.kill()
            self.server.wait()
        self.server.stdout.close()
        self.log.close()

    def report(self) -> dict:
        s = self.samples
        warm = next((x for x in s if x[1] >= WARM_STEP), s[0] if s else None)
        if warm is None or len(s) < 2:
            return {"arm": self.name, "samples": len(s)}
        end = s[-1]
        dsteps = max(end[1] - warm[1], 1)
        dt = max(end[0] - warm[0], 1e-9)
        return {
            "arm": self.name,
            "warm_step": warm[1],
            "uss_warm_mib": round(warm[2] / 2**20, 1),
            "end_step": end[1],
            "uss_end_mib": round(end[2] / 2**20, 1),
            "growth_kib_per_10k_steps": round((end[2] - warm[2]) / 1024 / dsteps * 1e4, 1),
            "growth_pct": round(100 * (end[2] - warm[2]) / warm[2], 2),
            "growth_pct_per_hour": round(100 * (end[2] - warm[2]) / warm[2] * 3600 / dt, 2),
            "steps_per_s": round((end[1] - warm[1]) / dt, 1),
            "seconds": round(end[0], 1),
        }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--steps", type=int, default=30000, help="steps per arm (default 30000)")
    ap.add_argument("--minutes", type=float, default=None, help="run this long instead (a soak)")
    ap.add_argument("--quick", action="store_true", help="30k steps (the default; kept for the bench suite)")
    ap.add_argument("--baseline", default=None, help="git revision to run side by side (e.g. HEAD~3)")
    ap.add_argument("--every", type=float, default=5.0, help="seconds between samples")
    ap.add_argument(
        "--smoke",
        action="store_true",
        help="seconds: 400 steps, both arms (the baseline from this tree unless --baseline)",
    )
    args = ap.parse_args()
    if args.smoke:
        args.steps, args.every, args.minutes = 400, 0.5, None
    steps = 10**9 if args.minutes else args.steps
    deadline = time.time() + (args.minutes * 60 if args.minutes else 10**9)
    base = Path(tempfile.mkdtemp(prefix="msmg-", dir="/tmp"))
    worktree = None
    arms: list[Arm] = []
    prog = bar(args.minutes * 60 if args.minutes else steps, "memgrowth", "s" if args.minutes else "step")
    try:
        trees = [("current", ROOT)]
        if args.baseline:
            worktree = base / "baseline-tree"
            subprocess.run(
                ["git", "-C", str(ROOT), "worktree", "add", "--detach", "-q", str(worktree), args.baseline], check=True
            )
            trees.insert(0, (f"baseline-{args.baseline}", worktree))
        elif args.smoke:  # the A/B side by side, without a git worktree: both arms from this tree
            trees.insert(0, ("baseline-smoke", ROOT))
        arms = [Arm(name, tree, base, steps, deadline) for name, tree in trees]
        t0 = time.monotonic()
        last_print = 0.0
        while any(a.running() for a in arms):
            time.sleep(args.every)  # a sampling period, not a synchronisation
            for a in arms:
                if a.running():
                    a.sample(t0)
            done = [a.samples[-1][1] for a in arms if a.samples]
            prog.update((time.monotonic() - t0 if args.minutes else min(done, default=0)) - prog.n)
            if not sys.stdout.isatty() and time.monotonic() - last_print > 60:  # a log line a minute
                last_print = time.monotonic()
                say(
                    "  ".join(
                        f"{a.name}: step {a.samples[-1][1]} USS {a.samples[-1][2] / 2**20:.1f} MiB"
                        for a in arms
                        if a.samples
                    )
                )
    finally:
        prog.close()
        for a in arms:
            a.close()
        if worktree is not None:
            subprocess.run(["git", "-C", str(ROOT), "worktree", "remove", "--force", str(worktree)], check=False)
        shutil.rmtree(base, ignore_errors=True)
    reports = [a.report() for a in arms]
    say(
        f"{'arm':<24} {'warm step':>9} {'USS MiB':>8} {'end step':>9} {'USS MiB':>8} {'KiB/10k steps':>13} "
        f"{'%/hour':>7}"
    )
    for r in reports:
        if "end_step" in r:
            say(
                f"{r['arm']:<24} {r['warm_step']:>9} {r['uss_warm_mib']:>8} {r['end_step']:>9} "
                f"{r['uss_end_mib']:>8} {r['growth_kib_per_10k_steps']:>13} {r['growth_pct_per_hour']:>7}"
            )
    out = {"arms": reports}
    cur = reports[-1]
    if "growth_pct" in cur:
        out.update(
            uss_growth_pct=cur["growth_pct"],
            uss_growth_pct_per_hour=cur["growth_pct_per_hour"],
            uss_growth_kib_per_10k_steps=cur["growth_kib_per_10k_steps"],
        )
    if len(reports) == 2 and "growth_kib_per_10k_steps" in reports[0]:
        out["baseline_growth_kib_per_10k_steps"] = reports[0]["growth_kib_per_10k_steps"]
    say(json.dumps(out))


if __name__ == "__main__":
    main()
