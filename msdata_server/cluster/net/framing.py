"""The bytes of a peer link, without I/O: frames as in msdata_client/wire.py (a 4-byte big-endian length and an
orjson object with a string "t"), and payload frames: such an object with ``"nbytes": n`` followed by n raw
bytes (never pickle), which the receiver reads straight into one buffer.

Kept apart from PeerLink so that the link deals in its lifecycle (connect, authenticate, deliver, close) and
this in where one frame ends and the next begins. Limits: a control frame is at most MAX_FRAME bytes (4096
before authentication), a payload at most ``max_payload``; a larger length is a ProtocolError, not an allocation.
"""

from __future__ import annotations

import struct
from typing import TYPE_CHECKING

import numpy as np

from msdata_client.wire import MAX_FRAME, decode, encode

from ...errors import ProtocolError

if TYPE_CHECKING:
    from typing_extensions import Buffer

__all__ = ["CHUNK", "FrameDecoder", "payload_frame"]

CHUNK = 1 << 20  # a payload is written in pieces of this size, awaiting drain in between
_MAX_AUTH_FRAME = 4096  # nothing bigger is read from a peer that has not authenticated
_LEN = struct.Struct(">I")

Received = tuple[dict, memoryview | None, int]  # a frame, its payload, and the bytes they count for


def payload_frame(header: dict, buffer: Buffer, max_payload: int) -> tuple[bytes, list[memoryview]]:
    """The frame announcing ``buffer`` (the header gets "nbytes") and the buffer's bytes in CHUNK pieces."""
    mv = memoryview(buffer)
    if not mv.c_contiguous:
        raise ProtocolError("send_payload needs a C-contiguous buffer; call numpy.ascontiguousarray first")
    mv = mv.cast("B")
    n = mv.nbytes
    if n > max_payload:
        raise ProtocolError(f"payload of {n} bytes exceeds max_payload={max_payload}; split it")
    return encode({**header, "nbytes": n}), [mv[off : off + CHUNK] for off in range(0, n, CHUNK)]


class FrameDecoder:
    """Cuts received bytes into frames. The transport reads into ``get_buffer()`` and reports ``received(n)``;
    ``next(trusted=...)`` then returns each complete frame in order (None when more bytes are needed).

    Untrusted (before authentication) frames are small and any "nbytes" in them is not interpreted. Trusted
    payload frames arrive whole: the part of the payload that follows its frame is received straight into
    the payload's buffer."""

    def __init__(self, max_payload: int):
        self.max_payload = max_payload
        self._buf = bytearray()
        self._scratch = memoryview(bytearray(1 << 16))
        self._payload: memoryview | None = None  # the payload being received into
        self._payload_frame: dict | None = None
        self._got = 0

    def get_buffer(self) -> memoryview:
        if self._payload is not None:
            return self._payload[self._got :]
        return self._scratch

    def received(self, nbytes: int) -> None:
        """``nbytes`` arrived in the buffer ``get_buffer`` gave."""
        if self._payload is not None:
            self._got += nbytes
        else:
            self._buf += self._scratch[:nbytes]

    def next(self, *, trusted: bool) -> Received | None:
        """The next complete frame; ProtocolError for a frame over the limits or not an msdata frame."""
        if self._payload is not None:
            if self._got < len(self._payload):
                return None
            frame, payload = self._payload_frame, self._payload
            self._payload = self._payload_frame = None
            assert frame is not None  # set with the payload
            return frame, payload, len(payload)
        buf = self._buf
        if len(buf) < 4:
            return None
        (n,) = _LEN.unpack_from(buf)
        limit = MAX_FRAME if trusted else _MAX_AUTH_FRAME
        if n > limit:
            raise ProtocolError(
                f"frame length {n} exceeds {limit} bytes"
                f"{'' if trusted else ' before authentication'}: not an msdata peer?"
            )
        if len(buf) < 4 + n:
            return None
        frame = decode(bytes(buf[4 : 4 + n]))
        del buf[: 4 + n]
        if not trusted or "nbytes" not in frame:
            return frame, None, n
        size = frame["nbytes"]
        if isinstance(size, bool) or not isinstance(size, int) or not 0 <= size <= self.max_payload:
            raise ProtocolError(f"payload frame announces nbytes={size!r}; must be an int in [0, {self.max_payload}]")
        # uninitialised memory: every byte of it is received into before the frame is returned (a zeroed
        # bytearray costs a clearing pass: about 23 us per MiB here, against 0.2 us)
        data = np.empty(size, np.uint8).data.cast("B")
        take = min(len(buf), size)
        data[:take] = buf[:take]
        del buf[:take]
        if take == size:
            return frame, data, size
        self._payload, self._payload_frame, self._got = data, frame, take  # get_buffer reads the rest
        return None

    def buffered(self) -> int:
        """Bytes received but not yet part of a returned frame (outside a payload being received)."""
        return len(self._buf)

    def truncation(self, peer: str) -> ProtocolError | None:
        """The error to report if the stream ends now: inside a payload or a frame; None between frames."""
        if self._payload is not None:
            return ProtocolError(
                f"peer {peer} closed the link mid-payload: got {self._got} of {len(self._payload)} announced bytes"
            )
        if self._buf:
            return ProtocolError(f"peer {peer} closed the link inside a frame ({len(self._buf)} bytes of it arrived)")
        return None

    def close(self) -> None:
        """Drop a payload being received."""
        self._payload = self._payload_frame = None
