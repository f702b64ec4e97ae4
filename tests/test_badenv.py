"""A bad environment gets a clear error naming the cause and the fix, and the server recovers once it is gone:
/dev/shm full mid-run (the fault switch in msdata_server/faults.py makes reserving shared memory fail with ENOSPC,
as a full /dev/shm does), and etcd unreachable when a cluster node starts."""

from __future__ import annotations

import secrets
import shutil
import tempfile
import threading

import pytest

import msdata_client as msd
from msdata_client.wire import request

from .e2e_util import run_ranks, small_job
from .etcd_fixture import EtcdServer
from .polling import wait_for
from .server_util import ServerProc


def test_dev_shm_full_mid_run_is_named_and_the_server_recovers(server_factory, tmp_path, monkeypatch):
    flag = tmp_path / "shm-full"
    monkeypatch.setenv("MSDATA_TEST_FAULTS", "1")
    monkeypatch.setenv("MSDATA_TEST_SHM_FULL", str(flag))
    srv = server_factory().start()
    running = small_job("running", dp=1, samples=2000)
    with msd.DataClient(running, endpoint=srv.socket, rank=0, world_size=1) as dc:
        first = [int(next(dc)["step"]) for _ in range(2)]
        flag.touch()  # /dev/shm is full from now on
        late = small_job("late", dp=1, seed=3)
        with pytest.raises(msd.RemoteError) as e:
            next(msd.DataClient(late, endpoint=srv.socket, rank=0, world_size=1))
        assert "/dev/shm" in str(e.value)
        assert "shm-size" in str(e.value)
        more = [int(next(dc)["step"]) for _ in range(4)]  # the job that has its rings is still served
        assert first + more == [0, 0, 1, 1, 2, 2]
        flag.unlink()  # space returns
        assert len(run_ranks(late, srv.socket, 3)[0]) == 3
    assert srv.log().count("job late cannot start: cannot reserve") == 1  # logged once, naming the job
    assert srv.proc.poll() is None


def test_etcd_unreachable_at_start_is_named_and_the_node_joins_when_it_comes_up(tmp_path):
    etcd = EtcdServer(tmp_path)  # ports reserved, not started yet
    d = tempfile.mkdtemp(prefix="msd-")  # short: socket paths are limited
    token = tmp_path / "token"
    token.write_text(secrets.token_hex(24))
    token.chmod(0o600)
    srv = ServerProc(
        d,
        extra=f"""
[cluster]
etcd = ["{etcd.url}"]
token_file = "{token}"
lease_ttl = 2.0
prefix = "/t{secrets.token_hex(4)}"
""",
    )
    started: list[BaseException | None] = []

    def start():
        try:
            srv.start(timeout=90)
            started.append(None)
        except BaseException as e:
            started.append(e)

    t = threading.Thread(target=start)
    t.start()
    try:
        wait_for(lambda: "etcd is unreachable" in srv.log(), 30, "the error about etcd")
        log = srv.log()
        assert etcd.url in log
        assert "Start etcd" in log
        assert "[cluster] etcd" in log
        assert srv.proc.poll() is None  # it waits, it does not exit
        etcd.start()
        t.join(90)
        assert started == [None], started
        st = wait_for(
            lambda: request(srv.socket, {"t": "status"})["status"]["role"] == "leader", 30, "the node to lead"
        )
        assert st
        assert "etcd answered after" in srv.log()
    finally:
        srv.stop()
        t.join(5)
        if srv.proc is not None and srv.proc.stdout:
            srv.proc.stdout.close()
        etcd.stop()
        shutil.rmtree(d, ignore_errors=True)
