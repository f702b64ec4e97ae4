"""Shared fixtures: real server processes on temp sockets, and a guard that fails any test leaving
msdata shared-memory segments behind."""

from __future__ import annotations

import asyncio
import os
import secrets
import selectors
import shutil
import subprocess
import sys
import tempfile
import textwrap
import time
from pathlib import Path

import orjson
import pytest
from hypothesis import settings

from msdata_server.shm import list_segments, owner_alive

ROOT = Path(__file__).resolve().parents[1]

# The suite is deterministic: Hypothesis draws the same examples on every run (a search for new failures is
# `HYPOTHESIS_PROFILE=explore make test`, which draws fresh ones and should be run before a release).
settings.register_profile("ci", derandomize=True, print_blob=True)
settings.register_profile("explore", derandomize=False, print_blob=True)
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "ci"))


@pytest.fixture(autouse=True)
def no_shm_leaks():
    """Fail a test that leaves msdata segments in /dev/shm (the creator must unlink).

    Counts only segments of this process or of processes that are gone (this test's servers and workers);
    a live process's segments belong to someone else running at the same time.
    """
    before = {n for n, _ in list_segments()}
    yield
    left = [
        n
        for n, info in list_segments()
        if n not in before and (info.get("pid") == os.getpid() or not owner_alive(info))
    ]
    if left:
        for n in left:  # do not poison the next test
            try:
                os.unlink(os.path.join("/dev/shm", n))
            except OSError:
                pass
        pytest.fail(f"test left shared-memory segments behind: {left}")


@pytest.fixture(params=["asyncio", "uvloop"])
def arun(request):
    """Run a coroutine on asyncio or uvloop; fail on exceptions nobody retrieved."""
    errors = []

    def run(coro):
        def handler(loop, ctx):
            errors.append(ctx)

        async def main():
            asyncio.get_running_loop().set_exception_handler(handler)
            return await coro

        if request.param == "uvloop":
            import uvloop

            return uvloop.run(main())
        return asyncio.run(main())

    yield run
    assert not errors, f"unretrieved exceptions in the event loop: {errors}"


@pytest.fixture
def sockdir():
    d = tempfile.mkdtemp(prefix="msd-")  # short: Unix socket paths are limited to 107 bytes
    yield d
    shutil.rmtree(d, ignore_errors=True)


_STARTED: list[ServerProc] = []  # the server processes the running test started (their logs join its failure)
_LOG_TAIL = 60  # lines of each server's log shown under a failed test


@pytest.fixture(autouse=True)
def _servers_of_this_test():
    _STARTED.clear()
    yield
    _STARTED.clear()


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    """A test that failed (a timeout too) shows the end of each server log it made: CI keeps only its output,
    and the temp directories holding the logs are gone by then."""
    outcome = yield
    rep = outcome.get_result()
    if call.when != "call" or not rep.failed:
        return
    for srv in list(_STARTED):
        tail = srv.log().splitlines()[-_LOG_TAIL:]
        if tail:
            rep.sections.append((f"server log {srv.dir} (last {len(tail)} lines)", "\n".join(tail)))


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
        if self not in _STARTED:
            _STARTED.append(self)
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


@pytest.fixture
def server_factory(sockdir):
    servers = []

    def make(**kw) -> ServerProc:
        d = tempfile.mkdtemp(prefix="msd-", dir=sockdir) if servers else sockdir
        s = ServerProc(d, **kw)
        servers.append(s)
        return s

    yield make
    for s in servers:
        try:
            s.stop()
        except Exception:
            s.kill()
        if s.proc is not None and s.proc.stdout:
            s.proc.stdout.close()
