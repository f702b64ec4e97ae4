"""Protocol fuzzing of the peer links (cluster/_framing.py, _handshake.py, peers.py) of a real two-node cluster.

Before authentication: random bytes, handshake frames out of order or wrongly typed, oversized lengths, payload
frames, truncated streams, a few bytes at a time. After authentication (the fuzzer holds the token): random job
frames with wrong types and random payloads. After each example both servers run, the real link between them
and the election are untouched, a well-behaved peer authenticates and gets its pong, nothing raised a
traceback, and a rejected unauthenticated connection was logged exactly once, naming its address.
"""

from __future__ import annotations

import asyncio
import itertools
import os
import re
import secrets
import shutil
import socket
import struct
import time
from pathlib import Path

import orjson
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from msdata_client.wire import decode, encode
from msdata_server.cluster import PeerLink
from msdata_server.cluster.net.framing import FrameDecoder
from msdata_server.cluster.net.handshake import AuthError, Handshake
from msdata_server.errors import ProtocolError

from .cluster_util import Cluster
from .polling import wait_for

JOB_FRAMES = [
    "rep", "plan", "jstart", "jstop", "len", "vis", "fetch", "skip", "mixhold", "mixcut", "mix", "mixstate",
    "smeta", "jobs", "ack", "need", "ping", "nope",
]  # fmt: skip
_ids = itertools.count()


class Fuzzed:
    def __init__(self, etcd_url: str):
        self.base = Path("/tmp") / ("msdf-" + secrets.token_hex(4))  # short: socket paths are limited
        self.base.mkdir()
        self.cluster = Cluster(self.base, etcd_url, 2).start()
        self.alive = set(self.cluster.nodes)
        self.settled = wait_for(lambda: self.cluster.settled(self.alive), 30, "two linked nodes")
        self.target = self.cluster.nodes["node-0"]
        host, _, port = self.target.ready["listen"].rpartition(":")
        self.addr = (host, int(port))
        self.token = self.cluster.token_file.read_text().strip().encode()

    def mark(self) -> None:
        """Where the servers' logs stand before an example (check looks at what came after)."""
        self.marks = {nid: len(srv.log()) for nid, srv in self.cluster.nodes.items()}

    def check(self) -> None:
        for nid, srv in self.cluster.nodes.items():
            assert srv.proc.poll() is None, f"{nid} died; log:\n{srv.log()[-3000:]}"
            new = srv.log()[self.marks.get(nid, 0) :]
            assert "Traceback" not in new, new[-3000:]
        assert self.cluster.settled(self.alive) == self.settled  # same leader, token, members and links
        assert asyncio.run(self._ping())["t"] == "pong"

    async def _ping(self) -> dict:
        got = asyncio.get_running_loop().create_future()

        def on(peer, frame, payload):
            if not got.done():
                got.set_result(frame)

        link = await PeerLink.connect(*self.addr, token=self.token, node_id="well-behaved", handler=on)
        try:
            await link.send({"t": "ping", "id": 1})
            return await asyncio.wait_for(got, 10)
        finally:
            await link.aclose()

    def lines_about(self, port: int) -> int:
        pat = re.compile(rf"127\.0\.0\.1:{port}>(:| closed:)")
        return len(pat.findall(self.target.log()))

    def close(self) -> None:
        self.cluster.stop()
        shutil.rmtree(self.base, ignore_errors=True)


@pytest.fixture(scope="module")
def fz(etcd_server):
    f = Fuzzed(etcd_server.url)
    yield f
    f.close()


def read_until_closed(s: socket.socket) -> bytes:
    out = b""
    while True:
        try:
            chunk = s.recv(1 << 16)
        except (ConnectionResetError, TimeoutError):
            return out
        if not chunk:
            return out
        out += chunk


def rejected(data: bytes) -> bool:
    """Whether a server-side link that reads ``data`` and then EOF logs a rejection: the same state machines
    (framing, handshake) the server runs, without I/O."""
    dec = FrameDecoder(1 << 30)
    hs = Handshake(b"not-the-token-but-long-enough", "node-0", server=True)
    view = memoryview(data)
    while view:
        buf = dec.get_buffer()
        n = min(len(buf), len(view))
        buf[:n] = view[:n]
        view = view[n:]
        dec.received(n)
        try:
            while (got := dec.next(trusted=False)) is not None:
                hs.advance(got[0], "x")
        except (ProtocolError, AuthError):
            return True
    return dec.truncation("x") is not None


json_scalars = (
    st.none()
    | st.booleans()
    | st.integers(-(2**63), 2**63 - 1)
    | st.floats(allow_nan=False, allow_infinity=False)
    | st.text(max_size=12)
)
json_values = st.recursive(
    json_scalars,
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=6), inner, max_size=3),
    max_leaves=8,
)


def handshake_frames(names: list[str]):
    fields = ["v", "node", "nonce", "mac", "nbytes", "message"]
    return st.builds(
        lambda t, body: {"t": t, **body},
        st.sampled_from(names),
        st.fixed_dictionaries({}, optional={f: json_values | st.just("ab" * 32) for f in fields}),
    )


@st.composite
def pre_auth_segments(draw) -> bytes:
    kind = draw(st.sampled_from(["frame", "garbage", "oversized", "truncated", "http"]))
    if kind == "frame":
        return encode(draw(handshake_frames(["hello", "challenge", "auth", "welcome", "error", "ping"])))
    if kind == "garbage":
        return draw(st.binary(max_size=64))
    if kind == "oversized":
        return struct.pack(">I", draw(st.integers(4097, 2**32 - 1))) + draw(st.binary(max_size=8))
    if kind == "http":
        return b"GET / HTTP/1.1\r\nHost: x\r\n\r\n"
    whole = encode(draw(handshake_frames(["hello", "auth"])))
    return whole[: draw(st.integers(1, len(whole) - 1))]


FUZZ = settings(
    max_examples=int(os.environ.get("FUZZ_EXAMPLES", "25")),
    derandomize=os.environ.get("FUZZ_EXAMPLES") is None,  # CI: the same examples every run
    deadline=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow, HealthCheck.data_too_large],
)


@FUZZ
@given(parts=st.lists(pre_auth_segments(), min_size=1, max_size=3), cut=st.sampled_from([0, 3, 16]))
def test_unauthenticated_junk_is_refused_and_logged_once(fz, parts, cut):
    fz.mark()
    data = b"".join(parts)
    with socket.create_connection(fz.addr, timeout=15) as s:
        port = s.getsockname()[1]
        chunks = [data[i : i + cut] for i in range(0, len(data), cut)][:20] if cut else [data]
        try:
            for c in chunks:
                s.sendall(c)
                if cut:
                    time.sleep(0.002)  # a slow writer
            s.shutdown(socket.SHUT_WR)
        except OSError:  # the server refused and closed before we were done
            pass
        read_until_closed(s)
    sent = b"".join(chunks)
    want = 1 if rejected(sent) else 0
    if want:
        wait_for(lambda: fz.lines_about(port) >= want, 10, "the log line about the refused peer", every=0.01)
    assert fz.lines_about(port) == want, (sent[:200], fz.target.log()[-2000:])
    fz.check()


def authenticate(fz: Fuzzed, node_id: str) -> tuple[socket.socket, bytes]:
    """A blocking client side of the handshake; the socket and whatever arrived after the welcome."""
    s = socket.create_connection(fz.addr, timeout=15)
    hs = Handshake(fz.token, node_id, server=False)
    s.sendall(encode(hs.hello()))
    buf = b""
    while not hs.done:
        while len(buf) < 4 or len(buf) < 4 + struct.unpack(">I", buf[:4])[0]:
            chunk = s.recv(1 << 16)
            assert chunk, "the server closed the link during the handshake"
            buf += chunk
        n = struct.unpack(">I", buf[:4])[0]
        frame, buf = decode(buf[4 : 4 + n]), buf[4 + n :]
        for reply in hs.advance(frame, "node-0"):
            s.sendall(encode(reply))
    return s, buf


@st.composite
def job_frames(draw) -> bytes:
    fields = ["id", "from", "job", "run", "step", "token", "gen", "cut", "s", "o", "state", "weights", "node", "n"]
    frame = {"t": draw(st.sampled_from(JOB_FRAMES))}
    frame.update(draw(st.fixed_dictionaries({}, optional={f: json_values for f in fields})))
    if draw(st.booleans()):  # a payload frame
        payload = draw(st.binary(max_size=64))
        announced = draw(st.sampled_from([len(payload), len(payload) + 5, -1, "x"]))
        body = orjson.dumps({**frame, "nbytes": announced})
        return struct.pack(">I", len(body)) + body + payload
    return encode(frame)


@FUZZ
@given(seq=st.lists(job_frames(), min_size=1, max_size=4))
def test_authenticated_junk_never_hurts_the_cluster(fz, seq):
    fz.mark()
    node_id = f"fuzz-{next(_ids)}"
    s, _ = authenticate(fz, node_id)
    with s:
        try:
            s.sendall(b"".join(seq))
            s.shutdown(socket.SHUT_WR)
        except OSError:  # the server refused and closed before we were done
            pass
        read_until_closed(s)
    fz.check()
