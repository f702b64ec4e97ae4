"""Bounded memory per client and per sample (issue 25, item 10): a client's frames ([node] max_client_frame_kib,
client_buffer_mib, frame_timeout), how far a job plans ahead ([node] max_prefetch_steps), how many pixels an
image may decode to ([node] max_image_pixels), and a closed job's queued transform work (cancelled)."""

from __future__ import annotations

import asyncio
import contextlib
import functools
import io
import secrets
import socket
import struct
import time

import numpy as np
import pytest

import msdata_client as msd
from msdata_client.wire import FrameReader, encode, recv_into_reader
from msdata_server.config import parse_config
from msdata_server.errors import ConfigError
from msdata_server.pool import WorkerPool
from msdata_server.sources import BadSample
from msdata_server.transforms import MAX_IMAGE_PIXELS_ENV, image_patches, run_transform, vlm

from .aio import LOOPS, run
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
    with contextlib.suppress(OSError):  # refused and closed while it was still sending: its reply says why
        s.sendall(struct.pack(">I", announced) + b"x" * sent)
    return s


def test_a_client_frame_over_the_limit_is_refused_at_once(server_factory):
    srv = server_factory(extra="max_client_frame_kib = 64\n").start()
    with _partial(srv.socket, (64 << 10) + 1, 10) as s:
        err = _reply(s)
    assert err["t"] == "error", err
    assert "max_client_frame_kib = 64 KiB" in err["message"], err
    hello = small_job(dp=1)  # a real client's frames (a hello with its job) fit far below it
    with msd.DataClient(hello, endpoint=srv.socket, rank=0, world_size=1) as c:
        next(c)


def test_a_frame_left_half_sent_is_dropped_after_frame_timeout(server_factory):
    srv = server_factory(extra="frame_timeout = 0.5\n").start()
    with _partial(srv.socket, 1000, 10) as s:
        err = _reply(s)  # the server answers by itself: the client sent nothing more
    assert err["t"] == "error", err
    assert "frame_timeout" in err["message"], err
    assert "14 bytes" in err["message"], err
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
    assert err["t"] == "error", err
    assert "client_buffer_mib = 1 MiB" in err["message"], err
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
    with pytest.raises(msd.ConfigError, match=r"prefetch_steps=100000 is over 4096; plan 1\.\.4096 steps ahead"):
        small_job(dp=1, prefetch=100_000)
    srv = server_factory(extra="max_prefetch_steps = 4\n").start()
    with (
        pytest.raises(msd.ConfigError, match=r"prefetch_steps = 5 is over .* max_prefetch_steps = 4"),
        msd.DataClient(small_job(dp=1, prefetch=5), endpoint=srv.socket, rank=0, world_size=1) as c,
    ):
        next(c)
    with msd.DataClient(small_job("near", dp=1, prefetch=4), endpoint=srv.socket, rank=0, world_size=1) as c:
        next(c)


# ---- one sample's image: bounded before its pixels are decoded ------------------------------------------------
def _image(fmt: str, w: int, h: int) -> bytes:
    from PIL import Image

    buf = io.BytesIO()
    Image.new("RGB", (w, h), (200, 30, 90)).save(buf, fmt)
    return buf.getvalue()


def test_an_image_over_max_image_pixels_is_an_oversize_bad_sample(monkeypatch):
    monkeypatch.setenv(MAX_IMAGE_PIXELS_ENV, str(300 * 300))
    png, jpeg = _image("PNG", 400, 400), _image("JPEG", 1600, 1600)
    out = run_transform(functools.partial(image_patches, patch=8, grid=(4, 4)), [png, jpeg], seed=0, sample_ids=[0, 1])
    assert isinstance(out[0], BadSample), out[0]
    assert out[0].reason == "oversize", out[0]
    assert "max_image_pixels = 90000" in out[0].detail
    assert out[1].shape == (16, 8 * 8 * 3)  # 2.56 Mpx, but decoded at 1/8 (200 x 200) by DCT scaling
    out = run_transform(
        vlm(max_pixels=56 * 56 * 4),
        [{"image": png, "caption": b"x"}, {"image": jpeg, "caption": b"x"}],
        seed=0,
        sample_ids=[0, 1],
    )
    assert isinstance(out[0], BadSample), out[0]
    assert out[0].reason == "oversize", out[0]
    assert not isinstance(out[1], BadSample), out[1]


def test_max_image_pixels_is_a_node_setting():
    assert parse_config({}).node.max_image_pixels == 50_000_000
    with pytest.raises(ConfigError, match="max_image_pixels = 0 must be an integer"):
        parse_config({"node": {"max_image_pixels": 0}})


# ---- a closed job's queued transform work: cancelled, not run ---------------------------------------------
def slow_mark(record, **_):
    """Append a byte to the file the record names, then take a while (a costly decode)."""
    with open(bytes(record), "ab") as f:
        f.write(b".")
    time.sleep(0.1)
    return np.zeros(1, dtype=np.int32)


@pytest.mark.parametrize("loop", LOOPS)
def test_cancelled_transform_work_leaves_the_queue(tmp_path, loop):
    marks = tmp_path / "marks"
    marks.write_bytes(b"")
    records = [str(marks).encode()] * 40

    async def main():
        async with WorkerPool(1, max_task=1, shm_prefix="msdb" + secrets.token_hex(3)) as pool:
            job = asyncio.create_task(pool.transform(f"{__name__}:slow_mark", records, seed=0, sample_ids=range(40)))
            while marks.stat().st_size == 0:  # noqa: ASYNC110  (polls another process's state)
                await asyncio.sleep(0.01)
            job.cancel()  # what a closing job does to its constructors
            with pytest.raises(asyncio.CancelledError):
                await job
            assert pool.statistics().queued == 0
            # FIFO with one worker: this runs after the task already on the worker, before any of the rest
            await pool.transform(f"{__name__}:slow_mark", records[:1], seed=0, sample_ids=[99])
        return marks.stat().st_size

    ran = run(main(), loop)
    assert ran <= 3, f"{ran} of the closed job's 40 samples were transformed (39 queued ones should be dropped)"
