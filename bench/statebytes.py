# .venv/bin/python bench/statebytes.py --quick            (dp 4096, 24 steps; default 64 steps; --dp, --every)
"""Bytes of planner state written per step (issue 13): whole states (version 1) against bases + deltas.

The planner of workload text4 (bench/workloads.py) plans ``--steps`` steps at ``--dp`` (micro_batches 4, rows 1,
seq_len 8192); the state at the start of every step goes, side by side, through the version-1 encoding (the
state_dict as JSON, what state_dir and etcd held before) and through a real ``StateStore`` in a temp directory
(a base every ``--every`` steps, deltas between). Every stored step is loaded back and must equal the state it
saved (the run fails otherwise). Reported: bytes per step of both, their ratio, base and delta sizes, and the
encode time per step. The last line is one JSON object.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time

import orjson

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from workloads import COST, TEXT4, SyntheticLengths

from msdata_server.planner import Mixture, Planner, PlannerConfig
from msdata_server.planner.delta import decode
from msdata_server.statedir import StateStore


def _progress(total: int):
    if sys.stdout.isatty():
        from tqdm import tqdm

        return tqdm(total=total, desc="steps", leave=False)
    return None


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="24 steps")
    ap.add_argument("--steps", type=int, default=64)
    ap.add_argument("--dp", type=int, default=4096)
    ap.add_argument("--every", type=int, default=16, help="a base every N steps")
    ap.add_argument("--seq-len", type=int, default=8192)
    ap.add_argument("--smoke", action="store_true", help="seconds: tiny sizes, every code path (CI)")
    args = ap.parse_args()
    if args.smoke:  # bases and deltas both: two bases, deltas between
        args.steps, args.dp, args.every, args.seq_len = 6, 64, 3, 4096
    steps = args.steps if args.smoke else 24 if args.quick else args.steps
    cfg = PlannerConfig(
        sources=tuple(TEXT4.sources),
        seq_len=args.seq_len,
        dp=args.dp,
        micro_batches=4,
        rows=1,
        mixture=Mixture.constant(TEXT4.weights),
        alpha=COST["alpha"],
        beta=COST["beta"],
    )
    view = SyntheticLengths(TEXT4, args.seq_len, seed=0)
    planner = Planner(cfg)
    full_sizes: list[int] = []
    base_sizes: list[int] = []
    delta_sizes: list[int] = []
    states: dict[int, dict] = {}
    enc_ms: list[float] = []
    bar = _progress(steps)
    with tempfile.TemporaryDirectory(prefix="msd-statebytes-") as d:
        store = StateStore(d, "bench", "0" * 16, keep=steps + args.every, every=args.every)
        for _ in range(steps):
            step, state = planner.step, planner.state_dict()
            states[step] = state
            full_sizes.append(len(orjson.dumps(state)))
            was = store.bytes_written
            t = time.perf_counter()
            store.save(step, state)
            enc_ms.append((time.perf_counter() - t) * 1e3)
            size = store.bytes_written - was
            with open(os.path.join(store.dir, f"step-{step:012d}.msds"), "rb") as f:
                rec = decode(f.read(), "bench")
            (delta_sizes if rec.is_delta else base_sizes).append(size)
            planner.plan_step(view)
            if bar is not None:
                bar.update(1)
        if bar is not None:
            bar.close()
        written = store.bytes_written
        for step, state in states.items():  # every step loads back exactly (base + delta composed)
            got = store.load_at_or_before(step)
            if got is None or got[0] != step or orjson.dumps(got[1]) != orjson.dumps(state):
                raise SystemExit(f"step {step}: the stored state does not load back as saved")
    before = sum(full_sizes) / steps
    after = written / steps
    print(f"dp {args.dp}, {steps} steps, a base every {args.every} steps (all {steps} states load back exactly)")
    print(f"{'':24} {'bytes/step':>10}")
    print(f"{'whole states (v1)':24} {before:10.0f}")
    print(f"{'base + deltas':24} {after:10.0f}   ({before / after:.1f}x fewer)")
    print(
        f"base median {statistics.median(base_sizes):.0f} B, delta median {statistics.median(delta_sizes):.0f} B, "
        f"encode+write median {statistics.median(enc_ms):.2f} ms/step"
    )
    print(
        json.dumps(
            {
                "dp": args.dp,
                "steps": steps,
                "every": args.every,
                "bytes_per_step_full": round(before),
                "bytes_per_step_delta": round(after),
                "ratio": round(before / after, 2),
                "base_bytes_median": round(statistics.median(base_sizes)),
                "delta_bytes_median": round(statistics.median(delta_sizes)),
                "write_ms_median": round(statistics.median(enc_ms), 3),
                "exact": True,
            },
            sort_keys=True,
        )
    )


if __name__ == "__main__":
    main()
