# .venv/bin/python bench/suite.py --quick          (make bench; one benchmark: --only balance; plots only: --plot-only)
"""Benchmark suite: runs every benchmark in bench/, keeps each one's last-line JSON in bench/results/<name>.json
and draws the PNG plots of the README from those files (matplotlib, Agg).

A benchmark that is not in bench/ yet is skipped; one that fails is reported and the others still run (the
exit status is then 1). Plots are drawn from whatever JSON files the results folder holds, so --plot-only
redraws them after a single benchmark was rerun. The last line is one JSON object: what ran, what failed,
which files were written.
"""

from __future__ import annotations

import argparse
import json
import shlex
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
RESULTS = HERE / "results"
# in the order they run: the quick ones first, the long soak-like ones last
BENCHES = (
    "balance",
    "statebytes",
    "vlm",
    "transport",
    "resume",
    "memory",
    "cluster",
    "train_e2e",
    "memgrowth",
    "soak",
    "autoscale",
    "chaos",
    "lineage",
    "order",
    "tls",
    "tokenize",
    "remote",
    "scale",
)
MICRO_DUMP = "train_e2e_micro.json"  # predicted vs measured seconds per micro-batch (the cost-model plot)


def last_json(text: str) -> dict | None:
    """The last line of `text` that parses as a JSON object."""
    for line in reversed(text.strip().splitlines()):
        line = line.strip()
        if line.startswith("{"):
            try:
                got = json.loads(line)
            except json.JSONDecodeError:
                continue
            if isinstance(got, dict):
                return got
    return None


def run_bench(name: str, *, quick: bool, extra: list[str], results: Path, timeout: float, smoke: bool = False) -> dict:
    """Run bench/<name>.py, stream its output, store its JSON; a record of the run (never raises)."""
    mode = ["--smoke"] if smoke else ["--quick"] if quick else []
    cmd = [sys.executable, str(HERE / f"{name}.py"), *mode, *extra]
    dump = None
    if name == "train_e2e" and "--dump" not in extra:
        dump = Path(tempfile.mkstemp(prefix="msdata-e2e-", suffix=".json")[1])
        cmd += ["--dump", str(dump)]
    print(f"== {name}: {shlex.join(cmd)}", flush=True)
    t0 = time.perf_counter()
    lines: list[str] = []
    try:
        proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, cwd=HERE.parent)

        def pump() -> None:  # echo the benchmark's output as it comes, and keep it
            assert proc.stdout is not None
            for line in proc.stdout:
                print(f"   {line}", end="", flush=True)
                lines.append(line)

        reader = threading.Thread(target=pump, daemon=True)
        reader.start()
        try:
            rc = proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            proc.kill()
            rc = proc.wait()
            lines.append(f"(killed after {timeout:g} s)\n")
        reader.join(10)
        shown = ["python", f"bench/{name}.py", *(["--quick"] if quick else []), *extra]  # no machine paths
        rec = {"command": shlex.join(shown), "rc": rc, "seconds": round(time.perf_counter() - t0, 1)}
        got = last_json("".join(lines))
        if rc == 0 and got is not None:
            (results / f"{name}.json").write_text(json.dumps(got, indent=1, sort_keys=True) + "\n")
            rec["json"] = f"{name}.json"
            if dump is not None and dump.stat().st_size:
                micro = json.loads(dump.read_text())
                pairs = [[round(r["pred"], 5), round(r["cpu"], 5), r["seq_len"]] for r in micro]
                (results / MICRO_DUMP).write_text(json.dumps({"pred_cpu_seq_len": pairs}) + "\n")
        else:
            rec["error"] = f"exit status {rc}" if rc else "no JSON object on the last lines"
        return rec
    finally:
        if dump is not None:
            dump.unlink(missing_ok=True)


# -- plots ------------------------------------------------------------------------------------------------


def _load(results: Path, name: str) -> dict | None:
    p = results / f"{name}.json"
    return json.loads(p.read_text()) if p.exists() else None


def _save(fig, path: Path, written: list[str]) -> None:
    fig.tight_layout()
    fig.savefig(path, dpi=80)
    import matplotlib.pyplot as plt

    plt.close(fig)
    written.append(path.name)


def _keys(d: dict, prefix: str) -> dict[tuple[int, int], float]:
    """{(context k, dp): value} of keys like f"{prefix}_16k_dp64"."""
    out = {}
    for k, v in d.items():
        if k.startswith(prefix + "_") and isinstance(v, (int, float)):
            rest = k[len(prefix) + 1 :]
            if rest.count("_dp") == 1 and rest.split("_dp")[0].endswith("k"):
                ctx, dp = rest.split("_dp")
                if ctx[:-1].isdigit() and dp.isdigit():
                    out[(int(ctx[:-1]), int(dp))] = float(v)
    return out


def plot_gain(results: Path, written: list[str]) -> None:
    """Throughput gain over per-rank packing vs context length: the cost model (balance) and measured (train_e2e)."""
    import matplotlib.pyplot as plt

    bal, e2e = _load(results, "balance") or {}, _load(results, "train_e2e") or {}
    model, measured, pred = _keys(bal, "gain"), _keys(e2e, "e2e_gain"), _keys(e2e, "predicted_gain")
    if not (model or measured):
        return
    fig, ax = plt.subplots(figsize=(5.2, 3.4))
    dps = sorted({dp for _, dp in [*model, *measured]})
    colors = {dp: f"C{i}" for i, dp in enumerate(dps)}
    for dp in dps:
        for series, style, label in (
            (model, "-o", "cost model"),
            (pred, ":^", "cost model, e2e steps"),
            (measured, "--s", "measured fwd+bwd"),
        ):
            pts = sorted((k, v) for (k, d), v in series.items() if d == dp)
            if pts:
                ax.plot(
                    [k for k, _ in pts],
                    [v for _, v in pts],
                    style,
                    color=colors[dp],
                    ms=4,
                    label=f"dp {dp}, {label}",
                    mfc="none" if series is pred else None,
                )
    ax.set_xscale("log", base=2)
    ctx = sorted({k for k, _ in [*model, *measured]})
    ax.set_xticks(ctx, [f"{k}k" for k in ctx])
    ax.axhline(1.0, color="grey", lw=0.6)
    ax.set_xlabel("context length")
    ax.set_ylabel("throughput gain vs per-rank packing")
    ax.legend(fontsize=6, ncol=2)
    _save(fig, results / "gain.png", written)


def plot_vlm(results: Path, written: list[str]) -> None:
    """The vlm4 workload: gain of the two-stage (encoder + backbone) balance vs context length, per dp."""
    import matplotlib.pyplot as plt

    gain = _keys(_load(results, "vlm") or {}, "gain_vlm")
    if not gain:
        return
    fig, ax = plt.subplots(figsize=(4.2, 3.2))
    for i, dp in enumerate(sorted({dp for _, dp in gain})):
        pts = sorted((k, v) for (k, d), v in gain.items() if d == dp)
        ax.plot([k for k, _ in pts], [v for _, v in pts], "-o", ms=4, color=f"C{i}", label=f"dp {dp}")
    ctx = sorted({k for k, _ in gain})
    ax.set_xscale("log", base=2)
    ax.set_xticks(ctx, [f"{k}k" for k in ctx])
    ax.axhline(1.0, color="grey", lw=0.6)
    ax.set_xlabel("context length")
    ax.set_ylabel("gain vs per-rank packing (cost model)")
    ax.set_title("vlm4: vision encoder + backbone", fontsize=8)
    ax.legend(fontsize=7)
    _save(fig, results / "vlm_gain.png", written)


def plot_cost_model(results: Path, written: list[str]) -> None:
    """Predicted (calibrated alpha, beta) against measured seconds per micro-batch."""
    import matplotlib.pyplot as plt

    p = results / MICRO_DUMP
    if not p.exists():
        return
    rows = json.loads(p.read_text())["pred_cpu_seq_len"]
    e2e = _load(results, "train_e2e") or {}
    fig, ax = plt.subplots(figsize=(4.2, 3.4))
    for i, s in enumerate(sorted({r[2] for r in rows})):
        pts = [r for r in rows if r[2] == s]
        ax.scatter([r[0] for r in pts], [r[1] for r in pts], s=6, color=f"C{i}", label=f"{s // 1024}k")
    top = max(max(r[0], r[1]) for r in rows)
    ax.plot([0, top], [0, top], color="grey", lw=0.6)
    r2 = e2e.get("cost_model_r2")
    ax.set_title(f"cost model vs measured, R^2 {r2}" if r2 is not None else "cost model vs measured", fontsize=9)
    ax.set_xlabel("predicted s (alpha L^2 + beta L)")
    ax.set_ylabel("measured CPU s, fwd+bwd")
    ax.legend(fontsize=7, title="context", title_fontsize=7)
    _save(fig, results / "cost_model.png", written)


def plot_planning(results: Path, written: list[str]) -> None:
    """Planner compute per step vs dp (balance: per-step medians; cluster: the planner-load run)."""
    import matplotlib.pyplot as plt

    series = {}
    for name in ("balance", "cluster"):
        d = _load(results, name) or {}
        pts = sorted(
            (int(k[len("plan_ms_dp") :]), float(v))
            for k, v in d.items()
            if k.startswith("plan_ms_dp") and k[len("plan_ms_dp") :].isdigit()
        )
        if pts:
            series[name] = pts
    if not series:
        return
    fig, ax = plt.subplots(figsize=(4.2, 3.2))
    for name, pts in series.items():
        ax.plot([p[0] for p in pts], [p[1] for p in pts], "-o", ms=4, label=f"bench/{name}.py")
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    dps = sorted({p[0] for pts in series.values() for p in pts})
    ax.set_xticks(dps, [str(d) for d in dps])
    ax.set_xlabel("dp (ranks planned per step)")
    ax.set_ylabel("planning ms per step")
    ax.legend(fontsize=7)
    _save(fig, results / "planning.png", written)


def plot_memory(results: Path, written: list[str]) -> None:
    """Loader memory vs number of sources, and vs ranks x workers at 64 sources."""
    import matplotlib.pyplot as plt

    d = _load(results, "memory")
    if not d or not d.get("rows"):
        return
    rows, R = d["rows"], d.get("R")
    by_s = sorted((r for r in rows if r.get("R") == R), key=lambda r: r["S"])
    by_rw = sorted((r for r in rows if r.get("S") == 64), key=lambda r: r["R"])
    panels = [(by_s, "S", "sources", f"R={R} ranks")]
    if len(by_rw) >= 2:
        panels.append((by_rw, "RW", "ranks x DataLoader workers", "S=64 sources"))
    fig, axes = plt.subplots(1, len(panels), figsize=(3.4 * len(panels), 3.2), squeeze=False)
    for ax, (rs, key, label, title) in zip(axes[0], panels):
        x = [r["S"] if key == "S" else r["R"] * (r.get("W") or 1) for r in rs]
        for kind, style in (("baseline", "-o"), ("msdata", "-s")):
            y = [r.get(f"{kind}_mib") for r in rs]
            if any(v is not None for v in y):
                ax.plot(
                    [a for a, b in zip(x, y) if b is not None],
                    [b for b in y if b is not None],
                    style,
                    ms=4,
                    label="per-rank DataLoaders" if kind == "baseline" else "msdata server",
                )
        ax.set_xlabel(label)
        ax.set_ylabel("loader memory, MiB (PSS)")
        ax.set_title(title, fontsize=8)
        ax.set_ylim(bottom=0)
        ax.legend(fontsize=7)
    _save(fig, results / "memory.png", written)


SIZES = (("64k", "64kib", 64 * 1024), ("1m", "1mib", 1 << 20), ("16m", "16mib", 16 << 20))


def plot_transport(results: Path, written: list[str]) -> None:
    """Delivery vs batch size: GB/s per reader where the JSON has them, else the ratio to DataLoader."""
    import matplotlib.pyplot as plt

    d = _load(results, "transport")
    if not d:
        return
    fig, ax = plt.subplots(figsize=(4.2, 3.2))
    gbps = {arm: [(b, d.get(f"{arm}_gbps_{k}")) for _, k, b in SIZES] for arm in ("msdata", "torch")}
    if sum(v is not None for _, v in gbps["msdata"]) >= 2:  # absolute figures for several sizes
        for arm, label in (("msdata", "msdata ring"), ("torch", "DataLoader")):
            pts = [(b, v) for b, v in gbps[arm] if v is not None]
            if pts:
                ax.plot([p[0] for p in pts], [p[1] for p in pts], "-o", ms=4, label=label)
        if d.get("memcpy_gbps_64mib"):
            ax.axhline(d["memcpy_gbps_64mib"], color="grey", ls="--", lw=0.8, label="memcpy")
        ax.set_ylabel("GB/s per reader")
        ax.set_yscale("log")
    else:
        pts = [(b, d.get(f"ratio_vs_dataloader_{k}")) for _, k, b in SIZES]
        pts2 = [(b, d.get(f"ratio_vs_dataloader_{k}_2readers")) for _, k, b in SIZES]
        for p, label in ((pts, "1 reader"), (pts2, "2 readers (TP pair)")):
            p = [x for x in p if x[1] is not None]
            if p:
                ax.plot([x[0] for x in p], [x[1] for x in p], "-o", ms=4, label=label)
        ax.axhline(1.0, color="grey", lw=0.6)
        ax.set_ylabel("msdata GB/s / DataLoader GB/s")
        ax.set_yscale("log")
        m16, mc = d.get("msdata_gbps_16mib"), d.get("memcpy_gbps_64mib")
        if m16 and mc:
            ax.set_title(f"16 MiB: msdata {m16:.1f} GB/s, memcpy {mc:.1f} GB/s", fontsize=8)
    ax.set_xscale("log", base=2)
    ax.set_xticks([b for _, _, b in SIZES], [s for s, _, _ in SIZES])
    ax.set_xlabel("micro-batch size")
    ax.legend(fontsize=7)
    _save(fig, results / "transport.png", written)


def plot_failover(results: Path, written: list[str]) -> None:
    """The leader is killed at 0: lease TTL, a new leader agreed, it plans, the ranks get batches."""
    import matplotlib.pyplot as plt

    d = _load(results, "cluster")
    if not d or "failover_s" not in d:
        return
    events = [
        ("leader killed", 0.0),
        ("lease TTL", d.get("lease_ttl_s")),
        ("new leader agreed", d.get("failover_s")),
        ("new leader plans", d.get("failover_planned_s")),
        ("ranks get batches", d.get("failover_delivered_s")),
    ]
    events = [(n, float(t)) for n, t in events if isinstance(t, (int, float)) and t >= 0]
    fig, ax = plt.subplots(figsize=(5.2, 0.45 * len(events) + 0.9))
    for i, (n, t) in enumerate(events):
        y = len(events) - 1 - i
        ax.plot([0, t], [y, y], color=f"C{i}", lw=2)
        ax.plot([t], [y], "o", color=f"C{i}", ms=5)
        ax.annotate(f"{n}: {t:.2f} s", (t, y), xytext=(6, -3), textcoords="offset points", fontsize=7)
    ax.set_yticks([])
    ax.set_ylim(-0.7, len(events) - 0.3)
    ax.set_xlim(-0.1, max(t for _, t in events) * 1.6 + 0.5)
    ax.set_xlabel("seconds after the leader is SIGKILLed (3 node servers, etcd)")
    _save(fig, results / "failover.png", written)


def plot_traces(results: Path, written: list[str]) -> None:
    """Any list of records with a time or step column (autoscale, chaos...): one panel per numeric series."""
    import matplotlib.pyplot as plt

    for p in sorted(results.glob("*.json")):
        if p.name in (MICRO_DUMP, "suite.json"):
            continue
        d = json.loads(p.read_text())
        for key, val in d.items():
            if not (
                ("trace" in key or "timeline" in key)
                and isinstance(val, list)
                and val
                and all(isinstance(r, dict) for r in val)
            ):
                continue
            x = next((c for c in ("t", "time_s", "seconds", "step") if c in val[0]), None)
            cols = [c for c, v in val[0].items() if c != x and isinstance(v, (int, float)) and not isinstance(v, bool)]
            if x is None or not cols:
                continue
            cols = cols[:4]
            fig, axes = plt.subplots(len(cols), 1, figsize=(5.2, 1.3 * len(cols) + 0.6), sharex=True, squeeze=False)
            for ax, c in zip(axes[:, 0], cols):
                ax.plot([r.get(x) for r in val], [r.get(c) for r in val], lw=1)
                ax.set_ylabel(c, fontsize=7)
            axes[-1, 0].set_xlabel(x)
            axes[0, 0].set_title(f"{p.stem}: {key}", fontsize=8)
            _save(fig, results / f"{p.stem}_{key}.png", written)


def plot_scale(results: Path, written: list[str]) -> None:
    """The leader's bytes per step vs nodes (per-node slices, measured; every node the whole plan, as before),
    and the largest node's bytes per step (bench/scale.py, text4 sources)."""
    import matplotlib.pyplot as plt

    rows = sorted(
        (r for r in (_load(results, "scale") or {}).get("cases", []) if r.get("sources") == 4), key=lambda r: r["nodes"]
    )
    if not rows:
        return
    n = [r["nodes"] for r in rows]
    fig, ax = plt.subplots(figsize=(4.6, 3.3))
    ax.plot(n, [r["leader_bytes_per_step"] / 1e6 for r in rows], "-o", ms=4, label="leader, slices (measured)")
    ax.plot(n, [r["plan_bytes"] * r["nodes"] / 1e6 for r in rows], "--", label="leader, whole plan to every node")
    ax.plot(n, [r["node_bytes_max"] / 1e6 for r in rows], "-s", ms=4, label="largest node (measured)")
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ax.set_xticks(n, [f"{x}\n(dp {r['dp']})" for x, r in zip(n, rows)])
    ax.set_xlabel("nodes (8 ranks each)")
    ax.set_ylabel("MB per step")
    ax.legend(fontsize=7)
    _save(fig, results / "scale.png", written)


PLOTS = (
    plot_gain,
    plot_vlm,
    plot_cost_model,
    plot_planning,
    plot_memory,
    plot_transport,
    plot_failover,
    plot_traces,
    plot_scale,
)


def draw(results: Path) -> list[str]:
    import matplotlib

    matplotlib.use("Agg")
    written: list[str] = []
    for fn in PLOTS:
        fn(results, written)
    return written


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="pass --quick to every benchmark")
    ap.add_argument(
        "--smoke",
        action="store_true",
        help="pass --smoke to every benchmark (seconds each); results go to a temp folder, bench/results/ untouched",
    )
    ap.add_argument("--only", action="append", default=None, help="run only this benchmark (repeatable)")
    ap.add_argument(
        "--args",
        action="append",
        default=[],
        metavar="NAME=ARGS",
        help="extra arguments for one benchmark, e.g. 'balance=--steps 1 --dp 8'",
    )
    ap.add_argument("--results", default=str(RESULTS), help="folder for the JSON files and plots")
    ap.add_argument("--plot-only", action="store_true", help="draw the plots from the JSON files already there")
    ap.add_argument("--timeout", type=float, default=900.0, help="seconds one benchmark may take")
    args = ap.parse_args(argv)
    if args.smoke and args.results == str(RESULTS):
        args.results = tempfile.mkdtemp(prefix="msdata-bench-smoke-")  # a smoke's figures are not results
    results = Path(args.results)
    results.mkdir(parents=True, exist_ok=True)
    extra: dict[str, list[str]] = {}
    for item in args.args:
        name, _, rest = item.partition("=")
        extra[name] = shlex.split(rest)
    unknown = sorted(set(args.only or ()) - set(BENCHES))
    if unknown:
        ap.error(f"--only {unknown}: the benchmarks are {list(BENCHES)}")
    ran, failed, skipped = [], [], []
    records: dict[str, dict] = {}
    if not args.plot_only:
        for name in args.only or BENCHES:
            if not (HERE / f"{name}.py").exists():
                skipped.append(name)
                continue
            rec = run_bench(
                name,
                quick=args.quick,
                smoke=args.smoke,
                extra=extra.get(name, []),
                results=results,
                timeout=args.timeout,
            )
            records[name] = rec
            (failed if "error" in rec else ran).append(name)
        suite = results / "suite.json"
        old = json.loads(suite.read_text()) if suite.exists() else {}
        old.update(records)
        suite.write_text(json.dumps(old, indent=1, sort_keys=True) + "\n")
    plots = draw(results)
    for name in failed:
        print(f"FAILED {name}: {records[name]['error']} ({records[name]['command']})")
    print(
        json.dumps(
            {
                "ran": ran,
                "failed": failed,
                "skipped": skipped,
                "json": [f"{n}.json" for n in ran],
                "plots": plots,
                "results": str(results),
            }
        )
    )
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
