"""bench/suite.py: a smoke run writes each benchmark's JSON, and every plot it claims, from the JSON files."""

import json
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("matplotlib")

ROOT = Path(__file__).resolve().parents[1]
SUITE = ROOT / "bench" / "suite.py"

# canned last lines, shaped like each benchmark's JSON
CANNED = {
    "balance": {
        "gain_4k_dp8": 1.3,
        "gain_16k_dp8": 1.5,
        "gain_4k_dp64": 1.4,
        "gain_16k_dp64": 2.1,
        "plan_ms_dp8": 2.0,
        "plan_ms_dp64": 9.0,
        "plan_ms_dp512": 60.0,
    },
    "train_e2e": {
        "e2e_gain_4k_dp8": 1.35,
        "e2e_gain_16k_dp8": 1.2,
        "e2e_gain_16k_dp64": 2.0,
        "predicted_gain_16k_dp64": 2.1,
        "cost_model_r2": 0.98,
    },
    "train_e2e_micro": {"pred_cpu_seq_len": [[0.1, 0.11, 4096], [0.5, 0.48, 16384], [1.2, 1.3, 16384]]},
    "cluster": {
        "failover_s": 3.1,
        "failover_planned_s": 3.3,
        "failover_delivered_s": 3.6,
        "lease_ttl_s": 3.0,
        "plan_ms_dp512": 55.0,
        "plan_ms_dp4096": 700.0,
    },
    "memory": {
        "R": 8,
        "W": 4,
        "rows": [
            {"S": 8, "R": 8, "W": 4, "baseline_mib": 900, "msdata_mib": 150},
            {"S": 64, "R": 8, "W": 4, "baseline_mib": 4000, "msdata_mib": 300},
            {"S": 64, "R": 4, "W": 4, "baseline_mib": 2000, "msdata_mib": 290},
        ],
    },
    "transport": {
        "ratio_vs_dataloader_64kib": 3.0,
        "ratio_vs_dataloader_1mib": 8.0,
        "ratio_vs_dataloader_16mib": 20.0,
        "ratio_vs_dataloader_1mib_2readers": 12.0,
        "msdata_gbps_16mib": 9.5,
        "memcpy_gbps_64mib": 11.0,
    },
    "vlm": {"gain_vlm_8k_dp8": 1.4, "gain_vlm_16k_dp8": 1.6, "gain_vlm_16k_dp64": 1.7},
    "autoscale": {
        "data_wait_frac_autoscale": 0.01,
        "trace": [{"t": float(t), "workers": 2 + t // 5, "wait": 0.0} for t in range(20)],
    },
    "scale": {
        "cases": [
            {
                "nodes": n,
                "dp": 8 * n,
                "sources": 4,
                "plan_bytes": 19_000 * n,
                "leader_bytes_per_step": 36_000 * n,
                "node_bytes_max": 130_000,
            }
            for n in (8, 64, 512)
        ]
    },
}
PLOTS = {
    "gain.png",
    "vlm_gain.png",
    "cost_model.png",
    "planning.png",
    "memory.png",
    "transport.png",
    "failover.png",
    "autoscale_trace.png",
    "scale.png",
}


def _suite(*args: str) -> dict:
    out = subprocess.run([sys.executable, str(SUITE), *args], capture_output=True, text=True, timeout=120, cwd=ROOT)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    return json.loads(out.stdout.strip().splitlines()[-1])


def test_smoke_run_of_one_benchmark_writes_its_json(tmp_path):
    got = _suite(
        "--quick", "--only", "balance", "--args", "balance=--steps 1 --dp 8 --seq-lens 4096", "--results", str(tmp_path)
    )
    assert got["ran"] == ["balance"]
    assert got["failed"] == []
    assert got["json"] == ["balance.json"]
    result = json.loads((tmp_path / "balance.json").read_text())
    assert result["gain_4k_dp8"] > 1.0
    assert "plan_ms_dp8" in result
    suite = json.loads((tmp_path / "suite.json").read_text())
    assert suite["balance"]["rc"] == 0
    assert "--quick" in suite["balance"]["command"]
    assert set(got["plots"]) >= {"gain.png", "planning.png"}
    for name in got["plots"]:
        assert (tmp_path / name).stat().st_size > 0


def test_plots_from_every_kind_of_result(tmp_path):
    for name, data in CANNED.items():
        (tmp_path / f"{name}.json").write_text(json.dumps(data))
    got = _suite("--plot-only", "--results", str(tmp_path))
    assert set(got["plots"]) == PLOTS
    assert got["ran"] == []
    for name in PLOTS:
        size = (tmp_path / name).stat().st_size
        assert 1000 < size < 100_000, (name, size)


def test_unknown_benchmark_is_refused(tmp_path):
    out = subprocess.run(
        [sys.executable, str(SUITE), "--only", "nope", "--results", str(tmp_path)],
        capture_output=True,
        text=True,
        timeout=60,
        cwd=ROOT,
    )
    assert out.returncode == 2
    assert "--only ['nope']: the benchmarks are" in out.stderr


def test_smoke_runs_the_benchmarks_smokes_and_writes_nothing_into_results():
    """``suite.py --smoke`` passes --smoke to each benchmark and keeps their JSON in a temp folder."""
    results = ROOT / "bench" / "results"
    before = {p.name: p.stat().st_mtime_ns for p in results.iterdir()} if results.exists() else {}
    out = subprocess.run(
        [sys.executable, str(SUITE), "--smoke", "--only", "statebytes"],
        capture_output=True,
        text=True,
        timeout=300,
        cwd=ROOT,
    )
    assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-2000:]
    summary = json.loads(out.stdout.strip().splitlines()[-1])
    assert summary["ran"] == ["statebytes"]
    assert not summary["failed"]
    assert "--smoke" in out.stdout
    assert Path(summary["results"]) != results
    assert json.loads((Path(summary["results"]) / "statebytes.json").read_text())
    after = {p.name: p.stat().st_mtime_ns for p in results.iterdir()} if results.exists() else {}
    assert after == before
