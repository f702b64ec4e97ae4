"""systemd notify: messages on a real datagram socket, the abstract namespace, no-ops without systemd, and a
watchdog that goes quiet while the event loop is blocked."""

from __future__ import annotations

import asyncio
import os
import secrets
import socket
import time

import pytest

from msdata_server.ops.sdnotify import Notifier, notify


@pytest.fixture
def listener(sockdir):
    """A datagram socket bound where systemd would listen; yields (path, socket)."""
    path = os.path.join(sockdir, "notify.sock")
    s = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    s.bind(path)
    s.settimeout(5)
    yield path, s
    s.close()


def _drain(s: socket.socket) -> list[str]:
    """Every datagram waiting now, without blocking."""
    got, timeout = [], s.gettimeout()
    s.setblocking(False)
    try:
        while True:
            got.append(s.recv(4096).decode())
    except BlockingIOError:
        return got
    finally:
        s.settimeout(timeout)


def test_messages_arrive_in_order(listener):
    path, s = listener
    n = Notifier({"NOTIFY_SOCKET": path})
    assert n.enabled
    assert n.ready()
    assert n.watchdog()
    assert n.status("draining")
    assert n.stopping()
    n.ready(status="serving 2 jobs")
    assert [s.recv(4096).decode() for _ in range(5)] == [
        "READY=1",
        "WATCHDOG=1",
        "STATUS=draining",
        "STOPPING=1",
        "READY=1\nSTATUS=serving 2 jobs",
    ]
    n.close()
    n.close()  # idempotent
    assert not n.ready()
    assert _drain(s) == []


def test_abstract_namespace_and_one_shot_notify():
    name = "msd-test-" + secrets.token_hex(4)
    s = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    with s:
        s.bind("\0" + name)
        s.settimeout(5)
        assert notify("READY=1", env={"NOTIFY_SOCKET": "@" + name})
        assert s.recv(4096) == b"READY=1"


def test_everything_is_a_no_op_without_notify_socket(arun):
    n = Notifier({"WATCHDOG_USEC": "1000000"})
    assert not n.enabled
    assert n.watchdog_interval is None
    assert not (n.ready())
    assert not (n.watchdog())
    assert not (n.stopping())
    assert notify("READY=1", env={}) is False
    arun(asyncio.wait_for(n.watchdog_loop(), 5))  # returns at once instead of looping


def test_a_vanished_socket_does_not_raise(sockdir):
    with Notifier({"NOTIFY_SOCKET": os.path.join(sockdir, "gone.sock")}) as n:
        assert n.ready() is False


def test_watchdog_interval_is_half_of_watchdog_usec_and_honours_watchdog_pid(listener):
    path, _ = listener
    env = {"NOTIFY_SOCKET": path, "WATCHDOG_USEC": "30000000"}

    def interval(e: dict) -> float | None:
        with Notifier(e) as n:
            return n.watchdog_interval

    assert interval(env) == 15.0
    assert interval({**env, "WATCHDOG_PID": str(os.getpid())}) == 15.0
    assert interval({**env, "WATCHDOG_PID": "1"}) is None  # meant for another process
    assert interval({**env, "WATCHDOG_USEC": "soon"}) is None
    assert interval({"NOTIFY_SOCKET": path}) is None


def test_watchdog_pings_stop_while_the_loop_is_blocked(listener, arun):
    path, s = listener
    n = Notifier({"NOTIFY_SOCKET": path, "WATCHDOG_USEC": "40000"})  # a ping every 20 ms
    during: list[str] = []

    def block() -> None:
        _drain(s)  # what came before the block
        time.sleep(0.4)  # about 20 pings' worth
        during.extend(_drain(s))  # the pings sent while the loop was blocked: none, if they come from the loop

    async def main() -> list[str]:
        loop = asyncio.get_running_loop()
        s.setblocking(False)
        task = asyncio.create_task(n.watchdog_loop())
        try:
            before = [(await asyncio.wait_for(loop.sock_recv(s, 4096), 5)).decode() for _ in range(2)]
            blocked = loop.create_future()
            loop.call_soon(lambda: (block(), blocked.set_result(None)))
            await blocked
            after = (await asyncio.wait_for(loop.sock_recv(s, 4096), 5)).decode()  # pings resume
            return [*before, after]
        finally:
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)

    assert arun(main()) == ["WATCHDOG=1"] * 3
    assert during == []
    n.close()
