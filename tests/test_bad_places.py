"""Bad input from the operator (issue 25, item 11): a socket directory under a file or in /proc is one clear
error line from both `validate` and `serve`, never a traceback (and `validate` no longer says OK); a job that
waits (for ranks that do not come, for a state_dir it cannot write) says what for in `status`, and `health`
fails while the state_dir cannot be written."""

from __future__ import annotations

import socket
import subprocess
import sys

import pytest

from msdata_client.wire import PROTOCOL_VERSION, encode, request

from .e2e_util import small_job
from .polling import wait_for
from .server_util import ROOT


def _run(cmd: str, config) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "msdata_server", cmd, "--config", str(config)],
        capture_output=True,
        text=True,
        timeout=60,
        cwd=str(ROOT),
    )


@pytest.mark.parametrize("place", ["under_a_file", "in_proc", "proc_itself"])
@pytest.mark.parametrize("cmd", ["validate", "serve"])
def test_a_socket_where_none_can_be_made_is_one_clear_line(tmp_path, place, cmd):
    (tmp_path / "afile").write_text("")
    sock = {
        "under_a_file": tmp_path / "afile" / "sub" / "msdata.sock",
        "in_proc": "/proc/msdata-test/msdata.sock",
        "proc_itself": "/proc/msdata-test.sock",
    }[place]
    config = tmp_path / "node.toml"
    config.write_text(f'[node]\nsocket = "{sock}"\nworkers = 0\nshm_prefix = "tbp"\n')
    res = _run(cmd, config)
    assert res.returncode == 2, (res.stdout, res.stderr)
    assert "Traceback" not in res.stderr, res.stderr
    assert "OK" not in res.stdout, res.stderr
    errors = [line for line in res.stderr.splitlines() if "error:" in line]
    assert len(errors) == 1, errors
    assert "cannot make the client socket" in errors[0], errors
    assert "[node] socket" in errors[0], errors


def _hello(path: str, spec, rank: int) -> socket.socket:
    s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    s.connect(path)
    frame = {"t": "hello", "v": PROTOCOL_VERSION, "job": spec.to_dict(), "digest": spec.digest(), "rank": rank}
    s.sendall(encode({**frame, "world_size": spec.mesh.world_size}))
    return s


def _job(srv) -> dict:
    jobs = request(srv.socket, {"t": "status"})["status"]["jobs"]
    return jobs[0] if jobs else {}


def _health(srv) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "msdata_server", "health", "--endpoint", srv.socket],
        capture_output=True,
        text=True,
        timeout=60,
        cwd=str(ROOT),
    )


def test_a_job_waiting_for_ranks_says_which(server_factory):
    srv = server_factory().start()
    spec = small_job("mesh4", dp=4)
    conns = [_hello(srv.socket, spec, r) for r in (0, 2)]
    want = "2 of 4 ranks of job mesh4 registered here; missing ranks 1, 3"
    wait_for(lambda: want in (_job(srv).get("waiting_for") or ""), 30, "the job to say which ranks it lacks")
    st = subprocess.run(
        [sys.executable, "-m", "msdata_server", "status", "--endpoint", srv.socket],
        capture_output=True,
        text=True,
        timeout=60,
        cwd=str(ROOT),
    )
    assert f"waiting for: {want}" in st.stdout, st.stdout
    assert _health(srv).returncode == 0  # ranks still to come are no fault of the server
    for s in conns:
        s.close()


def test_an_unwritable_state_dir_is_reported_and_fails_health(server_factory, tmp_path):
    (tmp_path / "afile").write_text("")
    srv = server_factory(extra=f'state_dir = "{tmp_path / "afile" / "state"}"\n').start()
    res = _health(srv)
    assert res.returncode == 1, res.stderr
    assert "degraded" in res.stderr, res.stderr
    assert "state_dir" in res.stderr, res.stderr
    st = request(srv.socket, {"t": "status"})["status"]
    assert "cannot save the planner state" in st["state_dir"]["error"]
    with _hello(srv.socket, small_job("one", dp=1), 0):
        wait_for(
            lambda: "cannot save the planner state" in (_job(srv).get("waiting_for") or ""),
            30,
            "the job to say it waits for its state_dir",
        )
