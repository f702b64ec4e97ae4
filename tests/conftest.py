"""Shared fixtures: real server processes on temp sockets, a real etcd, clusters of servers on it, and a guard that
fails any test leaving msdata shared-memory segments behind. Test modules take them as arguments (no import)."""

from __future__ import annotations

import asyncio
import contextlib
import os
import secrets
import shutil
import tempfile
from pathlib import Path

import pytest
from hypothesis import settings

from msdata_server.shm import list_segments, owner_alive

from .cluster_util import Cluster
from .etcd_fixture import EtcdServer
from .server_util import STARTED, ServerProc

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
            with contextlib.suppress(OSError):
                os.unlink(os.path.join("/dev/shm", n))
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


_LOG_TAIL = 60  # lines of each server's log shown under a failed test


@pytest.fixture(autouse=True)
def _servers_of_this_test():
    STARTED.clear()
    yield
    STARTED.clear()


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    """A test that failed (a timeout too) shows the end of each server log it made: CI keeps only its output,
    and the temp directories holding the logs are gone by then."""
    outcome = yield
    rep = outcome.get_result()
    if call.when != "call" or not rep.failed:
        return
    for srv in list(STARTED):
        tail = srv.log().splitlines()[-_LOG_TAIL:]
        if tail:
            rep.sections.append((f"server log {srv.dir} (last {len(tail)} lines)", "\n".join(tail)))


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


@pytest.fixture(scope="module")
def etcd_server():
    """One etcd shared by a test module; tests keep apart with their own key prefix."""
    d = tempfile.mkdtemp(prefix="msd-etcd-")
    srv = EtcdServer(d).start()
    yield srv
    srv.stop()
    shutil.rmtree(d, ignore_errors=True)


@pytest.fixture
def fresh_etcd(tmp_path):
    """An etcd of this test alone, which it may stop, restart or freeze."""
    srv = EtcdServer(tmp_path).start()
    yield srv
    srv.stop()


@pytest.fixture
def cluster_factory():
    """``make(etcd_url, n=3, token=None)``: a Cluster of n node servers (not started); all stopped at the end."""
    made = []

    def make(etcd_url: str, n: int = 3, **kw) -> Cluster:
        d = Path(os.path.join("/tmp", "msdc-" + secrets.token_hex(4)))  # short: socket paths are limited
        d.mkdir()
        c = Cluster(d, etcd_url, n, **kw)
        made.append(c)
        return c

    yield make
    for c in made:
        c.stop()
        shutil.rmtree(c.base, ignore_errors=True)
