"""The local client endpoint: a Unix socket speaking length-prefixed orjson frames (msdata_client.wire).

Sends are non-blocking and ordered through a bounded outbox (a client that stops reading is dropped, it
never stalls the loop); frames may carry descriptors (SCM_RIGHTS), which is how rings reach clients.
"""

from __future__ import annotations

import array
import asyncio
import contextlib
import errno
import logging
import os
import socket
import stat
import struct
import time
from collections import deque
from collections.abc import Awaitable, Callable
from dataclasses import dataclass

from msdata_client.wire import FrameReader, encode

from .clientframes import check_frame
from .config import NodeConfig
from .errors import ClosedError, ConfigError, ProtocolError
from .peerprocess import PeerProcess

__all__ = ["ClientConn", "ClientLimits", "UnixEndpoint", "check_socket_dir", "check_socket_place"]

log = logging.getLogger(__name__)

MAX_OUTBOX = 64 << 20  # bytes queued for one client before it is considered stuck and dropped
_ACCEPT_ERRORS = (errno.EMFILE, errno.ENFILE, errno.ENOBUFS, errno.ENOMEM, errno.ECONNABORTED)


@dataclass(frozen=True, slots=True, kw_only=True)
class ClientLimits:
    """What the clients' incoming frames may hold in this server ([node] max_client_frame_kib,
    client_buffer_mib, frame_timeout): a client's largest frame is a hello with its job and states (KiBs)."""

    max_frame: int = 4096 << 10  # bytes of one frame
    buffer_bytes: int = 64 << 20  # bytes of partly received frames, all clients together
    frame_timeout: float = 30.0  # seconds a frame may stay half received

    @classmethod
    def of(cls, node: NodeConfig) -> ClientLimits:
        """The limits a NodeConfig sets."""
        return cls(
            max_frame=node.max_client_frame_kib << 10,
            buffer_bytes=node.client_buffer_mib << 20,
            frame_timeout=float(node.frame_timeout),
        )


class _Held:
    """Bytes of partly received frames held by all connections of one endpoint (bounded by buffer_bytes)."""

    __slots__ = ("bytes",)

    def __init__(self) -> None:
        self.bytes = 0


class ClientConn:
    """One connected local client: frame reader, ordered outbox, and whatever the job attaches.

    ``close()`` shuts the socket down (the reading task sees EOF and ends); the endpoint disposes of the
    socket once that task has finished, so no descriptor is closed under a pending read.
    """

    def __init__(
        self,
        sock: socket.socket,
        loop: asyncio.AbstractEventLoop,
        cid: int,
        limits: ClientLimits | None = None,
        held: _Held | None = None,
    ):
        self.sock = sock
        self.loop = loop
        self.id = cid
        self.limits = limits or ClientLimits()
        self._held = held or _Held()
        hint = f"a client frame is at most [node] max_client_frame_kib = {self.limits.max_frame >> 10} KiB"
        self.reader = FrameReader(self.limits.max_frame, hint)
        self._out: deque[list] = deque()  # [memoryview, fds]
        self._out_bytes = 0
        self._writing = False
        self.closed = False
        self.job = None  # set by the node when the client registers
        self.rank: int | None = None
        self.ended = False  # closed on purpose: the client said bye or was refused (not merely a lost socket)
        self.eof = False  # nothing more will be read from it (the handler may still be finishing)
        self.write_failed = False  # a send failed: the client has closed its end
        self.pid = _peer_pid(sock)
        self.peer = PeerProcess(self.pid, loop)

    def __repr__(self) -> str:
        return f"<client {self.id} pid={self.pid} rank={self.rank}>"

    def send(self, obj: dict, fds: tuple[int, ...] | list[int] = ()) -> None:
        """Queue one frame (and descriptors) and write as much as the socket takes now."""
        if self.closed or self.write_failed:
            return
        data = encode(obj)
        self._out.append([memoryview(data), list(fds)])
        self._out_bytes += len(data)
        if self._out_bytes > MAX_OUTBOX:
            log.warning("%r does not read its socket (%d bytes queued): dropping it", self, self._out_bytes)
            self.close()
            return
        if not self._writing:
            self._flush()

    def refuse(self, kind: str, message: str) -> None:
        """Tell the client why it is refused; the connection then ends on purpose (its rank is not awaited)."""
        self.ended = self.eof = True
        self.send({"t": "error", "kind": kind, "message": message})

    def _flush(self) -> None:
        try:
            while self._out:
                buf, fds = self._out[0]
                if fds:
                    n = self.sock.sendmsg([buf], [(socket.SOL_SOCKET, socket.SCM_RIGHTS, array.array("i", fds))])
                    self._out[0][1] = []  # descriptors travel with the first byte
                else:
                    n = self.sock.send(buf)
                self._out_bytes -= n
                if n == len(buf):
                    self._out.popleft()
                else:
                    self._out[0][0] = buf[n:]
        except (BlockingIOError, InterruptedError):
            if not self._writing:
                self._writing = True
                self.loop.add_writer(self.sock.fileno(), self._on_writable)
            return
        except OSError:  # the client stopped reading (it closed): write no more, but still read what it sent
            self.write_failed = True  # (its last frames may say bye)
            self._out.clear()
            self._out_bytes = 0
        if self._writing:
            self._writing = False
            self.loop.remove_writer(self.sock.fileno())

    def _on_writable(self) -> None:
        self._flush()

    def gone(self) -> bool:
        """True when the client has hung up or said bye, even if the loop has not read it yet."""
        if self.closed or self.eof:
            return True
        try:
            data = self.sock.recv(1 << 16, socket.MSG_PEEK | socket.MSG_DONTWAIT)
        except (BlockingIOError, InterruptedError):
            return False
        except OSError:
            return True
        if not data:
            return True
        peek = FrameReader()
        peek.feed(bytes(self.reader._buf) + data)
        try:
            while (f := peek.next_frame()) is not None:
                if f.get("t") == "bye":
                    return True
        except Exception:
            return False
        return False

    def close(self) -> None:
        if self.closed:
            return
        self.closed = True
        if self._writing:
            self._writing = False
            with contextlib.suppress(ValueError, OSError):
                self.loop.remove_writer(self.sock.fileno())
        self._out.clear()
        with contextlib.suppress(OSError):
            self.sock.shutdown(socket.SHUT_RDWR)

    def dispose(self) -> None:
        """Close for good once nobody reads the socket any more (the endpoint calls it after the handler)."""
        self.close()
        self.sock.close()
        if not self.peer.watching:  # a job that waits for this rank to come back owns the watch
            self.peer.close()

    async def frames(self):
        """Yield incoming frames, checked (``_clientframes``), until EOF; ProtocolError for a malformed stream."""
        try:
            async for frame in self._frames():
                yield frame
        finally:
            self.eof = True

    async def _frames(self):
        try:
            async for frame in self._read():
                yield frame
        finally:
            self._held.bytes -= self.reader.buffered()

    async def _recv(self, partial_since: float) -> bytes:
        """The next bytes; ProtocolError once a frame has stayed half received for [node] frame_timeout."""
        if not self.reader.buffered():
            return await self.loop.sock_recv(self.sock, 1 << 16)
        left = partial_since + self.limits.frame_timeout - time.monotonic()
        try:
            async with asyncio.timeout(max(left, 0.0)):
                return await self.loop.sock_recv(self.sock, 1 << 16)
        except TimeoutError:
            raise ProtocolError(
                f"sent {self.reader.buffered()} bytes of a frame, then nothing more for "
                f"{self.limits.frame_timeout:g} s ([node] frame_timeout): a client sends each frame whole"
            ) from None

    async def _read(self):
        """Frames as they arrive; what is held of a partial frame counts in the endpoint's ``_Held``."""
        partial_since = 0.0  # when the bytes now buffered (a frame not yet whole) began to arrive
        while not self.closed:
            try:
                data = await self._recv(partial_since)
            except (ConnectionError, OSError):
                return
            if not data:
                if self.reader.buffered():  # not refused (a rank whose socket broke mid-write may come back)
                    log.warning(
                        "%r closed its socket inside a frame (%d bytes of it arrived)", self, self.reader.buffered()
                    )
                return
            before = self.reader.buffered()
            if not before:
                partial_since = time.monotonic()
            self.reader.feed(data)
            try:
                while not self.closed and (frame := self.reader.next_frame()) is not None:
                    partial_since = time.monotonic()  # what is left began to arrive now
                    check_frame(frame)
                    if frame["t"] == "bye":
                        self.ended = True
                    yield frame
            finally:
                self._held.bytes += self.reader.buffered() - before
                before = self.reader.buffered()
            if before and self._held.bytes > self.limits.buffer_bytes:
                raise ProtocolError(
                    f"clients hold {self._held.bytes} bytes of partly sent frames, over [node] client_buffer_mib = "
                    f"{self.limits.buffer_bytes >> 20} MiB; this client, with {before} of them, is dropped"
                )


def _peer_pid(sock: socket.socket) -> int | None:
    try:
        creds = sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, struct.calcsize("3i"))
        return struct.unpack("3i", creds)[0]
    except OSError:
        return None


def check_socket_dir(d: str) -> None:
    """ConfigError unless the socket's directory belongs to this user (or root) and no group or other user may
    write it: whoever can write it can replace the socket and serve the ranks (issue 25, item 2)."""
    st = os.stat(d)
    me = os.geteuid()
    if st.st_uid not in (me, 0):
        raise ConfigError(
            f"socket directory {d!r} belongs to uid {st.st_uid}, not to this server's user (uid {me}): its owner "
            f"could replace the socket. Remove it (another user made it), or set [node] socket to a path in a "
            f"directory of your own"
        )
    if st.st_mode & 0o022:
        raise ConfigError(
            f"socket directory {d!r} has mode {stat.S_IMODE(st.st_mode):04o}: group or others may write it and "
            f"replace the socket. Run `chmod go-w {d}` (group access to the socket needs only x on it), or set "
            f"[node] socket to a path in a directory only this user can write"
        )


def _unusable(d: str, e: OSError) -> ConfigError:
    return ConfigError(
        f"cannot make the client socket in {d!r}: {e.strerror or e}; set [node] socket to a path in a directory "
        f"this user can write on a local filesystem (not under a file, not in /proc or /sys)"
    )


def check_socket_place(path: str) -> None:
    """ConfigError unless a server could make its socket at ``path`` (``validate``): the nearest existing
    directory on its way must take a socket (a probe is bound and removed there), and if the socket's
    directory exists, it must pass ``check_socket_dir``."""
    d = os.path.dirname(path) or "."
    a = d
    while not os.path.lexists(a):
        a = os.path.dirname(a) or "."
    if not os.path.isdir(a):
        raise _unusable(d, NotADirectoryError(errno.ENOTDIR, f"{a!r} is a file, not a directory"))
    if a == d:
        check_socket_dir(d)
    probe = os.path.join(a, f".msdata-probe-{os.getpid()}")
    s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        s.bind(probe)
    except OSError as e:
        raise _unusable(d, e) from None
    finally:
        s.close()
    with contextlib.suppress(OSError):
        os.unlink(probe)


class UnixEndpoint:
    """Listening Unix socket for local clients; removes a stale socket file on start, its own on close."""

    def __init__(self, path: str, handler: Callable[[ClientConn], Awaitable[None]], limits: ClientLimits | None = None):
        self.path = path
        self.handler = handler
        self.limits = limits or ClientLimits()
        self._held = _Held()  # partly received frames of all its clients
        self.sock: socket.socket | None = None
        self._next_id = 0
        self.conns: set[ClientConn] = set()

    def bind(self) -> None:
        d = os.path.dirname(self.path) or "."
        try:
            os.makedirs(d, mode=0o700, exist_ok=True)
        except OSError as e:
            raise _unusable(d, e) from None
        check_socket_dir(d)
        if os.path.exists(self.path):
            mode = os.lstat(self.path).st_mode
            if not stat.S_ISSOCK(mode):
                raise ConfigError(
                    f"{self.path!r} exists and is not a socket; remove it or choose another [node] socket"
                )
            probe = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            try:
                probe.connect(self.path)
            except (ConnectionRefusedError, FileNotFoundError):
                os.unlink(self.path)  # stale: its server is gone
                log.info("removed stale socket %s", self.path)
            else:
                raise ConfigError(
                    f"another msdata server is already listening on {self.path!r}; stop it or use another [node] socket"
                )
            finally:
                probe.close()
        s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        old = os.umask(0o077)  # the socket file: this user only (group access: chmod it after start)
        try:
            s.bind(self.path)
        except OSError as e:
            s.close()
            raise _unusable(d, e) from None
        finally:
            os.umask(old)
        s.listen(256)
        s.setblocking(False)
        self.sock = s

    async def serve(self, tasks) -> None:
        """Accept clients until cancelled; each connection's handler is a task owned by ``tasks``."""
        loop = asyncio.get_running_loop()
        while True:
            if self.sock is None:
                raise ClosedError("the endpoint has no socket: call bind() before serve(), and not after close()")
            try:
                conn_sock, _ = await loop.sock_accept(self.sock)
            except OSError as e:
                if e.errno not in _ACCEPT_ERRORS:
                    raise
                # out of descriptors or memory: keep serving the clients we have, try again shortly
                log.error("cannot accept a client on %s: %s; retrying in 0.5 s", self.path, e)
                await asyncio.sleep(0.5)
                continue
            self._accepted(conn_sock, loop, tasks)
            del conn_sock  # no local of this loop may keep a closed client (and the run it joined) alive

    def _accepted(self, conn_sock: socket.socket, loop: asyncio.AbstractEventLoop, tasks) -> None:
        """Start serving one accepted client (its own task; nothing here outlives the call)."""
        conn_sock.setblocking(False)
        self._next_id += 1
        conn = ClientConn(conn_sock, loop, self._next_id, self.limits, self._held)
        self.conns.add(conn)
        tasks.spawn(self._run(conn), name=f"client-{conn.id}")

    async def _run(self, conn: ClientConn) -> None:
        try:
            await self.handler(conn)
        finally:
            conn.dispose()
            self.conns.discard(conn)

    def close(self) -> None:
        if self.sock is not None:
            self.sock.close()
            self.sock = None
            with contextlib.suppress(FileNotFoundError):
                os.unlink(self.path)
