"""Issue 25's hardening, against real server processes: what a client may make the server run and read, the
socket directory and the server's identity, read-only ring descriptors, the token file's mode, mixture
weights."""

from __future__ import annotations

import secrets
import subprocess
import sys
import textwrap

from tests.conftest import ROOT


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
        assert f"token_file {str(token)!r} has mode 0644" in out.stderr and f"chmod 600 {token}" in out.stderr, cmd
    token.chmod(0o600)
    out = cli("validate", "--config", str(node))
    assert out.returncode == 0, out.stderr
