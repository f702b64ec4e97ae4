"""A state_dir that cannot be written (a full disk, no permission) through a real server: the log names the
directory, the cause and the fix; no step leaves before its state is saved, so nothing is lost; the job goes on
by itself once the cause is removed, with exactly the batches of an undisturbed run."""

from __future__ import annotations

import glob
import os
import threading

from msdata_server.statedir import StateStore

from .e2e_util import run_ranks, small_job
from .polling import wait_for

STEPS = 16


def _run_in_thread(spec, endpoint, n, **kw):
    box: dict = {}

    def body():
        try:
            box["out"] = run_ranks(spec, endpoint, n, **kw)
        except BaseException as e:  # re-raised by the test
            box["err"] = e

    t = threading.Thread(target=body, daemon=True)
    t.start()
    return t, box


def _stored_steps(state_dir: str, name: str) -> list[int]:
    (d,) = glob.glob(os.path.join(state_dir, name, "*"))
    store = StateStore(state_dir, name, os.path.basename(d).ljust(16, "0"))
    return [s for s in range(STEPS) if (got := store.load_at_or_before(s)) is not None and got[0] == s]


def test_disk_full_mid_run_waits_names_the_fix_and_loses_nothing(server_factory, monkeypatch, tmp_path):
    flag = tmp_path / "disk-full"
    monkeypatch.setenv("MSDATA_TEST_FAULTS", "1")
    monkeypatch.setenv("MSDATA_TEST_DISK_FULL", str(flag))
    srv = server_factory(extra="ring_slots = 2\n").start()
    state_dir = os.path.join(srv.dir, "state")
    spec = small_job("diskfull", dp=2, micro_batches=2, prefetch=1)

    go = threading.Event()
    t, box = _run_in_thread(spec, srv.socket, STEPS * 2, pause=(2, go))  # the ranks stop after step 0
    wait_for(lambda: glob.glob(f"{state_dir}/diskfull/*/step-000000000001.*"), 30, "the state of step 1")
    flag.touch()  # the disk is full from now on: the next state cannot be saved
    go.set()
    wait_for(lambda: "the disk is full" in srv.log(), 30, "the disk-full error")
    log = srv.log()
    assert f"state_dir {state_dir}/diskfull/" in log
    assert "free space on that disk" in log
    assert "goes on by itself once it can write" in log
    assert t.is_alive()  # the ranks wait for data: a step whose state is not saved does not leave
    flag.unlink()  # the cause removed: the job goes on by itself
    t.join(60)
    assert not t.is_alive(), box.get("err")
    assert "err" not in box, box.get("err")
    assert "the planner state saves again" in srv.log()
    assert srv.log().count("the disk is full") == 1  # the cause is logged once per outage, not per retry
    # every step the ranks went through has its state on disk (a SIGKILL now would lose nothing)
    assert set(range(STEPS)) <= set(_stored_steps(state_dir, "diskfull"))
    assert box["out"] == run_ranks(spec, srv.socket, STEPS * 2)  # exactly the batches of an undisturbed run


def test_unwritable_state_dir_names_the_path_and_recovers(server_factory, tmp_path):
    state_dir = tmp_path / "state"
    state_dir.mkdir()
    srv = server_factory(extra=f'state_dir = "{state_dir}"\n').start()
    spec = small_job("nowrite", dp=2, micro_batches=2)
    ref = run_ranks(spec, srv.socket, 8)  # a first run: its files are there
    wait_for(lambda: "job nowrite: every rank left" in srv.log(), 30, "the first run to close (no more saves)")
    blocker = state_dir / "nowrite"
    if os.geteuid() == 0:  # root writes through any mode bits: put a file where the job's directory goes
        for p in sorted(blocker.rglob("*"), reverse=True):
            p.unlink() if p.is_file() else p.rmdir()
        blocker.rmdir()
        blocker.write_text("in the way")
        want = "a file is in the way"
    else:
        os.chmod(state_dir, 0o500)
        for p in blocker.glob("*"):
            os.chmod(p, 0o500)
        want = "it is not writable"
    t, box = _run_in_thread(spec, srv.socket, 8)
    try:
        wait_for(lambda: want in srv.log(), 30, "the unwritable-state_dir error")
        log = srv.log()
        assert f"state_dir {state_dir}/nowrite/" in log
        assert "point [node] state_dir at a writable directory" in log
        assert t.is_alive()
    finally:
        if blocker.is_file():
            blocker.unlink()
        os.chmod(state_dir, 0o700)
        for p in blocker.glob("*"):
            os.chmod(p, 0o700)
    t.join(60)
    assert not t.is_alive(), box.get("err")
    assert "err" not in box, box.get("err")
    assert box["out"] == ref
    assert "the planner state saves again" in srv.log()
