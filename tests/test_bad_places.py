"""Bad input from the operator (issue 25, item 11): a socket directory under a file or in /proc is one clear
error line from both `validate` and `serve`, never a traceback (and `validate` no longer says OK)."""

from __future__ import annotations

import subprocess
import sys

import pytest

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
    assert "Traceback" not in res.stderr and "OK" not in res.stdout, res.stderr
    errors = [line for line in res.stderr.splitlines() if "error:" in line]
    assert len(errors) == 1 and "cannot make the client socket" in errors[0] and "[node] socket" in errors[0], errors
