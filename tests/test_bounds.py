"""Bounded memory per client and per sample (issue 25, item 10): a client's frames ([node] max_client_frame_kib,
client_buffer_mib, frame_timeout), how far a job plans ahead ([node] max_prefetch_steps), how many pixels an
image may decode to ([node] max_image_pixels), and a closed job's queued transform work (cancelled)."""

from __future__ import annotations

import socket
import struct

import pytest

import msdata_client as msd
from msdata_client.wire import FrameReader, encode, recv_into_reader

from .e2e_util import small_job
from .polling import wait_for


def _connect(path: str) -> socket.socket:
    s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    s.settimeout(30)
    s.connect(path)
    return s


def _reply(s: socket.socket) -> dict:
    r = FrameReader()
    while (f := r.next_frame()) is None:
        recv_into_reader(s, r)
    return f


def _partial(path: str, announced: int, sent: int) -> socket.socket:
    """A connection that announced a frame of ``announced`` bytes and sent ``sent`` of them."""
    s = _connect(path)
    try:
        s.sendall(struct.pack(">I", announced) + b"x" * sent)
    except OSError:
        pass  # refused and closed while it was still sending: its reply says why
    return s


def test_a_client_frame_over_the_limit_is_refused_at_once(server_factory):
    srv = server_factory(extra="max_client_frame_kib = 64\n").start()
    with _partial(srv.socket, (64 << 10) + 1, 10) as s:
        err = _reply(s)
    assert err["t"] == "error" and "max_client_frame_kib = 64 KiB" in err["message"], err
    hello = small_job(dp=1)  # a real client's frames (a hello with its job) fit far below it
    with msd.DataClient(hello, endpoint=srv.socket, rank=0, world_size=1) as c:
        next(c)


def test_a_frame_left_half_sent_is_dropped_after_frame_timeout(server_factory):
    srv = server_factory(extra="frame_timeout = 0.5\n").start()
    with _partial(srv.socket, 1000, 10) as s:
        err = _reply(s)  # the server answers by itself: the client sent nothing more
    assert err["t"] == "error" and "frame_timeout" in err["message"] and "14 bytes" in err["message"], err
    with _connect(srv.socket) as s:  # an idle connection without a partial frame is left alone
        s.sendall(encode({"t": "ping"}))
        assert _reply(s)["t"] == "pong"
        s.settimeout(1.5)
        with pytest.raises(TimeoutError):
            s.recv(1)
        s.sendall(encode({"t": "ping"}))
        assert _reply(s)["t"] == "pong"


def test_partial_frames_of_all_clients_are_capped_node_wide(server_factory):
    srv = server_factory(extra="client_buffer_mib = 1\nmax_client_frame_kib = 1024\n").start()
    held = [_partial(srv.socket, 1 << 20, 300 << 10) for _ in range(3)]  # 900 KiB held: under the cap
    with _connect(srv.socket) as s:  # each was read before this one's ping was answered (one loop, in order)
        s.sendall(encode({"t": "ping"}))
        assert _reply(s)["t"] == "pong"
    over = _partial(srv.socket, 1 << 20, 300 << 10)
    err = _reply(over)
    assert err["t"] == "error" and "client_buffer_mib = 1 MiB" in err["message"], err
    for s in [*held, over]:
        s.close()
    wait_for(lambda: "client_buffer_mib" in srv.log(), 10, "the dropped client logged")


def _rss_kib(pid: int) -> int:
    with open(f"/proc/{pid}/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith("VmRSS:"))


def test_idle_partial_frames_do_not_pin_memory(server_factory):
    """Twelve connections that each announce a 16 MiB frame and send most of it: before the bounds the server
    held all of it (+190 MB); now each is refused at its 4-byte header (the default frame limit is 4 MiB)."""
    srv = server_factory().start()
    assert srv.proc is not None
    base = _rss_kib(srv.proc.pid)
    conns, errors = [], []
    for _ in range(12):
        s = _partial(srv.socket, (16 << 20) - 8, (16 << 20) - 16)
        errors.append(_reply(s))
        conns.append(s)
    grown = _rss_kib(srv.proc.pid) - base
    for s in conns:
        s.close()
    assert all(e["t"] == "error" and "max_client_frame_kib" in e["message"] for e in errors), errors[0]
    assert grown < 64 << 10, f"the server grew by {grown} KiB with 12 partial frames"


def test_prefetch_steps_is_bounded(server_factory):
    with pytest.raises(msd.ConfigError, match=r"prefetch_steps=100000 must be an integer in 1\.\.4096"):
        small_job(dp=1, prefetch=100_000)
    srv = server_factory(extra="max_prefetch_steps = 4\n").start()
    with pytest.raises(msd.ConfigError, match=r"prefetch_steps = 5 is over .* max_prefetch_steps = 4"):
        with msd.DataClient(small_job(dp=1, prefetch=5), endpoint=srv.socket, rank=0, world_size=1) as c:
            next(c)
    with msd.DataClient(small_job("near", dp=1, prefetch=4), endpoint=srv.socket, rank=0, world_size=1) as c:
        next(c)
