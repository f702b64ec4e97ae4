"""The command line: validate, serve's config errors, status without a server."""

import subprocess
import sys
import textwrap

import pyarrow as pa
import pyarrow.parquet as pq


def cli(*args, cwd=None):
    return subprocess.run(
        [sys.executable, "-m", "msdata_server", *args], capture_output=True, text=True, cwd=cwd, timeout=120
    )


def _job(tmp_path, paths):
    p = tmp_path / "job.toml"
    p.write_text(
        textwrap.dedent(f"""\
        [job]
        name = "v"
        seq_len = 512
        [mesh]
        dp = 1
        [[source]]
        name = "web"
        format = "parquet"
        paths = {paths!r}
        [mix]
        weights = {{ web = 1.0 }}
        """).replace("'", '"')
    )
    return p


def test_validate_good_config_and_job(tmp_path):
    (tmp_path / "data").mkdir()
    pq.write_table(pa.table({"text": ["a", "bb", "ccc"]}), tmp_path / "data" / "x.parquet")
    node = tmp_path / "node.toml"
    node.write_text(f'[node]\nid = "n1"\nsocket = "{tmp_path}/s.sock"\n')
    out = cli("validate", "--config", str(node), "--job", str(_job(tmp_path, ["data/"])))
    assert out.returncode == 0, out.stderr
    assert "node config OK" in out.stdout
    assert "source web (parquet): 3 samples" in out.stdout


def test_validate_names_the_bad_key_and_the_missing_data(tmp_path):
    node = tmp_path / "node.toml"
    node.write_text("[node]\nworkrs = 2\n")
    out = cli("validate", "--config", str(node))
    assert out.returncode == 2
    assert "workrs" in out.stderr
    assert "allowed keys" in out.stderr
    node.write_text(f'[node]\nsocket = "{tmp_path}/s.sock"\n')
    out = cli("validate", "--config", str(node), "--job", str(_job(tmp_path, ["nowhere/*.parquet"])))
    assert out.returncode == 2
    assert "web" in out.stderr
    assert "nowhere" in out.stderr


def test_serve_refuses_a_bad_config_clearly(tmp_path):
    node = tmp_path / "node.toml"
    node.write_text('[node]\nlisten = "not-an-address"\n')
    out = cli("serve", "--config", str(node))
    assert out.returncode == 2
    assert "HOST:PORT" in out.stderr


def test_status_without_a_server_says_where_it_looked(tmp_path):
    out = cli("status", "--endpoint", str(tmp_path / "none.sock"))
    assert out.returncode == 2
    assert "none.sock" in out.stderr


def test_status_and_health_read_the_socket_from_config(server_factory):
    """The node.toml a user served with tells status and health where the socket is (no --endpoint)."""
    import json
    import os

    srv = server_factory().start()
    env = {k: v for k, v in os.environ.items() if k != "MSDATA_ENDPOINT"}
    got = {}
    for cmd in ("status", "health"):
        extra = ["--json"] if cmd == "status" else []
        args = [sys.executable, "-m", "msdata_server", cmd, "--config", srv.config, *extra]
        got[cmd] = subprocess.run(args, capture_output=True, text=True, timeout=120, env=env)
        assert got[cmd].returncode == 0, got[cmd].stderr
    assert json.loads(got["status"].stdout)["node"] == "test-node"
    assert got["health"].stdout.startswith("ok: node test-node")


def test_one_shot_status_prints_a_table_with_the_mixture(server_factory):
    """`status` prints the --watch table once (no raw dicts, no 16-digit floats); `--json` has each source's
    target and delivered share."""
    import json
    import re

    import msdata_client as msd

    from .e2e_util import small_job

    srv = server_factory().start()
    spec = small_job("mixview", dp=1)
    dc = msd.DataClient(spec, endpoint=srv.socket, rank=0, world_size=1, connect_timeout=30)
    for _ in range(6):
        next(dc)  # the job stays while its rank is connected
    base = [sys.executable, "-m", "msdata_server", "status", "--endpoint", srv.socket]
    text = subprocess.run(base, capture_output=True, text=True, timeout=120)
    assert text.returncode == 0, text.stderr
    assert "{" not in text.stdout, text.stdout
    assert not re.search(r"\d\.\d{6,}", text.stdout), text.stdout
    assert re.search(r"^  source\s+target\s+delivered", text.stdout, re.M), text.stdout
    assert re.search(r"^  a\s+40\.0%\s+\d+\.\d%", text.stdout, re.M), text.stdout
    st = json.loads(subprocess.run([*base, "--json"], capture_output=True, text=True, timeout=120).stdout)
    mix = st["jobs"][0]["mixture"]
    assert mix["a"]["target"] == 0.4
    assert mix["b"]["target"] == 0.6
    assert abs(mix["a"]["delivered"] + mix["b"]["delivered"] - 1.0) < 1e-3
    assert {"node", "role", "jobs"} <= set(st)
    dc.close()
