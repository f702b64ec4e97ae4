"""Protocol fuzzing of the local Unix-socket endpoint (msdata_server/endpoint.py, msdata_client/wire.py framing).

One real server per module; each Hypothesis example is one connection that sends random, truncated, oversized,
wrongly typed or out-of-order frames, possibly a few bytes at a time, then half-closes and reads until the
server closes. After each example: the server still runs, a well-behaved rank that stays connected throughout
still gets its next batch, and every rejection was logged exactly once with the client (an ``error`` frame back
means one log line; a stream that ended inside a frame means one log line and no error frame).
"""

from __future__ import annotations

import os
import re
import shutil
import socket
import struct
import tempfile
import time

import orjson
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import msdata_client as msd
from msdata_client.wire import MAX_FRAME, FrameReader, encode, recv_into_reader
from msdata_server.clientframes import FRAME_TYPES
from msdata_server.errors import ProtocolError

from .e2e_util import small_job
from .polling import wait_for
from .server_util import ServerProc

GOOD = small_job("fuzz-good", dp=1, samples=2_000)
REG = small_job("fuzz-reg", dp=1, samples=200)  # a job a fuzzed connection registers before its junk
REJECTED = re.compile(r"<client \d+ pid=\d+ rank=\S+> (sent a malformed frame|refused|closed its socket inside)")


class Fuzzed:
    """The module's server, the rank that behaves, and how many rejections the log should hold."""

    def __init__(self):
        self.dir = tempfile.mkdtemp(prefix="msd-")
        self.srv = ServerProc(self.dir).start()
        self.good = msd.DataClient(GOOD, endpoint=self.srv.socket, rank=0, world_size=1, connect_timeout=10)
        next(self.good)
        self.expected = 0
        self.mark = 0  # the log before this is checked

    def rejections(self) -> int:
        return len(REJECTED.findall(self.srv.log()))

    def check(self) -> None:
        """The server lives, the good rank is served, and the log has one line per rejection (no more)."""
        assert self.srv.proc.poll() is None, f"the server died; log:\n{self.srv.log()[-3000:]}"
        b = next(self.good)
        assert int(b["step"]) >= 0
        del b
        wait_for(
            lambda: self.rejections() >= self.expected, 10, "a log line per rejection", log=self.srv.log, every=0.01
        )
        assert self.rejections() == self.expected, self.srv.log()[-3000:]
        new = self.srv.log()[self.mark :]
        self.mark += len(new)
        assert "Traceback" not in new, new[-3000:]

    def close(self) -> None:
        self.good.close()
        self.srv.stop()
        self.srv.proc.stdout.close()
        shutil.rmtree(self.dir, ignore_errors=True)


@pytest.fixture(scope="module")
def fz():
    f = Fuzzed()
    yield f
    f.close()


def exchange(path: str, chunks: list[bytes], pause: float) -> list[dict]:
    """Send the chunks (pausing between them: a slow writer), half-close, and read frames until the server
    closes; returns what it sent."""
    s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    s.settimeout(15)
    s.connect(path)
    got: list[dict] = []
    reader = FrameReader()
    with s:
        try:
            for c in chunks:
                s.sendall(c)
                if pause:
                    time.sleep(pause)
            s.shutdown(socket.SHUT_WR)
        except (BrokenPipeError, ConnectionResetError):
            pass  # the server refused and closed before we were done
        while True:
            try:
                recv_into_reader(s, reader)
            except (msd.errors.PeerLostError, ConnectionResetError):
                break
            while (f := reader.next_frame()) is not None:
                got.append(f)
        reader.close_fds()  # a stream that registered a rank got ring descriptors
    return got


def ends_inside_a_frame(data: bytes) -> bool:
    """Whether the server, having read all of ``data`` without refusing it, is left with part of a frame."""
    r = FrameReader()
    r.feed(data)
    try:
        while r.next_frame() is not None:
            pass
    except ProtocolError:
        return False
    return r.buffered() > 0


def settle(fz: Fuzzed, sent: bytes, replies: list[dict]) -> None:
    errors = [f for f in replies if f["t"] == "error"]
    assert len(errors) <= 1, replies
    if errors:
        assert errors[0]["message"], errors
        fz.expected += 1
    elif ends_inside_a_frame(sent):
        fz.expected += 1
    fz.check()


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
FIELDS = sorted({f for fields in FRAME_TYPES.values() for f in fields} | {"id", "v", "fds"})
TYPES = [*sorted(FRAME_TYPES), "", "welcome", "batch", "x" * 100]


@st.composite
def frames(draw) -> dict:
    """A frame of a known (or unknown) type whose fields are random JSON: mostly wrong types."""
    t = draw(st.sampled_from(sorted(FRAME_TYPES)) | st.sampled_from(TYPES))
    own = sorted(FRAME_TYPES.get(t, {}))  # its own fields, each there or not, of any JSON type
    body = draw(st.fixed_dictionaries({}, optional={n: json_values for n in own}))
    extra = draw(st.lists(st.sampled_from(FIELDS), max_size=1))
    return {"t": t, **body, **{n: draw(json_values) for n in extra if n not in body}}


def hello(**over) -> dict:
    h = {
        "t": "hello",
        "v": 1,
        "job": GOOD.to_dict(),
        "digest": GOOD.digest(),
        "rank": 0,
        "world_size": 1,
        "pid": 1,
        "position": {"step": 0, "micro": 0},
    }
    h.update(over)
    return h


@st.composite
def mutated_hellos(draw) -> dict:
    """A hello for the running job with one field replaced (wrong type, other job, other rank...)."""
    field = draw(st.sampled_from(["job", "digest", "rank", "world_size", "position", "state", "held", "client", "v"]))
    return hello(**{field: draw(json_values)})


@st.composite
def segments(draw) -> bytes:
    kind = draw(st.sampled_from(["frame", "hello", "garbage", "raw-json", "oversized", "truncated"]))
    if kind == "frame":
        return encode(draw(frames()))
    if kind == "hello":
        return encode(draw(mutated_hellos()))
    if kind == "garbage":
        return draw(st.binary(max_size=64))
    if kind == "raw-json":
        body = orjson.dumps(draw(json_values))
        return struct.pack(">I", len(body)) + body
    if kind == "oversized":
        return struct.pack(">I", draw(st.integers(MAX_FRAME + 1, 2**32 - 1))) + draw(st.binary(max_size=16))
    whole = encode(draw(frames()))
    return whole[: draw(st.integers(1, len(whole) - 1))]


FUZZ = settings(
    max_examples=int(os.environ.get("FUZZ_EXAMPLES", "40")),
    derandomize=os.environ.get("FUZZ_EXAMPLES") is None,  # CI: the same examples every run
    deadline=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow, HealthCheck.data_too_large],
)


@FUZZ
@given(parts=st.lists(segments(), min_size=1, max_size=4))
def test_random_streams_never_hurt_the_server(fz, parts):
    data = b"".join(parts)
    settle(fz, data, exchange(fz.srv.socket, [data], 0))


@FUZZ
@given(
    registered=st.booleans(),
    seq=st.lists(st.one_of(frames(), mutated_hellos(), st.just(hello(rank=3))), min_size=1, max_size=5),
)
def test_out_of_order_and_wrongly_typed_frames(fz, registered, seq):
    """Frames in any order, before and after a rank registered its job (which then runs)."""
    if registered:
        seq = [hello(job=REG.to_dict(), digest=REG.digest(), client="fuzz"), *seq]
    data = b"".join(encode(f) for f in seq)
    settle(fz, data, exchange(fz.srv.socket, [data], 0))


@settings(FUZZ, max_examples=10)
@given(
    seq=st.lists(st.one_of(frames(), mutated_hellos()), min_size=1, max_size=3), cut=st.integers(1, 7), data=st.data()
)
def test_slow_writers(fz, seq, cut, data):
    """A frame dribbled a few bytes at a time, possibly ending inside a frame."""
    stream = b"".join(encode(f) for f in seq)
    stream = stream[: data.draw(st.integers(1, len(stream)))]
    chunks = [stream[i : i + cut] for i in range(0, len(stream), cut)][:40]
    sent = b"".join(chunks)
    settle(fz, sent, exchange(fz.srv.socket, chunks, 0.001))


def test_known_bad_frames_get_clear_errors(fz):
    """Each frame shape the node reads is checked at the endpoint and named in the refusal."""
    cases = [
        ({"t": "release", "s": 5}, "field 's' of a 'release' frame"),
        ({"t": "release", "s": [[1, "x"]]}, "list of [ring, slot] pairs"),
        ({"t": "release", "w": ["slow"]}, "field 'w'"),
        ({"t": "state"}, "lacks 'step'"),
        ({"t": "mixture", "weights": [1]}, "field 'weights'"),
        ({"t": "teapot"}, "unknown frame type 'teapot'"),
        (hello(position={"step": -1}), "field 'position'"),
        ({"t": "state", "step": 0}, "state request before hello"),
        (hello(rank=0), "already connected"),
    ]
    registered = encode(hello(job=REG.to_dict(), digest=REG.digest(), client="fuzz"))
    for (frame, why), after_hello in zip(cases, [True] * 6 + [False] * 3):
        replies = exchange(fz.srv.socket, [registered * after_hello + encode(frame)], 0)
        replies = [f for f in replies if f["t"] not in ("welcome", "batch")]
        assert [f["t"] for f in replies] == ["error"], (frame, replies)
        assert why in replies[0]["message"], (frame, replies)
        fz.expected += 1
        fz.check()
    # a well-behaved registration of another job still works after all of it
    other = small_job("fuzz-after", dp=1)
    with msd.DataClient(other, endpoint=fz.srv.socket, rank=0, world_size=1, connect_timeout=10) as dc:
        assert int(next(dc)["step"]) == 0
