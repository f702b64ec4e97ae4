# .venv/bin/python bench/lineage.py --quick
"""Lineage benchmark: the time to answer "which pieces made step t" by replay, beside the planner's own time for
one step of the same size, in the same process.

Workload text4 (bench/workloads.py, a copy of ../shared/workloads.toml) at 16k context, 4 micro-batches per rank,
dp 512 and dp 4096. The planner plans a run of steps and keeps the state at the start of every step, as the
server does (``LocalPlanFeed`` records each step's state before planning it). Then, for a step t:

- ``plan``: the planner's own time for one step (``Planner.plan_step``), the median over the planning run;
  and ``plan_step``: step t itself planned again from its state (lengths read afresh), alternating with the
  lineage answers below so both see the same load (0 back is that plus the rows);
- ``lineage 0back``: the server's answer when it holds the state of step t itself (every recent step):
  a Planner from that state, one replayed step, and the rows (``lineage.rows.plan_columns``: row offsets,
  files and rows from each source's deterministic order, sample ids) of all ranks;
- ``lineage 64back``: a step 64 steps before the newest, whose own state has left the server's newest ``BACK``
  states (``planner.history.StateHistory``, as the plan feeds keep them): the replay starts from the nearest state
  the history still keeps (a state every ``SPARSE_EVERY`` steps beyond its newest), found through
  ``StateHistory.window`` as the server finds it; the step is the worst case, ``SPARSE_EVERY - 1`` steps past one;
- ``lineage from 64``: the same step replayed from the state 64 steps before it (65 steps: a history that kept
  no thinned states; what ``64back`` measured before they were kept).

Times are CPU seconds of the one thread that plans or replays (``time.thread_time``), as bench/train_e2e.py
times compute: these 2-core machines are shared, and another process only ever adds wall time. Medians.
Sources are located through real ``sources.order.Order`` objects (64 files of 65536 rows per source), so the
rows cost what they cost on real files. Targets (issue 17): 0back <= 1.5 x plan, 64back <= 70 x plan (issue 30:
<= 40 x plan). The last line is one JSON object.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))

from workloads import COST, TEXT4, SyntheticLengths  # noqa: E402

from msdata_server.lineage.replay import replay  # noqa: E402
from msdata_server.lineage.rows import plan_columns  # noqa: E402
from msdata_server.planner import Mixture, Planner, PlannerConfig  # noqa: E402
from msdata_server.planner.history import SPARSE_EVERY, StateHistory  # noqa: E402
from msdata_server.sources.order import Order  # noqa: E402

SEQ, MICRO = 16384, 4
FILES, ROWS = 64, 65536
BACK = 64


class Orders:
    """``lineage.rows.Locate`` over one Order per source (files of ROWS rows)."""

    def __init__(self, names: tuple[str, ...]):
        self.orders = [Order.from_units(seed=0, name=n, units=[np.array([ROWS], np.int64)] * FILES) for n in names]

    def locate(self, source: int, ordinals: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        return self.orders[source].locate(ordinals)

    def files(self, source: int) -> list[str]:
        return [f"part-{i:05d}.parquet" for i in range(FILES)]


def config(dp: int) -> PlannerConfig:
    return PlannerConfig(
        sources=tuple(TEXT4.sources),
        seq_len=SEQ,
        dp=dp,
        micro_batches=MICRO,
        rows=1,
        mixture=Mixture.constant(TEXT4.weights),
        alpha=COST["alpha"],
        beta=COST["beta"],
    )


def lineage_ms(cfg: PlannerConfig, state: dict, step: int, locate: Orders) -> tuple[float, int]:
    """CPU ms to replay from ``state`` up to ``step`` and turn that step's plan into rows; and the rows. The
    lengths come from a fresh view (generated again, as the planner generated them: the server's lineage reads
    them again too)."""
    view = SyntheticLengths(TEXT4, SEQ, seed=0)
    t = time.thread_time()
    (plan,) = replay(cfg, state, view, step, step + 1)
    cols = plan_columns(plan, locate, seq_len=cfg.seq_len, micro_batches=cfg.micro_batches, rows=cfg.rows)
    return (time.thread_time() - t) * 1e3, int(cols["step"].size)


def plan_once(cfg: PlannerConfig, state: dict) -> float:
    """CPU ms of the planner's own step from ``state`` (fresh lengths, as ``lineage_ms`` reads them)."""
    view = SyntheticLengths(TEXT4, SEQ, seed=0)
    t = time.thread_time()
    Planner(cfg, state=state).plan_step(view)
    return (time.thread_time() - t) * 1e3


def measure(dp: int, *, target: int, every: int, reps: int, reps_back: int, progress) -> dict:
    """Plan up to BACK steps past ``target`` (a step ``every`` - 1 past a kept one), keeping every state (for the
    0-back and from-64 arms) and a StateHistory of the newest BACK as the server does; then the three answers."""
    cfg = config(dp)
    view = SyntheticLengths(TEXT4, SEQ, seed=0)
    locate = Orders(cfg.sources)
    planner = Planner(cfg)
    states: dict[int, dict] = {}
    history = StateHistory(BACK, every=every)
    walls = []
    for i in range(target + BACK + 1):
        states[planner.step] = planner.state_dict()
        history.record(planner.step, states[planner.step])
        t = time.thread_time()
        planner.plan_step(view)
        if i:  # the first step is warm-up
            walls.append((time.thread_time() - t) * 1e3)
        progress(f"dp {dp}: planned step {i}")
    found, _ = history.window(target, target + 1)  # (the window's held states: none, no mixture cut here)
    assert found is not None
    assert target not in history
    assert found[1] == states[found[0]]
    kept, kept_state = found
    lineage_ms(cfg, states[target], target, locate)  # warm-up (order caches)
    zero, same, rows = [], [], 0
    for _ in range(reps):  # the arms alternate: the same step, planned and answered under the same load
        same.append(plan_once(cfg, states[target]))
        ms, rows = lineage_ms(cfg, states[target], target, locate)
        zero.append(ms)
        progress(f"dp {dp}: lineage 0 back {ms:.0f} ms")
    back, far = [], []
    for _ in range(reps_back):
        ms, _ = lineage_ms(cfg, kept_state, target, locate)
        back.append(ms)
        progress(f"dp {dp}: lineage {BACK} back {ms:.0f} ms")
        if target >= BACK:
            ms, _ = lineage_ms(cfg, states[target - BACK], target, locate)
            far.append(ms)
            progress(f"dp {dp}: lineage from {BACK} back {ms:.0f} ms")
    return {
        "dp": dp,
        "plan_ms": statistics.median(walls),
        "plan_ms_step": statistics.median(same),
        "lineage_0back_ms": statistics.median(zero),
        "lineage_64back_ms": statistics.median(back),
        "lineage_from64_ms": statistics.median(far) if far else float("nan"),
        "replayed_64back": target - kept + 1,
        "kept_state_bytes": statistics.median(len(b) for b in history.sparse.values()),  # one thinned state
        "rows": rows,
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[1])
    ap.add_argument("--quick", action="store_true", help="fewer repetitions (under three minutes)")
    ap.add_argument("--smoke", action="store_true", help="seconds: tiny sizes, every code path (CI)")
    args = ap.parse_args()
    global BACK
    reps, reps_back = (5, 1) if args.quick else (9, 3)
    # the step asked about: SPARSE_EVERY - 1 past a kept state (the most replayed), and BACK or more from the start
    every = SPARSE_EVERY
    if args.smoke:  # both dps (the keys), a replay of a few steps instead of 64, a state every 2 kept
        reps, reps_back, BACK, every = 1, 1, 2, 2
    target = BACK + every - 1 - BACK % every
    bar = None
    if sys.stdout.isatty():
        from tqdm import tqdm

        bar = tqdm(desc="lineage", unit="step", leave=False)

    def progress(msg: str) -> None:
        if bar is not None:
            bar.set_postfix_str(msg)
            bar.update()

    res = {}
    for dp in (512, 4096):
        r = res[dp] = measure(dp, target=target, every=every, reps=reps, reps_back=reps_back, progress=progress)
        if bar is not None:
            bar.clear()
        print(
            f"dp {dp:5d} 16k: plan {r['plan_ms']:7.1f} ms/step (step t: {r['plan_ms_step']:.1f}) | lineage of one step "
            f"({r['rows']} rows): "
            f"0 back {r['lineage_0back_ms']:8.1f} ms ({r['lineage_0back_ms'] / r['plan_ms']:.2f} x plan), "
            f"{BACK} back {r['lineage_64back_ms']:9.1f} ms ({r['lineage_64back_ms'] / r['plan_ms']:.1f} x plan, "
            f"{r['replayed_64back']} steps replayed), from {BACK} back {r['lineage_from64_ms']:9.1f} ms "
            f"({r['lineage_from64_ms'] / r['plan_ms']:.1f} x plan); a thinned state kept: {r['kept_state_bytes']:.0f} B"
        )
    if bar is not None:
        bar.close()
    out = {}
    for dp, r in res.items():
        out[f"plan_ms_dp{dp}"] = round(r["plan_ms"], 2)
        out[f"plan_ms_step_dp{dp}"] = round(r["plan_ms_step"], 2)
        out[f"lineage_ms_dp{dp}_0back"] = round(r["lineage_0back_ms"], 2)
        out[f"lineage_ms_dp{dp}_64back"] = round(r["lineage_64back_ms"], 2)
        out[f"lineage_ms_dp{dp}_from64"] = round(r["lineage_from64_ms"], 2)
        out[f"replayed_dp{dp}_64back"] = r["replayed_64back"]
        out[f"kept_state_bytes_dp{dp}"] = r["kept_state_bytes"]
        out[f"rows_dp{dp}"] = r["rows"]
    out["back_steps"] = BACK
    out["ratio_0back_dp4096"] = round(res[4096]["lineage_0back_ms"] / res[4096]["plan_ms"], 3)
    out["ratio_64back_dp4096"] = round(res[4096]["lineage_64back_ms"] / res[4096]["plan_ms"], 2)
    out["ratio_from64_dp4096"] = round(res[4096]["lineage_from64_ms"] / res[4096]["plan_ms"], 2)
    out["ratio_0back_same_step_dp4096"] = round(res[4096]["lineage_0back_ms"] / res[4096]["plan_ms_step"], 3)
    print(json.dumps(out))


if __name__ == "__main__":
    main()
