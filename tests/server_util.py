"""A real `msdata-server serve` subprocess on a temp socket, awaited through its readiness line; the servers the
running test started (conftest shows their logs under a failed test)."""

from __future__ import annotations

import os
import secrets
import selectors
import shutil
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import orjson

ROOT = Path(__file__).resolve().parents[1]

STARTED: list[ServerProc] = []  # the server processes the running test started (their logs join its failure)


class ServerProc:
    """A real `msdata-server serve` subprocess, awaited through its readiness line."""

    def __init__(
        self, sockdir: str, *, workers: int = 0, extra: str = "", prefix: str | None = None, shm_mib: int | None = None
    ):
        self.shm_mib = shm_mib  # run the server in a private mount namespace with a /dev/shm this small
        self.dir = sockdir
        self.socket = os.path.join(sockdir, "msdata.sock")
        self.prefix = prefix or "t" + secrets.token_hex(3)
        self.config = os.path.join(sockdir, "node.toml")
        Path(self.config).write_text(
            textwrap.dedent(f"""\
            [node]
            id = "test-node"
            socket = "{self.socket}"
            shm_prefix = "{self.prefix}"
            workers = {workers}
            drain_timeout = 5.0
            """)
            + extra
        )
        self.proc: subprocess.Popen | None = None
        self.ready: dict | None = None

    def start(self, timeout: float = 60.0) -> ServerProc:
        env = dict(os.environ, PYTHONUNBUFFERED="1")
        if self.proc is not None and self.proc.stdout:
            self.proc.stdout.close()
        cmd = [sys.executable, "-m", "msdata_server", "serve", "--config", self.config]
        if self.shm_mib is not None:
            cmd = [
                "unshare",
                "-m",
                "sh",
                "-c",
                f"mount -t tmpfs -o size={self.shm_mib}M tmpfs /dev/shm && exec " + " ".join(cmd),
            ]
        with open(os.path.join(self.dir, "server.log"), "ab") as log:
            self.proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=log, env=env, cwd=str(ROOT))
        if self not in STARTED:
            STARTED.append(self)
        line = _readline(self.proc, timeout)
        if not line:
            raise RuntimeError(f"server did not become ready; log:\n{self.log()}")
        self.ready = orjson.loads(line)
        assert self.ready["event"] == "ready"
        return self

    def log(self) -> str:
        try:
            return Path(self.dir, "server.log").read_text()
        except OSError:
            return ""

    def stop(self, sig=15, timeout: float = 30.0) -> int:
        if self.proc is None or self.proc.poll() is not None:
            return self.proc.returncode if self.proc else 0
        self.proc.send_signal(sig)
        try:
            return self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
            raise

    def kill(self) -> None:
        if self.proc and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()


def _readline(proc: subprocess.Popen, timeout: float) -> bytes:
    sel = selectors.DefaultSelector()
    sel.register(proc.stdout, selectors.EVENT_READ)
    buf = b""
    deadline = time.monotonic() + timeout
    while b"\n" not in buf:
        left = deadline - time.monotonic()
        if left <= 0 or not sel.select(left):
            return b""
        chunk = os.read(proc.stdout.fileno(), 4096)
        if not chunk:
            return b""
        buf += chunk
    return buf.split(b"\n", 1)[0]


def can_unshare() -> bool:
    """Whether ``unshare -m`` works here (root): a server can then get a /dev/shm of its own (``shm_mib``)."""
    if shutil.which("unshare") is None:
        return False
    r = subprocess.run(["unshare", "-m", "true"], capture_output=True)
    return r.returncode == 0
