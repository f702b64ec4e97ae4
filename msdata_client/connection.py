"""A rank's link to its node server: the Unix socket, its reconnects, frames in and out, and the ring slots
the server holds for it.

``Connection`` connects (with a timeout), registers the rank with a hello built from its ``Registration``,
maps the rings whose descriptors arrive with ``welcome``/``ring`` frames, answers requests, and, when the
socket breaks, connects again and re-registers from the rank's position. The slots of yielded batches are
leased per connection generation (``Ticket``): a release counts only on the connection that handed the slot
out, or on a later one when the server says at the reconnect that it kept the slot for us. ``DataClient``
(client.py) is the facade a trainer sees; this module imports no torch.
"""

from __future__ import annotations

import contextlib
import logging
import os
import select
import socket
import threading
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from ._paths import ENDPOINT_ENV
from ._peercred import check_server_uid
from .errors import (
    CheckpointError,
    ClosedError,
    ConfigError,
    ConnectError,
    MsdataError,
    PeerLostError,
    ProtocolError,
    RemoteError,
)
from .ring import RingMap
from .waiting import log_every, server_view
from .wire import PROTOCOL_VERSION, FrameReader, encode, recv_into_reader

__all__ = ["Connection", "Registration", "Ticket"]

log = logging.getLogger(__name__)

# refusals a rank can act on (PeerLostError: retry)
_ERRORS: dict[str, type[MsdataError]] = {
    "ConfigError": ConfigError,
    "CheckpointError": CheckpointError,
    "ProtocolError": ProtocolError,
    "PeerLostError": PeerLostError,
}
_BYE = encode({"t": "bye"})


@dataclass(slots=True, kw_only=True)
class Registration:
    """Who a rank is and where it stands: what every hello tells the server. The client moves the position
    as batches arrive; the connection reads it at each (re)connect and in its release reports."""

    job: dict[str, Any]
    digest: str
    rank: int
    world_size: int
    step: int = 0
    micro: int = 0
    state: dict[str, Any] | None = None  # the state given to load_state_dict, until the first batch
    received: bool = False  # a batch arrived: reconnects continue from our position (resume)
    latest: dict[str, Any] | None = None  # the newest state this rank knows: a reconnect carries it to the server


class Ticket:
    """A yielded batch's slot as the server knows it: the connection generation whose releases count for it
    (a reconnect carries it over when the server says it kept the slot for us)."""

    __slots__ = ("gen", "released", "ring", "slot")

    def __init__(self, ring: int, slot: int, gen: int) -> None:
        self.ring, self.slot, self.gen, self.released = ring, slot, gen, False


class Connection:
    """One rank's socket to its node server, reconnected when it breaks, and the slots it holds there.

    Invariant: every ticket in ``_live`` is a yielded batch not yet released; ``_carry`` holds those that a
    dropped connection held, offered in the next hello until a welcome says which the server kept. Releases
    wait in ``_releases`` (at most a quarter of a ring, or until this rank waits for the server).
    """

    def __init__(self, endpoint: str, connect_timeout: float, registration: Registration) -> None:
        self.endpoint = endpoint
        self.connect_timeout = connect_timeout
        self.node: str | None = None  # the server's node name, from its welcome
        self.closed = False
        self.sock: socket.socket | None = None
        self.rings: dict[int, RingMap] = {}  # ring id -> this rank's private mapping of it
        self._reg = registration
        self._reader = FrameReader()
        self._gen = 0  # connection generation: releases from an older connection are void
        self._token = os.urandom(8).hex()  # this client across its reconnects (the server tells it from others)
        self._live: set[Ticket] = set()  # slots of yielded batches not yet released
        self._carry: list[Ticket] = []  # of those, the ones the last connection held: offered at the reconnect
        self._ticket_lock = threading.RLock()  # finalizers may run in any thread
        self._releases: deque[tuple[int, int, int]] = deque()
        self._waits: list[float] = []  # seconds each next() blocked, not yet reported (sent with releases)
        self._send_lock = threading.Lock()
        self._pending: deque[dict[str, Any]] = deque()  # batch notices that arrived while waiting for a reply
        self._req_id = 0
        # Release notices wake the server: send them in small groups (a quarter of the ring), and always
        # before this rank waits for the server, so no slot stays taken while anyone waits for it.
        self._release_batch = 1
        self._welcomed = False  # this connection's welcome arrived: the job runs (before it, the start barrier)
        self._hello_at = 0.0  # when this connection registered (monotonic): how long the rank waits for its peers

    # ---- connect, drop, close ------------------------------------------------------------------------------
    def _open_socket(self) -> socket.socket:
        """A socket connected to the endpoint, retried with backoff until ``connect_timeout``; the one place
        a socket to the server is opened (checks of the server's identity go just before the return). While
        nobody answers it logs, every few seconds, the socket it tries and how long it has waited."""
        t0 = time.monotonic()
        deadline = t0 + self.connect_timeout
        every = log_every(self.connect_timeout)
        next_log = t0 + every
        delay = 0.02
        while True:
            s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            try:
                s.connect(self.endpoint)
            except (FileNotFoundError, ConnectionRefusedError, OSError) as e:
                s.close()
                if time.monotonic() + delay > deadline:
                    raise ConnectError(
                        f"no msdata server answered at {self.endpoint!r} within "
                        f"{self.connect_timeout:.0f}s ({type(e).__name__}: {e}); start one with "
                        f"`msdata-server serve` or point {ENDPOINT_ENV} at its socket"
                    ) from None
                if time.monotonic() >= next_log:
                    log.warning(
                        "waiting for the msdata server at %s (%.1fs of %.0fs: %s); start it with "
                        "`msdata-server serve` or point %s at its socket",
                        self.endpoint,
                        time.monotonic() - t0,
                        self.connect_timeout,
                        type(e).__name__,
                        ENDPOINT_ENV,
                    )
                    next_log += every
                time.sleep(delay)
                delay = min(delay * 2, 0.5, every)
                continue
            try:
                check_server_uid(s, self.endpoint)  # the server's uid is the socket's, before any batch is trusted
            except BaseException:
                s.close()
                raise
            return s

    def connect(self) -> socket.socket:
        """Connect and register this rank (the hello); the welcome arrives with the next frames."""
        s = self._open_socket()
        self.sock = s
        self._reader = FrameReader()
        self._welcomed, self._hello_at = False, time.monotonic()
        with self._send_lock:
            s.sendall(encode(self._hello()))
        return s

    def _hello(self) -> dict[str, Any]:
        reg = self._reg
        return {
            "t": "hello",
            "v": PROTOCOL_VERSION,
            "job": reg.job,
            "digest": reg.digest,
            "rank": reg.rank,
            "world_size": reg.world_size,
            "pid": os.getpid(),
            "position": {"step": reg.step, "micro": reg.micro},
            "state": reg.state,
            "resume": reg.received or self._gen > 0,  # a reconnect continues this client's run
            "client": self._token,
            "held": [[t.ring, t.slot] for t in self._carry],
            "latest": reg.latest if reg.received or self._gen > 0 else None,
        }

    def live_socket(self) -> socket.socket:
        """The socket to the server, connecting (and registering) first when there is none."""
        return self.sock if self.sock is not None else self.connect()

    def drop(self) -> None:
        """Forget the socket and its rings (mappings live on while batches view them); the next use connects
        again, offering the slots of batches still alive."""
        with self._ticket_lock:
            offered = set(self._carry)  # offered at a reconnect whose welcome never came: offer them again
            self._carry = [t for t in self._live.copy() if not t.released and (t.gen == self._gen or t in offered)]
            self._gen += 1
        self._releases.clear()
        self._pending.clear()  # their slots went with the connection; the server re-sends from our position
        if self.sock is not None:
            with contextlib.suppress(OSError):
                self.sock.close()
            self.sock = None
        self.rings.clear()
        self._reader.close_fds()
        self._reader = FrameReader()

    def close(self) -> None:
        """Say bye and disconnect; the server frees every slot this rank still held. Idempotent."""
        if self.closed:
            return
        self.flush_releases()  # the last waits first: the server's count of micro-batches delivered is exact
        self.closed = True
        if self.sock is not None:
            try:
                with self._send_lock:
                    self.sock.sendall(_BYE)
            except OSError:
                pass
        self.drop()

    def abandon(self) -> None:
        """The client was dropped without close(): still say bye, never blocking, and never raise."""
        if self.closed:
            return
        try:
            if self.sock is not None:
                self.sock.send(_BYE, socket.MSG_DONTWAIT)
        except Exception:
            pass
        with contextlib.suppress(Exception):
            self.drop()

    # ---- frames in -----------------------------------------------------------------------------------------
    def request(self, frame: dict[str, Any], reply: str) -> dict[str, Any]:
        """Send a request and wait for its reply; batch notices that arrive meanwhile wait for next()."""
        if self.closed:
            raise ClosedError("DataClient is closed")
        sock = self.live_socket()
        self._req_id += 1
        rid = self._req_id
        frame = dict(frame, id=rid)
        with self._send_lock, contextlib.suppress(OSError):  # broken: the receive below reconnects, sends it again
            sock.sendall(encode(frame))
        while True:
            f = self._recv_frame(on_reconnect=lambda: self.live_socket().sendall(encode(frame)))
            t = f["t"]
            if t == "batch":
                self._pending.append(f)
            elif t == reply and f.get("id") == rid:
                return f
            elif t == "refused" and f.get("id") == rid:
                raise _ERRORS.get(f.get("kind", ""), RemoteError)(f.get("message", "refused"))
            else:
                self._control(f)

    def next_batch(self) -> dict[str, Any]:
        """The next batch notice: one that arrived during a request, else the next from the server (the
        control frames before it handled on the way)."""
        if self.sock is None:
            self.connect()
        if self._pending:
            return self._pending.popleft()
        while True:
            frame = self._recv_frame()
            if frame["t"] == "batch":
                return frame
            self._control(frame)

    def _recv_frame(self, on_reconnect: Callable[[], None] | None = None) -> dict[str, Any]:
        while True:
            frame = self._reader.next_frame()
            if frame is not None:
                return frame
            self.flush_releases()  # about to wait: the server gets our releases first
            sock = self.live_socket()
            if not self._welcomed:
                self._await_start(sock)
            try:
                recv_into_reader(sock, self._reader)
            except (PeerLostError, OSError) as e:
                log.warning(
                    "lost the msdata server at %s (%s); reconnecting at step %d micro %d",
                    self.endpoint,
                    e,
                    self._reg.step,
                    self._reg.micro,
                )
                self.drop()
                self.connect()
                if on_reconnect is not None:
                    on_reconnect()

    def _await_start(self, sock: socket.socket) -> None:
        """Before this connection's welcome the job has not started: its other ranks have not all registered.
        Wait for the server's next frame, logging every few seconds what the rank waits for (the server's view of
        the job's ranks, ``waiting.server_view``); past ``connect_timeout`` with ranks still missing, a
        ConnectError that names them. A job whose ranks all registered is starting: that wait is not bounded."""
        every = log_every(self.connect_timeout)
        while not select.select([sock], [], [], every)[0]:
            reg = self._reg
            view = server_view(self.endpoint, str(reg.job["job"]["name"]), reg.digest, reg.rank, reg.world_size)
            waited = time.monotonic() - self._hello_at
            if view.missing and waited >= self.connect_timeout:
                self.drop()  # the server forgets this rank's registration
                raise ConnectError(
                    f"rank {reg.rank} waited {waited:.0f}s at {self.endpoint!r} for the other ranks of its job: "
                    f"{view.detail()}; start every rank of the mesh (world size {reg.world_size}) against "
                    "their node servers, or raise connect_timeout"
                )
            log.warning(
                "rank %d of %d waits at %s for its job to start (%.1fs; %.0fs at most while ranks are missing): %s",
                reg.rank,
                reg.world_size,
                self.endpoint,
                waited,
                self.connect_timeout,
                view.detail(),
            )

    def _control(self, frame: dict[str, Any]) -> None:
        t = frame["t"]
        if t == "welcome":
            self._welcomed = True
            self._add_rings(frame["rings"], frame.get("fds", 0))
            self.node = frame.get("node")
            self._carry_over(frame.get("kept") or [])
        elif t == "ring":
            self._add_rings([frame["ring"]], frame.get("fds", 0))
        elif t == "unring":
            self.rings.pop(int(frame["ring"]), None)  # batches still viewing it keep the mapping alive
        elif t == "error":
            kind, msg = frame.get("kind", "error"), frame.get("message", "")
            self.drop()
            self.closed = True
            raise _ERRORS.get(kind, RemoteError)(msg) if kind in _ERRORS else RemoteError(msg, kind)
        elif t == "shutdown":
            log.info("msdata server at %s is shutting down; will reconnect", self.endpoint)
        elif t in ("pong", "status"):
            pass
        else:
            raise ProtocolError(f"unexpected frame {t!r} from the server")

    def _add_rings(self, rings: list[dict[str, Any]], nfds: int) -> None:
        """Map the rings announced in a frame from the descriptors that came with it (SCM_RIGHTS)."""
        fds = self._reader.take_fds(nfds)
        if len(fds) != len(rings):
            raise ProtocolError(f"{len(rings)} rings announced with {len(fds)} descriptors")
        for r, fd in zip(rings, fds):
            try:
                size = int(r["base"]) + int(r["slots"]) * int(r["slot_size"])
                self.rings[int(r["id"])] = RingMap(fd, size)
            finally:
                os.close(fd)  # the mapping holds the segment; the descriptor is no longer needed
            self._release_batch = max(1, int(r["slots"]) // 4)

    # ---- slots and releases --------------------------------------------------------------------------------
    def ring(self, ring: int) -> RingMap:
        """This rank's mapping of a ring that a batch notice names."""
        rm = self.rings.get(ring)
        if rm is None:
            raise ProtocolError(f"batch in unknown ring {ring}")
        return rm

    def lease(self, ring: int, slot: int) -> Ticket:
        """A yielded batch holds this slot until ``queue_release(ticket)``."""
        ticket = Ticket(ring, slot, self._gen)
        with self._ticket_lock:
            self._live.add(ticket)
        return ticket

    def _carry_over(self, kept: list[list[int]]) -> None:
        """The server kept these slots of batches we yielded before a reconnect: their releases count again."""
        keep = {(int(r), int(s)) for r, s in kept}
        with self._ticket_lock:
            for t in self._carry:
                if (t.ring, t.slot) not in keep:
                    continue
                if t.released:  # released while we reconnected: that release was void, send it now
                    self._releases.append((t.ring, t.slot, self._gen))
                else:
                    t.gen = self._gen
            self._carry = []

    def note_wait(self, seconds: float) -> None:
        """How long a ``next()`` waited for its batch (the server hears it with the next releases)."""
        self._waits.append(round(seconds, 6))

    def queue_release(self, ticket: Ticket) -> None:
        """The batch holding ``ticket`` is gone (may run in any thread, inside another send)."""
        with self._ticket_lock:
            self._live.discard(ticket)
            ticket.released = True
            if ticket.gen != self._gen or self.closed:
                return  # that connection is gone: the server took the slot back (or keeps it for the carry)
            self._releases.append((ticket.ring, ticket.slot, ticket.gen))
        if len(self._releases) >= self._release_batch:
            self.flush_releases()

    def flush_releases(self) -> None:
        """Send the queued releases and waits now."""
        # A finalizer may run inside another send on this thread: never block on the lock, the holder flushes.
        while self._releases or self._waits:
            if not self._send_lock.acquire(blocking=False):
                return
            try:
                items = []
                while self._releases:
                    r, s, g = self._releases.popleft()
                    if g == self._gen:
                        items.append([r, s])
                waits, self._waits = self._waits, []
                if (items or waits) and self.sock is not None:
                    with contextlib.suppress(OSError):  # the reconnect path re-registers; the server freed our slots
                        self.sock.sendall(encode({"t": "release", "s": items, "w": waits, "step": self._reg.step}))
            finally:
                self._send_lock.release()
