"""Every benchmark runnable, always (issue 30): each bench/*.py (minus the helpers named in EXEMPT) runs its
``--smoke`` (seconds, tiny sizes, every code path, both arms of each A/B) and must exit 0 with its JSON object as
the last line of stdout, holding the benchmark's keys; together they must write nothing into bench/results/ (or
bench/out/), leave no process behind and no msdata segment in /dev/shm.

Benchmarks are found by listing bench/*.py, so a new one is covered (and must have a --smoke) the day it lands.
The smokes run two at a time (MSDATA_BENCH_SMOKE_JOBS; 1 runs them one after another), longest first; each in a
session of its own, with a tag in its environment by which anything it started is found afterwards.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import time
import uuid
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from msdata_server.shm import list_segments, owner_alive

from .etcd_fixture import ETCD
from .polling import wait_for

ROOT = Path(__file__).resolve().parents[1]
BENCH = ROOT / "bench"
# bench/*.py that are not benchmarks, and why
EXEMPT = {
    "progress": "result lines and progress bars for the benchmarks (a module)",
    "workloads": "the workload definitions the benchmarks share (a module)",
    "_autoscale_tf": "bench/autoscale.py's transform, imported by its server's workers (a module)",
    "_remote_tf": "bench/remote.py's WebDataset transform, imported by its server's workers (a module)",
    "_scale_sources": "bench/scale.py's one-node many-sources cases (a module; scale's --smoke runs them)",
    "suite": "the runner of every benchmark and the plots (tests/test_bench_suite.py)",
}
BENCHES = sorted(p.stem for p in BENCH.glob("*.py") if p.stem not in EXEMPT)
NEEDS_ETCD = {"cluster", "chaos", "scale"}
SMOKE_TIMEOUT = 300.0  # seconds one smoke may take (they take 1-45 s on 2 idle cores)
# keys each benchmark's JSON must hold, not null: what bench/suite.py plots and the docs quote, and for the A/Bs
# a figure that needs both arms (a ratio, the baseline's figure). A benchmark not named here: any JSON object.
KEYS = {
    "autoscale": {
        "data_wait_frac_autoscale",
        "data_wait_frac_static_mean",
        "data_wait_frac_static_peak",
        "worker_s_saving_vs_peak",
        "trace",
    },
    "balance": {"gain_4k_dp8", "gain_4k_dp1024", "plan_ms_dp8", "baseline_imbalance_4k_dp8"},
    "chaos": {"faults", "lost", "duplicated", "mismatched", "takeover_s_cold", "takeover_s_shadow", "per_kind"},
    "cluster": {
        "failover_s",
        "failover_planned_s",
        "failover_delivered_s",
        "lease_ttl_s",
        "plan_ms_dp512",
        "plan_ms_dp4096",
        "state_write_ms",
        "cross_node_steps_per_s",
        "one_node_steps_per_s",
        "cross_node_ratio",
        "peer_link_efficiency",
        "raw_tcp_bytes_per_s",
    },
    "lineage": {"plan_ms_dp512", "plan_ms_dp4096", "lineage_ms_dp4096_0back", "ratio_64back_dp4096"},
    "memgrowth": {"uss_growth_pct", "baseline_growth_kib_per_10k_steps"},
    "memory": {"R", "W", "rows", "method"},
    "resume": {"resume_first_batch_s", "state_bytes", "identical"},
    "scale": {
        "leader_fanout_ratio_n512",
        "node_bytes_ratio_n512",
        "plan_to_all_ms_p99_n512",
        "leader_overhead_ms_n512",
        "plan_to_all_model_ms_p99_n512",
        "per_source_kib_s1024",
        "first_batch_s_s1024",
        "first_batch_s_files100k",
        "cases",
    },
    "soak": {"pss_growth_pct_per_hour", "fd_growth", "shm_growth_bytes", "restarts"},
    "statebytes": {"bytes_per_step_full", "bytes_per_step_delta", "ratio", "exact"},
    "tokenize": {
        "tokenize_efficiency",
        "tokens_per_s_library",
        "tokens_per_s_pool_w1",
        "tokens_per_s_pool_w2",
        "tokens_per_s_per_core",
        "pool_scaling_1_2",
    },
    "train_e2e": {"e2e_gain_4k_dp2", "e2e_gain_4k_dp8", "predicted_gain_4k_dp8", "cost_model_r2"},
    "transport": {"ratio_vs_dataloader_1mib", "ratio_vs_dataloader_1mib_2readers", "next_p50_us", "memcpy_gbps_64mib"},
    "vlm": {"gain_vlm_8k_dp8", "baseline_encoder_imbalance_8k_dp8", "images_per_s_per_worker"},
}
# what shows that the smoke went down every path (beyond the keys above)
PATHS = {
    "chaos": lambda j: sorted(k for k, v in j["per_kind"].items() if v["count"] < 1) == [],  # every fault kind
    "memory": lambda j: len(j["rows"]) >= 2 and all("baseline_mib" in r and "msdata_mib" in r for r in j["rows"]),
    "resume": lambda j: j["identical"] is True,
    "soak": lambda j: j["restarts"] >= 1,
    "statebytes": lambda j: j["exact"] is True and j["bytes_per_step_delta"] < j["bytes_per_step_full"],
}
# the fixture runs every smoke before the first test that uses it: the suite's 120 s per test cannot hold them
pytestmark = pytest.mark.timeout(1200)
STARTED: set[str] = set()  # the tags of the smokes started, for the clean-up after an interrupted run
LONGEST_FIRST = ("chaos", "memory", "autoscale", "transport", "cluster", "soak", "memgrowth", "train_e2e")


def _listing(*dirs: Path) -> dict[str, tuple[int, int]]:
    """Every file under ``dirs``: path -> (size, mtime ns)."""
    out = {}
    for d in dirs:
        for p in sorted(d.rglob("*")) if d.exists() else ():
            if p.is_file():
                st = p.stat()
                out[str(p.relative_to(ROOT))] = (st.st_size, st.st_mtime_ns)
    return out


def _tagged(tag: str) -> list[int]:
    """Live processes whose environment holds MSDATA_BENCH_SMOKE=tag (whatever session they moved to)."""
    want = f"MSDATA_BENCH_SMOKE={tag}".encode()
    out = []
    for d in Path("/proc").iterdir():
        if d.name.isdigit():
            try:
                env = (d / "environ").read_bytes()
            except OSError:
                continue
            if want in env.split(b"\0"):
                out.append(int(d.name))
    return out


def _run(name: str) -> dict:
    """One smoke in a session of its own; its output, time, and anything it left running (then killed)."""
    tag = uuid.uuid4().hex
    STARTED.add(tag)
    env = dict(os.environ, PYTHONPATH=str(ROOT), PYTHONUNBUFFERED="1", MSDATA_BENCH_SMOKE=tag)
    t0 = time.monotonic()
    proc = subprocess.Popen(
        [sys.executable, str(BENCH / f"{name}.py"), "--smoke"],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        cwd=ROOT,
        env=env,
        start_new_session=True,
    )
    try:
        out, err = proc.communicate(timeout=SMOKE_TIMEOUT)
        timed_out = False
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        out, err = proc.communicate()
        timed_out = True
    seconds = time.monotonic() - t0
    left = []
    deadline = time.monotonic() + 10  # a child that was told to stop may still be on its way out
    while (left := _tagged(tag)) and time.monotonic() < deadline:
        time.sleep(0.2)
    for pid in left:  # do not poison what runs next
        with contextlib.suppress(OSError):
            os.kill(pid, signal.SIGKILL)
    return {"rc": proc.returncode, "out": out, "err": err, "seconds": seconds, "timed_out": timed_out, "left": left}


def _selected(session) -> list[str]:
    """The benchmarks whose test_smoke runs in this session (all when none is selected, for the other tests)."""
    names = [
        item.callspec.params["name"]
        for item in session.items
        if item.originalname == "test_smoke" and hasattr(item, "callspec")
    ]
    return names or list(BENCHES)


@pytest.fixture(scope="module")
def smokes(request):
    """Run the selected smokes (two at a time, longest first); their records, and what they left behind."""
    names = [n for n in _selected(request.session) if n not in NEEDS_ETCD or ETCD]
    names.sort(key=lambda n: (LONGEST_FIRST.index(n) if n in LONGEST_FIRST else len(LONGEST_FIRST), n))
    watched = (BENCH / "results", BENCH / "out")
    before = _listing(*watched)
    segs_before = {n for n, _ in list_segments()}
    t0 = time.monotonic()
    try:
        with ThreadPoolExecutor(max_workers=max(1, int(os.environ.get("MSDATA_BENCH_SMOKE_JOBS", "2")))) as pool:
            runs = dict(zip(names, pool.map(_run, names)))
    finally:  # interrupted (a timeout, ^C): nothing of the smokes stays running
        for tag in STARTED:
            for pid in _tagged(tag):
                with contextlib.suppress(OSError):
                    os.kill(pid, signal.SIGKILL)
    total = time.monotonic() - t0
    after = _listing(*watched)
    segs = [n for n, info in list_segments() if n not in segs_before and not owner_alive(info)]
    for n in segs:  # do not poison the next test
        with contextlib.suppress(OSError):
            os.unlink(os.path.join("/dev/shm", n))
    times = ", ".join(f"{n} {r['seconds']:.0f}s" for n, r in runs.items())
    print(f"\nbench smokes: {total:.0f} s in all ({times})", file=sys.stderr)
    return {
        "runs": runs,
        "written": sorted(k for k in after if before.get(k) != after[k]),
        "removed": sorted(set(before) - set(after)),
        "segments": segs,
    }


def test_every_benchmark_is_found_and_has_a_smoke():
    listed = {p.stem for p in BENCH.glob("*.py")}
    assert set(EXEMPT) <= listed, f"exempt but not in bench/ (drop them from EXEMPT): {sorted(set(EXEMPT) - listed)}"
    assert {"transport", "chaos", "cluster", "autoscale"} <= set(BENCHES)
    no_smoke = [n for n in BENCHES if '"--smoke"' not in (BENCH / f"{n}.py").read_text()]
    assert not no_smoke, f"benchmarks without a --smoke (issue 30; or add them to EXEMPT with a reason): {no_smoke}"


@pytest.mark.parametrize("name", BENCHES)
def test_smoke(name, smokes):
    if name in NEEDS_ETCD and not ETCD:
        pytest.skip("no etcd binary (apt install etcd-server, or set $MSDATA_ETCD)")
    r = smokes["runs"][name]
    tail = f"\n--- stdout ---\n{r['out'][-3000:]}\n--- stderr ---\n{r['err'][-3000:]}"
    assert not r["timed_out"], f"bench/{name}.py --smoke ran past {SMOKE_TIMEOUT:.0f} s" + tail
    assert r["rc"] == 0, f"bench/{name}.py --smoke exited with {r['rc']}" + tail
    lines = r["out"].strip().splitlines()
    assert lines, f"bench/{name}.py --smoke printed nothing" + tail
    try:
        got = json.loads(lines[-1])
    except json.JSONDecodeError:
        pytest.fail(f"bench/{name}.py --smoke: the last line of stdout is not JSON" + tail)
    assert isinstance(got, dict), f"bench/{name}.py --smoke: the last line is not a JSON object" + tail
    assert got, f"bench/{name}.py --smoke: the last line is not a JSON object" + tail
    missing = sorted(k for k in KEYS.get(name, ()) if got.get(k) is None)
    assert not missing, f"bench/{name}.py --smoke: keys missing or null: {missing}\n{lines[-1]}"
    if name in PATHS:
        assert PATHS[name](got), f"bench/{name}.py --smoke did not go down every path:\n{lines[-1]}"
    assert not r["left"], f"bench/{name}.py --smoke left processes running: {r['left']}"


def test_smokes_write_nothing_into_results_and_leave_no_segments(smokes):
    assert smokes["runs"], "no smoke ran"
    assert not smokes["written"], (
        f"smokes wrote into bench/results/ or bench/out/: {smokes['written']}, removed {smokes['removed']}"
    )
    assert not smokes["removed"], (
        f"smokes wrote into bench/results/ or bench/out/: {smokes['written']}, removed {smokes['removed']}"
    )
    assert not smokes["segments"], f"smokes left shared-memory segments behind: {smokes['segments']}"


def test_tagged_processes_are_found():
    """The leftover-process check finds a process that left the smoke's session and process group."""
    tag = uuid.uuid4().hex
    env = dict(os.environ, MSDATA_BENCH_SMOKE=tag)
    p = subprocess.Popen(["sleep", "30"], env=env, start_new_session=True)
    try:
        wait_for(lambda: p.pid in _tagged(tag), 10, "the tagged process found (once it has exec'd)")
    finally:
        p.kill()
        p.wait()
    assert p.pid not in _tagged(tag)
