"""A short seeded chaos run (bench/chaos.py): three node servers and etcd, six ranks in lockstep, a few faults
(transform worker, follower restart, a rank's socket shut under it); every delivered micro-batch equals the
same job's on one node, none lost or repeated, nothing left in /dev/shm."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from .etcd_fixture import ETCD

ROOT = Path(__file__).resolve().parents[1]


def test_a_short_seeded_chaos_run_loses_repeats_and_changes_nothing():
    if ETCD is None:
        pytest.skip("no etcd binary (apt install etcd-server, or set $MSDATA_ETCD)")
    cmd = [sys.executable, str(ROOT / "bench" / "chaos.py"), "--minutes", "0.3", "--interval", "5", "--seed", "2"]
    cmd += ["--kinds", "worker,follower,socket", "--settle", "30", "--no-takeover"]  # failover: tests/test_shadow.py
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=110, cwd=str(ROOT))
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    got = json.loads(out.stdout.strip().splitlines()[-1])
    assert got["faults"] >= 3, got  # the schedule struck
    assert not got["stuck"], got
    assert got["unrecovered"] == 0, got
    assert (got["lost"], got["duplicated"], got["mismatched"]) == (0, 0, 0), got
    assert got["steps"] > 20, got
    assert got["shm_left"] == 0, got
