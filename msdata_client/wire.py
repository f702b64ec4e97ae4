"""Framing for the local Unix socket and peer TCP links: 4-byte big-endian length, then an orjson body.

Frames may carry file descriptors (SCM_RIGHTS) on the Unix socket; a frame that does says how many in
its ``"fds"`` key, and the receiver takes that many from the descriptors that arrived with the stream.
Never pickle: anything that can connect to these sockets is untrusted.
"""

from __future__ import annotations

import contextlib
import os
import socket
import struct
from collections import deque

import orjson

from .errors import PeerLostError, ProtocolError

__all__ = [
    "FrameReader",
    "MAX_FDS_PER_MSG",
    "MAX_FRAME",
    "PROTOCOL_VERSION",
    "decode",
    "encode",
    "recv_into_reader",
    "request",
]

PROTOCOL_VERSION = 1
MAX_FRAME = 16 << 20  # a control frame is small; anything larger is a protocol error, not an allocation
MAX_FDS_PER_MSG = 16
_HEADER = struct.Struct(">I")


def encode(obj: dict) -> bytes:
    """One frame: length prefix + orjson body."""
    body = orjson.dumps(obj, option=orjson.OPT_SERIALIZE_NUMPY)
    if len(body) > MAX_FRAME:
        raise ProtocolError(f"frame of {len(body)} bytes exceeds MAX_FRAME={MAX_FRAME}")
    return _HEADER.pack(len(body)) + body


def decode(body: bytes | memoryview) -> dict:
    """Parse one frame body; anything but a JSON object with a string "t" is a ProtocolError."""
    try:
        obj = orjson.loads(body)
    except orjson.JSONDecodeError as e:
        raise ProtocolError(f"frame is not valid JSON: {e}") from None
    if not isinstance(obj, dict) or not isinstance(obj.get("t"), str):
        raise ProtocolError('frame must be a JSON object with a string "t" (type) field')
    return obj


class FrameReader:
    """Incremental frame parser fed with received bytes and descriptors (used by both sides)."""

    __slots__ = ("_buf", "fds", "hint", "max_frame")

    def __init__(self, max_frame: int = MAX_FRAME, hint: str = "not an msdata peer?") -> None:
        self._buf = bytearray()
        self.fds: deque[int] = deque()
        self.max_frame = max_frame  # a longer frame is a ProtocolError (the server bounds its clients' frames)
        self.hint = hint  # what the error adds (the setting that bounds it)

    def feed(self, data: bytes, fds: list[int] | tuple[int, ...] = ()) -> None:
        self._buf += data
        self.fds.extend(fds)

    def next_frame(self) -> dict | None:
        """The next complete frame, or None when more bytes are needed."""
        if len(self._buf) < 4:
            return None
        (n,) = _HEADER.unpack_from(self._buf)
        if n > self.max_frame:
            raise ProtocolError(f"frame length {n} exceeds MAX_FRAME={self.max_frame}: {self.hint}")
        if len(self._buf) < 4 + n:
            return None
        body = bytes(self._buf[4 : 4 + n])
        if len(self._buf) == 4 + n:
            self._buf = bytearray()  # give back what a large frame made the buffer hold
        else:
            del self._buf[: 4 + n]
        return decode(body)

    def buffered(self) -> int:
        """Bytes received that do not make a whole frame yet (at EOF: the stream ended inside a frame)."""
        return len(self._buf)

    def take_fds(self, n: int) -> list[int]:
        if len(self.fds) < n:
            raise ProtocolError(f"frame announced {n} file descriptors but {len(self.fds)} arrived")
        return [self.fds.popleft() for _ in range(n)]

    def close_fds(self) -> None:
        while self.fds:
            with contextlib.suppress(OSError):
                os.close(self.fds.popleft())


def recv_into_reader(sock: socket.socket, reader: FrameReader, bufsize: int = 1 << 16) -> None:
    """Blocking receive of bytes and any descriptors; raises PeerLostError at EOF."""
    data, fds, _flags, _addr = socket.recv_fds(sock, bufsize, MAX_FDS_PER_MSG)
    if not data:
        for fd in fds:
            os.close(fd)
        raise PeerLostError("the server closed the connection")
    reader.feed(data, fds)


def request(path: str, frame: dict, *, timeout: float = 10.0) -> dict:
    """One blocking request/reply on a server's Unix socket (status and tools); OSError if nobody answers."""
    s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    s.settimeout(timeout)
    with s:
        s.connect(path)
        s.sendall(encode(frame))
        reader = FrameReader()
        while (reply := reader.next_frame()) is None:
            recv_into_reader(s, reader)
        reader.close_fds()
        return reply
