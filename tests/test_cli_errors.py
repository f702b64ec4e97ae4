"""Clear errors instead of tracebacks or wrong answers from the command line (issue 25: items 8 and 11):
offline lineage checks the saved state's data identity and names a cut-off state file; a bad --out path, demo
--steps 0 and --ranks 0 are refused with one line."""

from __future__ import annotations

import json
import subprocess
import sys

from msdata_client.client import STATE_VERSION
from msdata_server.planner import Planner
from msdata_server.planner.spec import planner_config

from .e2e_util import small_job


def cli(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "msdata_server", *args], capture_output=True, text=True, timeout=300)


def _saved_state(spec) -> dict:
    """A trainer's state_dict() at step 0 of ``spec`` (what DataClient.state_dict gives)."""
    return {
        "version": STATE_VERSION,
        "job": spec.name,
        "data_digest": spec.data_digest(),
        "position": {"step": 0, "micro": 0},
        "layout": spec.layout(),
        "planner": Planner(planner_config(spec)).state_dict(),
    }


def test_offline_lineage_refuses_another_jobs_state_and_names_a_cut_off_file(tmp_path):
    mine, other = small_job("mine", samples=100), small_job("mine", seed=1, samples=100)  # same sources
    job = tmp_path / "job.toml"
    job.write_text(mine.to_toml())
    state = tmp_path / "state.json"
    state.write_text(json.dumps(_saved_state(mine)))
    res = cli("lineage", "--job", str(job), "--steps", "0:1", "--state", str(state))
    assert res.returncode == 0, res.stderr  # its own state: rows
    state.write_text(json.dumps(_saved_state(other)))
    res = cli("lineage", "--job", str(job), "--steps", "0:1", "--state", str(state))
    assert res.returncode == 2, res.stdout
    assert "another data identity" in res.stderr
    assert str(state) in res.stderr
    text = json.dumps(_saved_state(mine))
    state.write_text(text[: len(text) // 2])
    res = cli("lineage", "--job", str(job), "--steps", "0:1", "--state", str(state))
    assert res.returncode == 2, res.stderr
    assert str(state) in res.stderr, res.stderr
    assert "cut off" in res.stderr, res.stderr


def test_lineage_out_to_a_bad_path_is_one_line(tmp_path):
    job = tmp_path / "job.toml"
    job.write_text(small_job("out", samples=100).to_toml())
    bad = tmp_path / "no" / "such" / "dir" / "rows.parquet"
    res = cli("lineage", "--job", str(job), "--steps", "0:1", "--out", str(bad))
    assert res.returncode == 2, res.stderr
    assert "Traceback" not in res.stderr, res.stderr
    assert f"cannot write --out {str(bad)!r}" in res.stderr


def test_demo_refuses_zero_steps_and_zero_ranks():
    for flag in ("--steps", "--ranks"):
        res = cli("demo", flag, "0")
        assert res.returncode == 2, res.stderr
        assert "Traceback" not in res.stderr, res.stderr
        assert f"{flag}" in res.stderr, res.stderr
        assert "must be" in res.stderr, res.stderr
