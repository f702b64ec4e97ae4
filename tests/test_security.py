"""Issue 25's hardening, against real server processes: what a client may make the server run and read, the
socket directory and the server's identity, read-only ring descriptors, the token file's mode, mixture
weights."""

from __future__ import annotations

import fcntl
import json
import math
import mmap
import os
import secrets
import subprocess
import sys
import textwrap
import threading

import numpy as np
import pytest
import torch

import msdata_client as msd
from msdata_client.errors import ConfigError
from tests.e2e_util import small_job
from tests.server_util import ROOT


def cli(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "msdata_server", *args], capture_output=True, text=True, cwd=str(ROOT), timeout=120
    )


# ---- item 4: a token file others may read is refused -----------------------------------------------------
def test_a_token_file_others_may_read_is_refused_by_validate_and_serve(tmp_path, sockdir):
    token = tmp_path / "token"
    token.write_text(secrets.token_hex(24))
    token.chmod(0o644)
    node = tmp_path / "node.toml"
    node.write_text(
        textwrap.dedent(f"""\
        [node]
        socket = "{sockdir}/s.sock"
        workers = 0
        [cluster]
        etcd = ["http://127.0.0.1:9"]
        token_file = "{token}"
        """)
    )
    for cmd in ("validate", "serve"):
        out = cli(cmd, "--config", str(node))
        assert out.returncode != 0, (cmd, out.stdout, out.stderr)
        assert f"token_file {str(token)!r} has mode 0644" in out.stderr, cmd
        assert f"chmod 600 {token}" in out.stderr, cmd
    token.chmod(0o600)
    out = cli("validate", "--config", str(node))
    assert out.returncode == 0, out.stderr


# ---- item 9: weights a float cannot sum, NaN, inf and partial dicts are refused at the call; the job goes on -
BAD_WEIGHTS = [
    ({"a": 1e308, "b": 1e308}, "sum to more than a float holds"),
    ({"a": math.nan, "b": 1.0}, r"\['a'\]=(nan|None) must be a finite number >= 0"),
    ({"a": math.inf, "b": 1.0}, r"\['a'\]=(inf|None) must be a finite number >= 0"),
    ({"a": 1.0}, r"set_mixture weights lack source\(s\) \['b'\]; give every source of the job a weight"),
    ({"a": 0.0, "b": 0.0}, "must not all be 0"),  # refused by the planner, as before
]


def test_bad_mixture_weights_are_refused_by_client_and_server_and_the_job_goes_on(server_factory):
    srv = server_factory().start()
    spec = small_job("mixbad", dp=1)
    with msd.DataClient(spec, endpoint=srv.socket, rank=0, world_size=1, connect_timeout=30) as dc:
        assert int(next(dc)["step"]) == 0
        for weights, reason in BAD_WEIGHTS:
            with pytest.raises(ConfigError, match=reason):
                dc.set_mixture(weights)
            with pytest.raises(ConfigError, match=reason):  # the server's own check, past the client's
                dc._conn.request({"t": "mixture", "weights": weights}, "mixture")
        assert dc.set_mixture({"a": 1e300, "b": 1e300}) >= 1  # huge but summable: only the ratio counts
        steps = [int(next(dc)["step"]) for _ in range(6)]
        assert steps[-1] >= 2
    assert srv.proc is not None
    assert srv.proc.poll() is None
    assert "Traceback" not in srv.log()
    assert "OverflowError" not in srv.log()


def test_a_mix_table_a_float_cannot_sum_is_a_clear_validate_error(tmp_path):
    job = tmp_path / "job.toml"
    job.write_text(
        textwrap.dedent("""\
        [job]
        name = "huge"
        seq_len = 512
        [mesh]
        dp = 1
        [[source]]
        name = "a"
        format = "synthetic"
        samples = 10
        [[source]]
        name = "b"
        format = "synthetic"
        samples = 10
        [mix]
        weights = { a = 1e308, b = 1e308 }
        """)
    )
    node = tmp_path / "node.toml"
    node.write_text(f'[node]\nsocket = "{tmp_path}/s.sock"\n')
    out = cli("validate", "--config", str(node), "--job", str(job))
    assert out.returncode == 2, out.stderr
    assert "sum to more than a float holds" in out.stderr, out.stderr
    assert "Traceback" not in out.stderr


# ---- item 3: ranks get read-only ring descriptors --------------------------------------------------------
def _ring_fds(prefix: str) -> list[int]:
    """This process's descriptors of the server's (unlinked) ring segments, found in /proc/self/fd."""
    out = []
    for name in os.listdir("/proc/self/fd"):
        try:
            target = os.readlink(f"/proc/self/fd/{name}")
        except OSError:
            continue
        if target.startswith(f"/dev/shm/{prefix}-") and "-ring-" in target:
            out.append(int(name))
    return out


def test_a_rank_cannot_map_its_ring_shared_and_writable(server_factory):
    srv = server_factory().start()
    spec = small_job("ro", dp=1, tp=2)
    with (
        msd.DataClient(spec, endpoint=srv.socket, rank=0, world_size=2, connect_timeout=30) as r0,
        msd.DataClient(spec, endpoint=srv.socket, rank=1, world_size=2, connect_timeout=30) as r1,
    ):
        got: dict[int, dict] = {}
        t = threading.Thread(target=lambda: got.__setitem__(1, next(r1)))
        t.start()
        b0 = next(r0)
        t.join(60)
        fds = _ring_fds(srv.prefix)
        assert fds, "the ranks hold no ring descriptors"
        for fd in fds:
            assert os.fstat(fd).st_size > 0
            assert fcntl.fcntl(fd, fcntl.F_GETFL) & os.O_ACCMODE == os.O_RDONLY
            with pytest.raises(PermissionError):
                mmap.mmap(fd, os.fstat(fd).st_size, flags=mmap.MAP_SHARED, prot=mmap.PROT_READ | mmap.PROT_WRITE)
            with pytest.raises(OSError, match="Bad file descriptor"):
                os.pwrite(fd, b"x", 0)
        # the rank's own tensors stay writable, copy-on-write: its peer's batch does not change
        b1 = got[1]
        before = b1["tokens"].clone()
        b0["tokens"].fill_(7)
        assert torch.equal(b1["tokens"], before)
        assert bool((b0["tokens"] == 7).all())
        del b0, b1


# ---- item 2: the socket directory must be the server's own; the client checks whom it reached --------------
def test_the_server_refuses_a_socket_directory_others_may_write(tmp_path):
    shared = tmp_path / "shared"
    shared.mkdir()
    shared.chmod(0o777)  # as another user's `mkdir /tmp/msdata-<uid>` with a permissive umask leaves it
    node = tmp_path / "node.toml"
    node.write_text(f'[node]\nsocket = "{shared}/msdata.sock"\nworkers = 0\n')
    for cmd in ("validate", "serve"):
        out = cli(cmd, "--config", str(node))
        assert out.returncode == 2, (cmd, out.stdout, out.stderr)
        assert f"socket directory {str(shared)!r} has mode 0777" in out.stderr, cmd
        assert "chmod go-w" in out.stderr, cmd
    assert not (shared / "msdata.sock").exists()
    shared.chmod(0o750)  # group may search it (and use a socket chmod-ed for it), not write it
    assert cli("validate", "--config", str(node)).returncode == 0
    if os.geteuid() == 0:  # a directory another user made (only root can make one here for another user)
        os.chown(shared, 65534, 65534)
        out = cli("serve", "--config", str(node))
        assert out.returncode == 2
        assert f"socket directory {str(shared)!r} belongs to uid 65534" in out.stderr


def test_the_client_refuses_a_server_of_another_uid(server_factory, monkeypatch):
    srv = server_factory().start()
    spec = small_job("uid", dp=1)
    monkeypatch.setenv("MSDATA_SERVER_UID", str(os.getuid() + 1))
    with (
        pytest.raises(ConfigError, match=rf"runs as uid {os.getuid()}, but \$MSDATA_SERVER_UID says uid"),
        msd.DataClient(spec, endpoint=srv.socket, rank=0, world_size=1, connect_timeout=30) as dc,
    ):
        next(dc)
    monkeypatch.setenv("MSDATA_SERVER_UID", str(os.getuid()))
    with msd.DataClient(spec, endpoint=srv.socket, rank=0, world_size=1, connect_timeout=30) as dc:
        assert int(next(dc)["step"]) == 0


# ---- item 1: the node's operator decides which functions a job may run and which files it may read ---------
def shouted(record, **_) -> np.ndarray:
    """A transform outside msdata_server (allowed only with [node] allow_transforms = ["tests"])."""
    data = record.encode() if isinstance(record, str) else bytes(record)
    return np.frombuffer(data.upper(), dtype=np.uint8).astype(np.int32)


def _jsonl(path, n: int = 50) -> str:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(json.dumps({"text": f"document {i} " * 8}) + "\n" for i in range(n)))
    return str(path)


def _file_job(name: str, paths: list[str], transform: str | None = None) -> msd.JobSpec:
    g = msd.DGraph(name, seed=0)
    kw = {} if transform is None else {"transform": transform}
    g.source("f", "jsonl", paths, **kw).mix({"f": 1.0}).pack(256, micro_batches=1).mesh(dp=1)
    return g.plan()


def _first_batch(spec: msd.JobSpec, endpoint: str) -> dict:
    with msd.DataClient(spec, endpoint=endpoint, rank=0, world_size=1, connect_timeout=30) as dc:
        return {k: v.clone() for k, v in next(dc).items()}


@pytest.mark.parametrize("workers", [0, 1])
def test_a_transform_the_node_does_not_allow_is_refused_before_it_is_imported(server_factory, tmp_path, workers):
    marker = tmp_path / "ran-as-the-server"
    srv = server_factory(workers=workers).start()
    data = _jsonl(tmp_path / "data" / "d.jsonl")
    evil = _file_job("evil", [data], transform=f"os:system('touch {marker}')")
    with pytest.raises(ConfigError, match=r"transform \"os:system.* is not allowed on this node.*allow_transforms"):
        _first_batch(evil, srv.socket)
    own = _file_job("own", [data], transform=f"{__name__}:shouted")
    with pytest.raises(ConfigError, match=r"'tests\.test_security' \(or a package above it\) to allow_transforms"):
        _first_batch(own, srv.socket)
    assert not marker.exists()
    assert "Traceback" not in srv.log()
    assert "cannot import" not in srv.log()
    # the server goes on serving: the built-in transforms need no setting
    assert int(_first_batch(_file_job("fine", [data]), srv.socket)["step"]) == 0
    assert srv.proc is not None
    assert srv.proc.poll() is None


def test_allow_transforms_extends_the_built_ins(server_factory, tmp_path):
    srv = server_factory(workers=1, extra='allow_transforms = ["tests"]\n').start()
    data = _jsonl(tmp_path / "data" / "d.jsonl")
    b = _first_batch(_file_job("own", [data], transform=f"{__name__}:shouted"), srv.socket)
    t = b["tokens"]
    assert bool((t == ord("D")).any())
    assert not bool(((t >= ord("a")) & (t <= ord("z"))).any())
    assert int(_first_batch(_file_job("fine", [data]), srv.socket)["step"]) == 0


def test_data_roots_refuse_paths_outside_them_after_resolving_symlinks(server_factory, tmp_path):
    roots = tmp_path / "data"
    inside = _jsonl(roots / "ok.jsonl")
    secret = _jsonl(tmp_path / "secret" / "s.jsonl")
    (roots / "link.jsonl").symlink_to(secret)
    (roots / "linkdir").symlink_to(tmp_path / "secret")
    srv = server_factory(extra=f'data_roots = ["{roots}"]\n').start()
    for paths in (
        [secret],
        [str(roots / "link.jsonl")],
        [str(roots / "linkdir")],
        [f"{roots}/*/../../secret/*.jsonl"],
        [str(roots)],  # a directory under the root holding a symlink out of it
    ):
        with pytest.raises(ConfigError, match=r"lies outside \[node\] data_roots"):
            _first_batch(_file_job("out", paths), srv.socket)
    (roots / "link.jsonl").unlink()
    (roots / "linkdir").unlink()
    assert int(_first_batch(_file_job("in", [inside]), srv.socket)["step"]) == 0
    assert int(_first_batch(_file_job("dir", [str(roots)]), srv.socket)["step"]) == 0
    assert srv.proc is not None
    assert srv.proc.poll() is None


def test_validate_checks_a_job_against_the_nodes_settings(tmp_path):
    data = _jsonl(tmp_path / "data" / "d.jsonl")
    job = tmp_path / "job.toml"
    job.write_text(_file_job("v", [data], transform="os:system('id')").to_toml())
    node = tmp_path / "node.toml"
    node.write_text(f'[node]\nsocket = "{tmp_path}/s.sock"\n')
    out = cli("validate", "--config", str(node), "--job", str(job))
    assert out.returncode == 2
    assert "is not allowed on this node" in out.stderr
    assert "allow_transforms" in out.stderr
    node.write_text(f'[node]\nsocket = "{tmp_path}/s.sock"\ndata_roots = ["{tmp_path}/elsewhere"]\n')
    job.write_text(_file_job("v", [data]).to_toml())
    out = cli("validate", "--config", str(node), "--job", str(job))
    assert out.returncode == 2, out.stderr
    assert "lies outside [node] data_roots" in out.stderr, out.stderr
    node.write_text(f'[node]\nsocket = "{tmp_path}/s.sock"\ndata_roots = ["data"]\n')  # relative: to node.toml
    out = cli("validate", "--config", str(node), "--job", str(job))
    assert out.returncode == 0, out.stderr


def test_node_config_names_bad_admission_settings():
    from msdata_server.config import parse_config

    with pytest.raises(ConfigError, match=r"\[node\] allow_transforms = 'tests' must be a list"):
        parse_config({"node": {"allow_transforms": "tests"}})
    with pytest.raises(ConfigError, match=r"allow_transforms entry 'os:system\(1\)' must be a module prefix"):
        parse_config({"node": {"allow_transforms": ["os:system(1)"]}})
    with pytest.raises(ConfigError, match=r"data_roots entry 'data' must be an absolute path"):
        parse_config({"node": {"data_roots": ["data"]}})
