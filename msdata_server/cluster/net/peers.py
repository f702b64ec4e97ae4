"""Authenticated TCP links between node servers.

Frames as in msdata_client/wire.py: a 4-byte big-endian length and an orjson object with a string "t". A
payload frame is such an object with ``"nbytes": n`` followed by n raw bytes (never pickle), which the receiver
reads straight into one buffer (``_framing``). Before anything else both sides prove they hold the shared token
(``_handshake``: HMAC-SHA256 over both nonces, roles and ids). With ``tls`` (an ``ssl.SSLContext``, ``tls.py``) the
link is upgraded to mutual TLS first (``starttls`` both ways, then ``loop.start_tls``) and the token handshake and
every frame after it travel inside TLS; a side with TLS and a side without refuse each other with a clear error.
Flow control: a sender awaits drain once the transport buffers ``high_water`` bytes (payloads go in chunks, so it
never holds more than high_water + CHUNK); a receiver stops reading while its handler has more than ``high_water``
bytes queued. A malformed frame closes that link only.

Copies: a payload leaves as its header and as many CHUNK views of the caller's buffer as the transport has room
for, in one ``writelines`` (uvloop: one ``writev`` of the views, and what the kernel does not take stays a view;
a mutable buffer is copied unless ``copy=False``); a payload of one chunk on a transport without vectored writes
(asyncio before 3.12) leaves joined to its header, one write and one system call per frame; it arrives by the
transport reading straight into the one buffer allocated from the header's length.

This module holds the link's lifecycle (connect, authenticate, deliver in order, close) and the server that
accepts links; the bytes on the wire and the proof of the token live in the two modules named above.
"""

from __future__ import annotations

import asyncio
import inspect
import logging
import ssl
from collections import deque
from collections.abc import Awaitable, Callable
from functools import partial
from typing import TYPE_CHECKING, Any, cast

from msdata_client.wire import encode

from ...errors import ClosedError, PeerLostError, ProtocolError
from .framing import CHUNK, FrameDecoder, payload_frame
from .handshake import AuthError, Handshake, Refusal, check_token, load_token

if TYPE_CHECKING:
    from typing_extensions import Buffer

__all__ = ["AuthError", "CHUNK", "HIGH_WATER", "MAX_PAYLOAD", "PeerLink", "PeerServer", "Traffic", "load_token"]

log = logging.getLogger(__name__)

HIGH_WATER = 8 << 20  # bytes: sender's transport buffer, receiver's queue of unhandled frames
MAX_PAYLOAD = 1 << 30  # a larger "nbytes" is a protocol error, not an allocation
AUTH_TIMEOUT = 5.0

Handler = Callable[[str, dict, memoryview | None], Awaitable[None] | None]


class Traffic:
    """Bytes a node sent and received over all its peer links (links come and go; the totals stay)."""

    __slots__ = ("bytes_in", "bytes_out")

    def __init__(self) -> None:
        self.bytes_in = 0
        self.bytes_out = 0

    def to_dict(self) -> dict:
        return {"bytes_in": self.bytes_in, "bytes_out": self.bytes_out}


class PeerLink(asyncio.BufferedProtocol):
    """One authenticated link, either side: ``send``/``send_payload``; what arrives goes to ``handler``.

    Invariants: at most ``high_water + CHUNK`` bytes wait in the transport per link (senders await drain);
    at most ``high_water`` + one frame of received frames wait for the handler before reading pauses.
    """

    def __init__(
        self,
        *,
        token: bytes | str,
        node_id: str,
        handler: Handler | None = None,
        server: bool,
        high_water: int = HIGH_WATER,
        max_payload: int = MAX_PAYLOAD,
        auth_timeout: float = AUTH_TIMEOUT,
        on_ready: Callable[[PeerLink], None] | None = None,
        traffic: Traffic | None = None,
        tls: ssl.SSLContext | None = None,
    ):
        if high_water < CHUNK // 16:
            raise ValueError(f"{high_water=} must be >= {CHUNK // 16}")
        self.node_id = node_id
        self.authenticated = False
        self.traffic = traffic if traffic is not None else Traffic()
        self.high_water = high_water
        self.max_payload = max_payload
        self._handshake = Handshake(check_token(token), node_id, server=server, tls=tls is not None)
        self._tls = tls
        self._upgrading: asyncio.Task | None = None  # the TLS handshake, while it runs
        self._handler = handler
        self._on_ready = on_ready
        self._auth_timeout = auth_timeout
        self._transport: asyncio.Transport | None = None
        self._vectored = False  # the transport writes a list of buffers without joining them
        self._peername = "?"
        self._frames = FrameDecoder(max_payload)
        self._inbox: deque[tuple[dict, memoryview | None, int]] = deque()
        self._inbox_bytes = 0
        self._inbox_ready = asyncio.Event()
        self._reading_paused = False
        self._can_write = asyncio.Event()
        self._can_write.set()
        self._send_lock = asyncio.Lock()
        self._consumer: asyncio.Task | None = None
        self._timer: asyncio.TimerHandle | None = None
        self._loop = asyncio.get_running_loop()
        self.ready: asyncio.Future[PeerLink] = self._loop.create_future()
        self.closed: asyncio.Future[None] = self._loop.create_future()
        self.error: Exception | None = None

    @property
    def peer_id(self) -> str | None:
        """The other side's node id (claimed until ``authenticated``)."""
        return self._handshake.peer_id

    @property
    def tls_version(self) -> str | None:
        """The TLS version of this link ("TLSv1.3"), None for a plain one (or before TLS is up)."""
        obj = self._transport.get_extra_info("ssl_object") if self._transport is not None else None
        return obj.version() if obj is not None else None

    def __repr__(self) -> str:
        who = self.peer_id or "unauthenticated"
        return f"<PeerLink {self.node_id}<->{who} {self._peername}>"

    # ---- opening --------------------------------------------------------------------------------------
    @staticmethod
    async def connect(host: str, port: int, **kw: Any) -> PeerLink:
        """Connect and authenticate (see ``dial``)."""
        return await dial(host, port, **kw)

    def _live_transport(self) -> asyncio.Transport:
        """The link's transport (set once connection_made ran, before any data can arrive)."""
        assert self._transport is not None, "no transport before connection_made"
        return self._transport

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self._set_transport(cast(asyncio.Transport, transport))  # a stream protocol gets a stream transport
        peer = transport.get_extra_info("peername")
        self._peername = f"{peer[0]}:{peer[1]}" if isinstance(peer, tuple) else str(peer)
        self._timer = self._loop.call_later(self._auth_timeout, self._auth_expired)
        if (hello := self._handshake.hello()) is not None:
            self._write(encode(hello))

    def _auth_expired(self) -> None:
        self._fail(AuthError(f"{self!r} did not complete authentication within {self._auth_timeout:g}s"))

    def _auth_step(self, frame: dict) -> None:
        """The handshake; any frame out of order is an AuthError."""
        try:
            replies = self._handshake.advance(frame, self._peername)
        except Refusal as e:
            self._write(encode(e.notice))
            raise
        for reply in replies:
            self._write(encode(reply))
        if self._handshake.upgrade:
            self._start_tls()
        elif self._handshake.done:
            self._authenticated()

    # ---- TLS ------------------------------------------------------------------------------------------
    def _start_tls(self) -> None:
        """Both sides said ``starttls``: stop reading in the clear and run the TLS handshake on this socket."""
        if self._frames.buffered():  # the peer must wait for our answer before its TLS hello
            raise AuthError(f"peer {self._peername} sent data after starttls, before the TLS handshake")
        raw = self._live_transport()
        raw.pause_reading()
        self._upgrading = self._loop.create_task(self._upgrade(raw), name=f"tls-{self._peername}")

    async def _upgrade(self, raw: asyncio.Transport) -> None:
        """The TLS handshake (within the auth timeout); then the token handshake goes on inside TLS."""
        assert self._tls is not None  # the handshake asks for TLS only when we have it
        try:
            tls = await self._loop.start_tls(
                raw, self, self._tls, server_side=self._handshake.server, ssl_handshake_timeout=self._auth_timeout
            )
        except asyncio.CancelledError:
            self._tls_failed(raw, None)
            raise
        except Exception as e:  # SSLError, a reset, a timeout (the types differ between asyncio and uvloop)
            self._tls_failed(raw, e)
            return
        if tls is None or tls.is_closing() or self.closed.done():
            self._tls_failed(raw, PeerLostError("the link closed during the TLS handshake"))
            return
        self._set_transport(cast(asyncio.Transport, tls))
        self._upgrading = None  # frames flow again (this task is about to end)
        if (hello := self._handshake.upgraded()) is not None:
            self._write(encode(hello))
        self._pump()  # the client may have sent its hello before this task resumed

    def _tls_failed(self, raw: asyncio.Transport, exc: BaseException | None) -> None:
        """The TLS handshake failed (``exc``) or was cancelled (None): the link is over; say why, once."""
        if exc is not None and self.error is None:
            if isinstance(exc, ssl.SSLError):
                self._fail(
                    AuthError(
                        f"peer {self._peername}: the TLS handshake failed: {exc}: each node's certificate must be "
                        "signed by the other's [cluster] tls_ca"
                    )
                )
            else:
                self._fail(
                    PeerLostError(
                        f"peer {self._peername} closed the link during the TLS handshake ({exc!r}): "
                        "if it keeps doing so, it does not trust our certificate (its log names us)"
                    )
                )
        raw.abort()
        self.connection_lost(None)  # the TLS layer does not report a link lost before TLS was up

    def _authenticated(self) -> None:
        self.authenticated = True
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        self._consumer = self._loop.create_task(self._consume(), name=f"peer-{self.peer_id}")
        self._consumer.add_done_callback(self._consumer_done)
        log.info("%r authenticated", self)
        if self._on_ready is not None:
            self._on_ready(self)
        if not self.ready.done():
            self.ready.set_result(self)

    # ---- sending --------------------------------------------------------------------------------------
    def _set_transport(self, transport: asyncio.Transport) -> None:
        """Write through ``transport`` from now on (the TCP one, then TLS's), pausing us above high water."""
        self._transport = transport
        transport.set_write_buffer_limits(high=self.high_water)
        # asyncio's default writelines joins its pieces into one bytes (a copy of the payload); uvloop's and
        # Python 3.12's write the views as they are
        self._vectored = type(transport).writelines is not asyncio.WriteTransport.writelines

    def _write(self, data: bytes | memoryview) -> None:
        if self._transport is not None and not self._transport.is_closing():
            self._transport.write(data)
            self.traffic.bytes_out += len(data)

    def _write_all(self, parts: list[bytes | memoryview]) -> None:
        """Several pieces in one call (one ``writev`` where the transport has it)."""
        t = self._transport
        if t is None or t.is_closing():
            return
        if self._vectored:
            t.writelines(parts)
        else:
            for part in parts:
                t.write(part)
        self.traffic.bytes_out += sum(len(part) for part in parts)

    async def _drain(self) -> None:
        if not self._can_write.is_set():
            await self._can_write.wait()
        if self.closed.done():
            raise PeerLostError(f"{self!r} is closed{f': {self.error}' if self.error else ''}")

    def _check_open(self) -> None:
        if not self.authenticated:
            raise ClosedError(f"{self!r} is not authenticated; use PeerLink.connect() or wait for ready")
        if self.closed.done() or self._transport is None or self._transport.is_closing():
            raise PeerLostError(f"{self!r} is closed{f': {self.error}' if self.error else ''}")

    async def send(self, frame: dict) -> None:
        """Send one control frame (a dict with a string "t"); waits while the link is above high water."""
        if "nbytes" in frame:
            raise ProtocolError('control frames must not carry "nbytes"; use send_payload')
        data = encode(frame)
        async with self._send_lock:
            self._check_open()
            self._write(data)
            await self._drain()

    async def send_payload(self, header: dict, buffer: Buffer, *, copy: bool | None = None) -> None:
        """Send a JSON header (gets "nbytes") and the buffer's raw bytes: each write hands the transport the
        CHUNK pieces it has room for below high water (at least one), then awaits drain.

        The transport may keep a reference to what it could not send yet; so a mutable buffer (anything but
        bytes) is copied piece by piece unless ``copy=False``, which promises it stays unchanged until sent.
        """
        head, pieces = payload_frame(header, buffer, self.max_payload)
        if copy is None:
            copy = not isinstance(buffer, bytes)
        async with self._send_lock:
            self._check_open()
            if not self._vectored and len(pieces) <= 1:  # one chunk: header and payload in one write (one send)
                self._write(b"".join([head, *pieces]))
                await self._drain()
                return
            parts: list[bytes | memoryview] = [head]
            at = 0
            while True:
                room = self.high_water - self._live_transport().get_write_buffer_size()
                first = at
                while at < len(pieces) and (room > 0 or at == first):
                    piece = pieces[at]
                    parts.append(bytes(piece) if copy else piece)
                    room -= len(piece)
                    at += 1
                self._write_all(parts)
                await self._drain()
                if at == len(pieces):
                    return
                parts = []

    def pause_writing(self) -> None:
        self._can_write.clear()

    def resume_writing(self) -> None:
        self._can_write.set()

    # ---- receiving ------------------------------------------------------------------------------------
    def get_buffer(self, sizehint: int) -> memoryview:
        return self._frames.get_buffer()

    def buffer_updated(self, nbytes: int) -> None:
        if self.closed.done() or (self._transport is not None and self._transport.is_closing()):
            return
        self.traffic.bytes_in += nbytes
        self._frames.received(nbytes)
        self._pump()

    def _pump(self) -> None:
        """Handle every complete frame received (none while TLS is being set up: those wait for ``_upgrade``)."""
        try:
            while not self._live_transport().is_closing() and self._upgrading_now() is None:
                if (got := self._frames.next(trusted=self.authenticated)) is None:
                    return
                if self.authenticated:
                    self._deliver(*got)
                else:
                    self._auth_step(got[0])
        except ProtocolError as e:
            self._fail(e)

    def _deliver(self, frame: dict, payload: memoryview | None, size: int) -> None:
        """Queue a frame for the handler (``size`` bytes of the queue's bound); pause reading above high water."""
        self._inbox.append((frame, payload, size))
        self._inbox_bytes += size
        self._inbox_ready.set()
        if self._inbox_bytes > self.high_water and not self._reading_paused:
            self._reading_paused = True
            self._live_transport().pause_reading()

    async def _consume(self) -> None:
        """Run the handler on each frame in order; reading resumes once the queue is below high_water/4."""
        while True:
            while not self._inbox:
                if self.closed.done():
                    return
                self._inbox_ready.clear()
                await self._inbox_ready.wait()
            frame, payload, size = self._inbox.popleft()
            if self._handler is None:
                log.debug("%r: no handler; dropping a %r frame", self, frame.get("t"))
            else:
                try:
                    r = self._handler(self.peer_id or "?", frame, payload)
                    if inspect.isawaitable(r):
                        await r
                except (KeyError, TypeError, ValueError, ProtocolError) as e:  # a field of the wrong type or absent
                    log.warning("%r: dropped a malformed %r frame: %s: %s", self, frame.get("t"), type(e).__name__, e)
            self._inbox_bytes -= size
            if self._reading_paused and self._inbox_bytes <= self.high_water // 4 and not self.closed.done():
                self._reading_paused = False
                self._live_transport().resume_reading()

    def _consumer_done(self, task: asyncio.Task) -> None:
        if task.cancelled():
            return
        if (exc := task.exception()) is not None:
            log.error("%r: the frame handler failed; closing the link", self, exc_info=exc)
            self.error = exc if isinstance(exc, Exception) else RuntimeError(repr(exc))
            self.abort()

    # ---- closing --------------------------------------------------------------------------------------
    def _fail(self, exc: Exception) -> None:
        """A bad frame or failed handshake: log it clearly, drop this link (and only it)."""
        if self.error is None:
            self.error = exc
        log.warning("%r closed: %s", self, exc)
        if not self.ready.done():
            self.ready.set_exception(exc)
        if self._transport is not None:
            self._transport.close()  # flushes a refusal notice, then closes; reading has stopped mattering

    def abort(self) -> None:
        if self._transport is not None:
            self._transport.abort()

    def eof_received(self) -> bool:
        return False  # close our side too

    def _upgrading_now(self) -> asyncio.Task | None:
        """The TLS handshake task while it runs (no frame is read meanwhile)."""
        return self._upgrading if self._upgrading is not None and not self._upgrading.done() else None

    def connection_lost(self, exc: Exception | None) -> None:
        if self.closed.done():
            return  # after a failed TLS handshake both we and the TLS layer may report it
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        if self.error is None and (cut := self._frames.truncation(self._peername)) is not None:
            self.error = cut
            log.warning("%r: %s", self, self.error)
        self._frames.close()
        if not self.ready.done():
            if self.error is None and isinstance(exc, ssl.SSLError):  # TLS 1.3: the server checks our cert late
                self.error = AuthError(
                    f"peer {self._peername} refused our TLS certificate: {exc}: it must be signed by the peer's "
                    "[cluster] tls_ca"
                )
                log.warning("%r closed: %s", self, self.error)
            hint = " (after TLS was up: if it keeps doing so, it refuses our certificate; its log says)"
            err = self.error or PeerLostError(
                f"peer {self._peername} closed the link during authentication{f': {exc}' if exc else ''}"
                + (hint if self._handshake.tls_up else "")
            )
            self.ready.set_exception(err)
        if self.ready.done() and not self.ready.cancelled():
            self.ready.exception()  # retrieved: connect() reports it, a server side logs it
        self._can_write.set()
        self._inbox_ready.set()
        if not self.closed.done():
            self.closed.set_result(None)
        log.debug("%r lost: %s", self, exc or self.error or "closed")

    async def aclose(self) -> None:
        """Close after sending what is buffered; waits (bounded) for the other side; idempotent."""
        if self._transport is not None:
            self._transport.close()
        if (upgrading := self._upgrading_now()) is not None:
            upgrading.cancel("link closing")
            await asyncio.gather(upgrading, return_exceptions=True)
        if self._consumer is not None and not self._consumer.done() and self._consumer is not asyncio.current_task():
            self._consumer.cancel("link closing")
        try:
            await asyncio.wait_for(asyncio.shield(self.closed), AUTH_TIMEOUT)
        except TimeoutError:
            self.abort()
            await self.closed
        if self._consumer is not None and self._consumer is not asyncio.current_task():
            await asyncio.gather(self._consumer, return_exceptions=True)


async def dial(
    host: str,
    port: int,
    *,
    token: bytes | str,
    node_id: str,
    handler: Handler | None = None,
    high_water: int = HIGH_WATER,
    timeout: float = AUTH_TIMEOUT,  # noqa: ASYNC109  (the handshake's deadline, as open_connection's)
    **kw: Any,
) -> PeerLink:
    """Connect to a peer and authenticate (over mutual TLS with ``tls=`` a client context); AuthError when the
    other side lacks our token, our CA or our TLS mode, PeerLostError if it is gone or does not answer within
    ``timeout``."""
    loop = asyncio.get_running_loop()
    make = partial(
        PeerLink,
        token=token,
        node_id=node_id,
        handler=handler,
        server=False,
        high_water=high_water,
        auth_timeout=timeout,
        **kw,
    )
    try:
        _, link = await asyncio.wait_for(loop.create_connection(make, host, port), timeout)
    except (OSError, TimeoutError) as e:
        raise PeerLostError(f"cannot connect to peer {host}:{port}: {e or 'timed out'}") from None
    try:
        return await asyncio.shield(link.ready)
    except asyncio.CancelledError:
        link.abort()
        raise


class PeerServer:
    """Accepts peer links on (host, port); each authenticated frame goes to ``handler(peer_id, frame, payload)``."""

    def __init__(
        self,
        *,
        token: bytes | str,
        node_id: str,
        handler: Handler,
        high_water: int = HIGH_WATER,
        max_payload: int = MAX_PAYLOAD,
        auth_timeout: float = AUTH_TIMEOUT,
        traffic: Traffic | None = None,
        tls: ssl.SSLContext | None = None,
    ):
        self._token = check_token(token)
        self.tls = tls  # a server context: every accepted link is mutual TLS
        self.traffic = traffic
        self.node_id = node_id
        self.handler = handler
        self.high_water = high_water
        self.max_payload = max_payload
        self.auth_timeout = auth_timeout
        self.links: dict[str, PeerLink] = {}  # authenticated, by peer id (the latest link of each peer)
        self._all: set[PeerLink] = set()
        self._server: asyncio.Server | None = None
        self.port: int | None = None

    async def start(self, host: str = "127.0.0.1", port: int = 0) -> int:
        """Listen (loopback by default); returns the bound port (port 0: chosen by the OS)."""
        loop = asyncio.get_running_loop()
        self._server = await loop.create_server(self._make, host, port)
        self.port = self._server.sockets[0].getsockname()[1]
        log.info(
            "node %s accepts peer links on %s:%d (%s)",
            self.node_id,
            host,
            self.port,
            "mutual TLS" if self.tls is not None else "plain TCP, token handshake",
        )
        return self.port

    def _make(self) -> PeerLink:
        link = PeerLink(
            token=self._token,
            node_id=self.node_id,
            handler=self.handler,
            server=True,
            high_water=self.high_water,
            max_payload=self.max_payload,
            auth_timeout=self.auth_timeout,
            on_ready=self._ready,
            traffic=self.traffic,
            tls=self.tls,
        )
        self._all.add(link)
        link.closed.add_done_callback(partial(self._gone, link))
        return link

    def _ready(self, link: PeerLink) -> None:
        if link.peer_id is not None:
            self.links[link.peer_id] = link

    def _gone(self, link: PeerLink, _closed: object = None) -> None:
        self._all.discard(link)
        if link.peer_id is not None and self.links.get(link.peer_id) is link:
            del self.links[link.peer_id]

    async def aclose(self) -> None:
        """Stop accepting and close every link (idempotent)."""
        if self._server is not None:
            self._server.close()
        links = list(self._all)
        await asyncio.gather(*(link.aclose() for link in links), return_exceptions=True)
        if self._server is not None:
            await self._server.wait_closed()
            self._server = None
