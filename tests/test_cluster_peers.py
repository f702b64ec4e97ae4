"""Peer links: authentication, control and payload frames, malformed input, flow control."""

from __future__ import annotations

import asyncio
import logging
import struct

import numpy as np
import orjson
import pytest

from msdata_server.cluster import AuthError, PeerLink, PeerServer, load_token
from msdata_server.cluster.net.peers import CHUNK
from msdata_server.errors import PeerLostError, ProtocolError

from .aio import LOOPS, run

TOKEN = b"s3cret-token-of-the-test-cluster"


class Inbox:
    """Collects what a handler receives (payloads copied) and wakes waiters."""

    def __init__(self):
        self.items: list[tuple[str, dict, bytes | None]] = []
        self.changed = asyncio.Event()

    def __call__(self, peer: str, frame: dict, payload: memoryview | None) -> None:
        self.items.append((peer, frame, None if payload is None else bytes(payload)))
        self.changed.set()

    async def wait(self, n: int, timeout: float = 10.0) -> list:  # noqa: ASYNC109  (event-based, its own deadline)
        async with asyncio.timeout(timeout):
            while len(self.items) < n:
                self.changed.clear()
                await self.changed.wait()
        return self.items


def frame(obj) -> bytes:
    body = orjson.dumps(obj)
    return struct.pack(">I", len(body)) + body


@pytest.mark.parametrize("loop", LOOPS)
def test_control_and_payload_round_trip(loop):
    async def main():
        inbox, back = Inbox(), Inbox()
        server = PeerServer(token=TOKEN, node_id="srv", handler=inbox)
        port = await server.start("127.0.0.1", 0)
        link = await PeerLink.connect("127.0.0.1", port, token=TOKEN, node_id="cli", handler=back)
        try:
            assert link.peer_id == "srv"
            assert link.authenticated
            big = np.random.default_rng(0).integers(0, 256, size=(3 << 20) + 12345, dtype=np.uint8)
            await link.send({"t": "hello-app", "n": 1})
            await link.send_payload({"t": "blob", "i": 0}, big)
            await link.send_payload({"t": "blob", "i": 1}, b"immutable bytes")
            await link.send_payload({"t": "blob", "i": 2}, b"")
            matrix = np.arange(12, dtype=np.int64).reshape(3, 4)
            await link.send_payload({"t": "blob", "i": 3}, matrix)
            await link.send({"t": "end"})
            got = await inbox.wait(6)
            assert [(p, f["t"], f.get("i")) for p, f, _ in got] == [
                ("cli", "hello-app", None),
                ("cli", "blob", 0),
                ("cli", "blob", 1),
                ("cli", "blob", 2),
                ("cli", "blob", 3),
                ("cli", "end", None),
            ]
            assert got[1][1]["nbytes"] == big.nbytes
            assert got[1][2] == big.tobytes()
            assert got[2][2] == b"immutable bytes"
            assert got[3][2] == b""
            assert got[0][2] is None
            assert np.array_equal(np.frombuffer(got[4][2], dtype=np.int64).reshape(3, 4), matrix)
            # the server side can answer on the same link
            assert set(server.links) == {"cli"}
            await server.links["cli"].send_payload({"t": "reply"}, b"pong")
            assert (await back.wait(1))[0] == ("srv", {"t": "reply", "nbytes": 4}, b"pong")
            with pytest.raises(ProtocolError, match="nbytes"):
                await link.send({"t": "x", "nbytes": 3})
        finally:
            await link.aclose()
            await server.aclose()
        with pytest.raises(PeerLostError, match="closed"):
            await link.send({"t": "late"})

    run(main(), loop)


@pytest.mark.parametrize("loop", LOOPS)
def test_wrong_token_is_rejected_both_ways(loop, caplog):
    caplog.set_level(logging.WARNING, logger="msdata_server.cluster.net.peers")

    async def main():
        inbox = Inbox()
        server = PeerServer(token=TOKEN, node_id="srv", handler=inbox)
        port = await server.start()
        try:
            # the client checks the server first: a server without our token is refused by us
            with pytest.raises(AuthError, match="does not hold our token"):
                await PeerLink.connect("127.0.0.1", port, token=b"another-token-entirely!!", node_id="evil")
            # a client that answers the challenge wrongly (it saw the server's proof but cannot make its own)
            r, w = await asyncio.open_connection("127.0.0.1", port)
            w.write(frame({"t": "hello", "v": 1, "node": "mallory", "nonce": "00" * 32}))
            challenge = orjson.loads(await r.readexactly(struct.unpack(">I", await r.readexactly(4))[0]))
            assert challenge["t"] == "challenge"
            w.write(frame({"t": "auth", "mac": "00" * 32}))
            w.write(frame({"t": "work", "x": 1}))  # must never reach the handler
            rest = await r.read()  # the server says why, then closes
            assert b"authentication failed" in rest
            w.close()
            assert inbox.items == []
            assert server.links == {}
        finally:
            await server.aclose()

    run(main(), loop)
    text = caplog.text
    assert "does not hold our token" in text
    assert "mallory" in text


@pytest.mark.parametrize(
    ("data", "why"),
    [
        (frame({"t": "work"}), "sent 'work' before authenticating"),
        (frame({"t": "blob", "nbytes": 4}) + b"data", "sent a payload before authenticating"),
        (struct.pack(">I", 1 << 20) + b"{}", "exceeds 4096 bytes before authentication"),
        (struct.pack(">I", 3) + b"{x}", "not valid JSON"),
        (frame({"t": "hello", "v": 1, "node": "x"}), "malformed handshake frame 'hello'"),
        (b"", "did not complete authentication within 0.2s"),
    ],
)
def test_unauthenticated_peers_are_dropped(data, why, caplog):
    caplog.set_level(logging.WARNING, logger="msdata_server.cluster.net.peers")

    async def main():
        inbox = Inbox()
        server = PeerServer(token=TOKEN, node_id="srv", handler=inbox, auth_timeout=0.2)
        port = await server.start()
        try:
            r, w = await asyncio.open_connection("127.0.0.1", port)
            w.write(data)
            assert await r.read() == b""  # closed without a word
            w.close()
            assert inbox.items == []
            assert server.links == {}
        finally:
            await server.aclose()

    run(main(), "uvloop")
    assert why in caplog.text


@pytest.mark.parametrize(
    ("bad", "why"),
    [
        (struct.pack(">I", (16 << 20) + 1), "exceeds"),
        (frame([1, 2]), 'string "t"'),
        (struct.pack(">I", 5) + b"{nope", "not valid JSON"),
        (frame({"t": "blob", "nbytes": -1}), "nbytes=-1"),
        (frame({"t": "blob", "nbytes": "3"}), "nbytes='3'"),
        (frame({"t": "blob", "nbytes": 100}) + b"short", "mid-payload: got 5 of 100"),
        (frame({"t": "half"})[:-2], "inside a frame"),
    ],
)
def test_malformed_frames_close_only_their_link(bad, why, caplog):
    caplog.set_level(logging.WARNING, logger="msdata_server.cluster.net.peers")

    async def main():
        inbox = Inbox()
        server = PeerServer(token=TOKEN, node_id="srv", handler=inbox)
        port = await server.start()
        good = await PeerLink.connect("127.0.0.1", port, token=TOKEN, node_id="good")
        evil = await PeerLink.connect("127.0.0.1", port, token=TOKEN, node_id="evil")
        try:
            await evil.send({"t": "fine"})
            await inbox.wait(1)
            evil._transport.write(bad)  # bypass the encoder
            if why.startswith(("mid-payload", "inside")):
                evil._transport.write_eof()  # the peer ends the stream there
            await asyncio.wait_for(evil.closed, 10)  # the server dropped it
            await good.send_payload({"t": "still"}, b"works")
            items = await inbox.wait(2)
            assert [(p, f["t"]) for p, f, _ in items] == [("evil", "fine"), ("good", "still")]
            assert set(server.links) == {"good"}
        finally:
            await good.aclose()
            await evil.aclose()
            await server.aclose()

    run(main(), "uvloop")
    assert why in caplog.text


def test_handler_failure_closes_that_link(caplog):
    async def main():
        def handler(peer, frame, payload):
            if frame["t"] == "boom":
                raise RuntimeError("handler bug")

        server = PeerServer(token=TOKEN, node_id="srv", handler=handler)
        port = await server.start()
        link = await PeerLink.connect("127.0.0.1", port, token=TOKEN, node_id="cli")
        await link.send({"t": "boom"})
        await asyncio.wait_for(link.closed, 10)
        await server.aclose()
        await link.aclose()

    run(main(), "uvloop")
    assert "the frame handler failed; closing the link" in caplog.text


@pytest.mark.parametrize("loop", LOOPS)
def test_slow_receiver_bounds_the_senders_memory(loop):
    """The receiver's handler blocks: reading pauses, kernel buffers fill, the sender awaits drain, and what
    it holds stays within high water + one chunk; afterwards everything arrives intact and in order."""
    hw = 1 << 20
    n_frames = 96  # 96 MiB: far more than loopback socket buffers hold

    async def main():
        release = asyncio.Event()
        got: list[tuple[int, int, int]] = []
        done = asyncio.Event()

        async def slow(peer, frame, payload):
            await release.wait()
            got.append((frame["i"], len(payload), payload[0]))
            if len(got) == n_frames:
                done.set()

        server = PeerServer(token=TOKEN, node_id="srv", handler=slow, high_water=hw)
        port = await server.start()
        link = await PeerLink.connect("127.0.0.1", port, token=TOKEN, node_id="cli", high_water=hw)
        paused = asyncio.Event()
        link.pause_writing = lambda: (paused.set(), PeerLink.pause_writing(link))
        buf = bytearray(CHUNK)
        sent = 0

        async def produce():
            nonlocal sent
            for i in range(n_frames):
                buf[0] = i % 256
                await link.send_payload({"t": "blob", "i": i}, buf)  # the same buffer, changed after each send
                sent += 1

        producer = asyncio.ensure_future(produce())
        try:
            # the receiver stops reading once its handler lags by high water...
            peer = server.links["cli"]
            stopped = asyncio.Event()
            deliver = peer._deliver
            peer._deliver = lambda *a: (deliver(*a), peer._reading_paused and stopped.set())
            await asyncio.wait_for(stopped.wait(), 30)
            # ...then the kernel buffers fill and the sender pauses for good
            async with asyncio.timeout(30):
                while link._can_write.is_set():
                    paused.clear()
                    await paused.wait()
            assert not producer.done()
            assert sent < n_frames
            assert link._transport.get_write_buffer_size() <= hw + CHUNK + 4096
            assert peer._reading_paused
            assert peer._inbox_bytes <= hw + CHUNK + (64 << 10)
            release.set()
            await asyncio.wait_for(done.wait(), 60)
            await producer
            assert got == [(i, CHUNK, i % 256) for i in range(n_frames)]
        finally:
            producer.cancel()
            await asyncio.gather(producer, return_exceptions=True)
            await link.aclose()
            await server.aclose()

    run(main(), loop)


class WriteLog:
    """The link's real transport, with each write and writelines call recorded (the pieces as handed over)."""

    def __init__(self, transport):
        self._t = transport
        self.calls: list[tuple[str, list]] = []

    def write(self, data):
        self.calls.append(("write", [data]))
        self._t.write(data)

    def writelines(self, parts):
        self.calls.append(("writelines", list(parts)))
        self._t.writelines(parts)

    def __getattr__(self, name):
        return getattr(self._t, name)


@pytest.mark.parametrize("loop", LOOPS)
def test_a_payload_goes_out_as_views_of_the_buffer_in_one_write(loop):
    """Below high water a payload is one write of its header and views of the caller's buffer (uvloop: one
    writev, no copy); a mutable buffer is copied unless copy=False; at a small high water one piece per write."""

    async def main():
        inbox = Inbox()
        server = PeerServer(token=TOKEN, node_id="srv", handler=inbox)
        port = await server.start()
        link = await PeerLink.connect("127.0.0.1", port, token=TOKEN, node_id="cli")
        small = await PeerLink.connect("127.0.0.1", port, token=TOKEN, node_id="cl2", high_water=CHUNK // 16)
        try:
            wlog, slog = WriteLog(link._transport), WriteLog(small._transport)
            link._transport, small._transport = wlog, slog
            blob = np.random.default_rng(1).integers(0, 256, 3 * CHUNK + 7, dtype=np.uint8).tobytes()
            await link.send_payload({"t": "b", "i": 0}, blob)
            parts = [p for _, ps in wlog.calls for p in ps]
            assert len(parts) == 5
            assert [len(p) for p in parts[1:]] == [CHUNK, CHUNK, CHUNK, 7]
            assert all(p.obj is blob for p in parts[1:])  # views of the caller's bytes, not copies
            # uvloop (and Python 3.12's asyncio): one call for the lot; 3.11's asyncio would join them: a write each
            assert [k for k, _ in wlog.calls] == (["writelines"] if link._vectored else ["write"] * 5)
            wlog.calls.clear()
            mutable = bytearray(blob)
            await link.send_payload({"t": "b", "i": 1}, mutable)
            assert all(isinstance(p, bytes) for _, ps in wlog.calls for p in ps)  # copied: the caller may change it
            wlog.calls.clear()
            await link.send_payload({"t": "b", "i": 2}, mutable, copy=False)
            assert all(p.obj is mutable for _, ps in wlog.calls for p in ps[1:] if isinstance(p, memoryview))
            await small.send_payload({"t": "b", "i": 3}, blob)
            # header + a piece, then a piece per write
            assert [len(ps) for _, ps in slog.calls] == ([2, 1, 1, 1] if small._vectored else [1] * 5)
            got = await inbox.wait(4)
            assert sorted((f["i"], p == blob) for _, f, p in got) == [(0, True), (1, True), (2, True), (3, True)]
            wlog.calls.clear()
            one = np.arange(1000, dtype=np.int32)  # one chunk: no vectored writes: header and payload in one write
            await link.send_payload({"t": "b", "i": 4}, one.data.cast("B").toreadonly())
            want = [("writelines", 2)] if link._vectored else [("write", 1)]
            assert [(k, len(ps)) for k, ps in wlog.calls] == want
            got = await inbox.wait(5)
            assert got[4][1]["i"] == 4
            assert got[4][2] == one.tobytes()
        finally:
            link._transport, small._transport = wlog._t, slog._t
            await link.aclose()
            await small.aclose()
            await server.aclose()

    run(main(), loop)


def test_load_token(tmp_path):
    p = tmp_path / "token"
    p.write_bytes(b"  0123456789abcdef0123  \n")
    p.chmod(0o644)
    with pytest.raises(AuthError, match=r"mode 0644: group or others may read it; run `chmod 600 .*token`"):
        load_token(str(p))
    p.chmod(0o600)
    assert load_token(str(p)) == b"0123456789abcdef0123"
    p.write_bytes(b"short\n")
    with pytest.raises(AuthError, match="at least 16"):
        load_token(str(p))
    with pytest.raises(AuthError, match="cannot read"):
        load_token(str(tmp_path / "missing"))
