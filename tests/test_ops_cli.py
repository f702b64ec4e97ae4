"""`msdata-server health` and `status --watch` in a subprocess, against a socket where nothing listens and a
stand-in server that answers status requests the way the node does (one frame per request)."""

from __future__ import annotations

import os
import selectors
import signal
import socket
import subprocess
import sys
import threading

import orjson
import pytest

from msdata_client.errors import MsdataError
from msdata_client.wire import FrameReader, encode, recv_into_reader

from .status_sample import SAMPLE


def cli(*args: str, timeout: float = 60) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "msdata_server", *args],
        capture_output=True,
        text=True,
        check=False,
        timeout=timeout,
        env={**os.environ, "COLUMNS": "200"},
    )


class StatusServer:
    """A Unix socket answering every request frame with ``{"t": "status", "status": status}`` (or ``reply``)."""

    def __init__(self, path: str, status: dict | None = None, *, reply: dict | None = None):
        self.path = path
        self.reply = reply if reply is not None else {"t": "status", "status": status}
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self.sock.bind(path)
        self.sock.listen()
        self.sock.settimeout(0.1)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._serve, name="status-server")
        self._thread.start()

    def _serve(self) -> None:
        while not self._stop.is_set():
            try:
                conn, _ = self.sock.accept()
            except TimeoutError:
                continue
            with conn:
                conn.settimeout(5)
                reader = FrameReader()
                try:
                    while reader.next_frame() is None:
                        recv_into_reader(conn, reader)
                    conn.sendall(encode(self.reply))
                except (OSError, MsdataError):
                    pass  # the client went away: serve the next one

    def close(self) -> None:
        self._stop.set()
        self._thread.join(10)
        self.sock.close()


@pytest.fixture
def server(sockdir):
    made = []

    def make(status: dict | None = None, **kw) -> StatusServer:
        s = StatusServer(os.path.join(sockdir, f"s{len(made)}.sock"), status, **kw)
        made.append(s)
        return s

    yield make
    for s in made:
        s.close()


def test_health_fails_where_nothing_listens(sockdir):
    dead = os.path.join(sockdir, "dead.sock")
    s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    s.bind(dead)  # a socket file left behind: bound, nobody accepting
    s.close()
    for path in (dead, os.path.join(sockdir, "missing.sock")):
        out = cli("health", "--endpoint", path, "--timeout", "2")
        assert out.returncode == 1, out
        assert out.stderr.count("\n") == 1
        assert f"no status from {path!r}" in out.stderr


def test_health_passes_for_a_known_role_and_fails_without_one(server):
    ok = cli("health", "--endpoint", server(SAMPLE).path)
    assert ok.returncode == 0, ok
    assert ok.stdout.startswith("ok: node node-0 role leader"), ok
    starting = cli("health", "--endpoint", server({**SAMPLE, "role": None}).path)
    assert starting.returncode == 1
    assert "has no role yet" in starting.stderr
    assert starting.stderr.count("\n") == 1
    refused = cli("health", "--endpoint", server(reply={"t": "error", "message": "nope"}).path)
    assert refused.returncode == 1
    assert "answered 'error'" in refused.stderr


def test_status_and_status_json_are_unchanged(server):
    path = server(SAMPLE).path
    out = cli("status", "--endpoint", path, "--json")
    assert out.returncode == 0
    assert orjson.loads(out.stdout) == SAMPLE
    assert out.stdout.count("\n") == 1
    plain = cli("status", "--endpoint", path)
    assert plain.returncode == 0
    assert plain.stdout.startswith("node node-0  role leader  pid 4242")


def test_status_watch_redraws_until_interrupted(server):
    path = server(SAMPLE).path
    proc = subprocess.Popen(
        [sys.executable, "-m", "msdata_server", "status", "--watch", "--interval", "0.1", "--endpoint", path],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        sel = selectors.DefaultSelector()
        sel.register(proc.stdout, selectors.EVENT_READ)
        lines: list[str] = []
        while sum("job pretrain [running]" in line for line in lines) < 2:
            assert sel.select(30), f"no second frame; got {lines}"
            lines.append(proc.stdout.readline())
        proc.send_signal(signal.SIGINT)
        rest, _ = proc.communicate(timeout=30)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert proc.returncode == 0  # Ctrl-C is how one leaves the screen
    screen = "".join(lines) + rest
    assert "\x1b[" not in screen  # not a terminal: no clearing
    assert all(len(line) <= 80 for line in screen.splitlines())


def test_status_watch_refuses_json_and_a_bad_interval(sockdir):
    out = cli("status", "--watch", "--json", "--endpoint", os.path.join(sockdir, "x.sock"))
    assert out.returncode == 2
    assert "does not combine with --json" in out.stderr
    out = cli("status", "--watch", "--interval", "0")
    assert out.returncode == 2
    assert "'0' must be a number of seconds > 0" in out.stderr
