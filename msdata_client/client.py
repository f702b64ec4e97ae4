"""DataClient: what a trainer rank imports. Attaches to its node server, registers the job and its rank,
and yields micro-batches as torch tensors mapped straight from shared memory (no copy).

A batch's slot returns to the ring when the batch's last tensor is garbage-collected (a finalizer on the
mapping sends the release) or at once with ``release(batch)``; never because the next batch was asked for.
Views are private copy-on-write mappings: writable, and writes never reach other readers.
"""

from __future__ import annotations

import logging
import os
import socket
import threading
import time
import weakref
from collections import deque

import torch

from . import lineage as _lineage
from ._paths import ENDPOINT_ENV, default_endpoint
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
from .graph import DGraph, JobSpec
from .mix import check_mixture_change
from .ring import RingMap
from .wire import PROTOCOL_VERSION, FrameReader, encode, recv_into_reader

__all__ = ["Batch", "DataClient"]

log = logging.getLogger(__name__)

STATE_VERSION = 2
# refusals a rank can act on (PeerLostError: retry)
_ERRORS: dict[str, type[MsdataError]] = {
    "ConfigError": ConfigError,
    "CheckpointError": CheckpointError,
    "ProtocolError": ProtocolError,
    "PeerLostError": PeerLostError,
}


class _Ticket:
    """A yielded batch's slot as the server knows it: the connection generation whose releases count for it
    (a reconnect carries it over when the server says it kept the slot for us)."""

    __slots__ = ("gen", "released", "ring", "slot")

    def __init__(self, ring: int, slot: int, gen: int):
        self.ring, self.slot, self.gen, self.released = ring, slot, gen, False


class Batch(dict):
    """A micro-batch: dict[str, torch.Tensor] whose tensors view one ring slot."""

    __slots__ = ("_finalizer", "__weakref__")
    _finalizer: weakref.finalize  # returns the slot (set by DataClient; slots give it no default)


def _env_int(name: str) -> int | None:
    v = os.environ.get(name)
    if v is None or v == "":
        return None
    try:
        return int(v)
    except ValueError:
        raise ConfigError(f"environment variable {name}={v!r} must be an integer") from None


class DataClient:
    """Iterate a job's micro-batches for one rank (see ARCHITECTURE §4.2)."""

    def __init__(
        self,
        job: DGraph | JobSpec,
        endpoint: str | None = None,
        rank: int | None = None,
        world_size: int | None = None,
        *,
        connect_timeout: float = 60.0,
        replay: tuple[int, int] | None = None,
    ):
        """Check the arguments (job, rank and world from torch.distributed's environment when not given) and
        set up the connection state; nothing connects before the first ``next()``. Long only because every
        piece of a rank's state is initialised here, in one place. ``replay=(A, B)``: a read-only client that
        yields this rank's micro-batches of steps A..B (B excluded) as the rank saw them, then stops, without
        joining or disturbing the running job (``msdata_client.lineage.ReplayWindow``)."""
        if isinstance(job, DGraph):
            spec = job.spec
        elif isinstance(job, JobSpec):
            spec = job
        else:
            raise ConfigError(
                f"job must be a DGraph or JobSpec, not {type(job).__name__}; use msd.DGraph.from_toml('job.toml')"
            )
        self.spec = spec
        self._job_dict = spec.to_dict()
        self._digest = spec.digest()
        self.endpoint = endpoint or os.environ.get(ENDPOINT_ENV) or default_endpoint()
        ws = spec.mesh.world_size
        if world_size is None:
            world_size = _env_int("WORLD_SIZE")
        if rank is None:
            rank = _env_int("RANK")
        if rank is None and world_size is None and ws == 1:
            rank, world_size = 0, 1
        if rank is None or world_size is None:
            raise ConfigError(
                "rank and world_size are unknown: pass rank=/world_size= or set RANK and WORLD_SIZE "
                "(torchrun sets them)"
            )
        if world_size != ws:
            raise ConfigError(
                f"{world_size=} does not match the job's mesh {spec.mesh.to_dict()} "
                f"(world size {ws}); fix [mesh] or WORLD_SIZE"
            )
        if not 0 <= rank < world_size:
            raise ConfigError(f"{rank=} is outside 0..{world_size - 1}")
        if connect_timeout <= 0:
            raise ConfigError(f"{connect_timeout=} must be > 0 seconds")
        self.rank = rank
        self.world_size = world_size
        self.connect_timeout = float(connect_timeout)
        self._step = 0
        self._micro = 0
        self._sock: socket.socket | None = None
        self._reader = FrameReader()
        self._rings: dict[int, RingMap] = {}  # ring id -> this rank's private mapping of it
        self._gen = 0  # connection generation: releases from an older connection are void
        self._token = os.urandom(8).hex()  # this client across its reconnects (the server tells it from others)
        self._live: set[_Ticket] = set()  # slots of yielded batches not yet released
        self._carry: list[_Ticket] = []  # of those, the ones the last connection held: offered at the reconnect
        self._ticket_lock = threading.RLock()  # finalizers may run in any thread
        self._releases: deque[tuple[int, int, int]] = deque()
        self._waits: list[float] = []  # seconds each next() blocked, not yet reported (sent with releases)
        self._send_lock = threading.Lock()
        self._iterating = False
        self._closed = False
        self._loaded: dict | None = None  # the state given to load_state_dict, until the first batch
        self._received = False  # a batch arrived: reconnects continue from our position (resume)
        self._latest: dict | None = None  # the newest state this rank knows: a reconnect carries it to the server
        self._pending: deque[dict] = deque()  # batch notices that arrived while waiting for a reply
        self._req_id = 0
        # Release notices wake the server: send them in small groups (a quarter of the ring), and always
        # before this rank waits for the server, so no slot stays taken while anyone waits for it.
        self._release_batch = 1
        self.node: str | None = None
        self._window = None if replay is None else _lineage.ReplayWindow(self.endpoint, spec.name, rank, replay)

    # ---- lifecycle ---------------------------------------------------------------------------------------
    def __enter__(self) -> DataClient:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def __del__(self):
        if not getattr(self, "_closed", True):
            try:
                if self._sock is not None:  # a client dropped without close(): still say bye (never block)
                    self._sock.send(encode({"t": "bye"}), socket.MSG_DONTWAIT)
            except Exception:
                pass
            try:
                self._drop_connection()
            except Exception:
                pass

    def close(self) -> None:
        """Disconnect; the server frees every slot this rank still held. Idempotent."""
        if self._closed:
            return
        self._closed = True
        if self._sock is not None:
            try:
                with self._send_lock:
                    self._sock.sendall(encode({"t": "bye"}))
            except OSError:
                pass
        self._drop_connection()

    def _drop_connection(self) -> None:
        with self._ticket_lock:
            offered = set(self._carry)  # offered at a reconnect whose welcome never came: offer them again
            self._carry = [t for t in self._live.copy() if not t.released and (t.gen == self._gen or t in offered)]
            self._gen += 1
        self._releases.clear()
        self._pending.clear()  # their slots went with the connection; the server re-sends from our position
        if self._sock is not None:
            try:
                self._sock.close()
            except OSError:
                pass
            self._sock = None
        self._rings.clear()  # mappings live on while batches view them
        self._reader.close_fds()
        self._reader = FrameReader()

    # ---- state ---------------------------------------------------------------------------------------------
    def state_dict(self) -> dict:
        """This rank's position in the job's global order: small, JSON-serialisable; put it in the checkpoint.

        Holds the planner state at the start of the rank's current step (per-source cursors, carried pieces,
        mixture history), so any rank's state restores the whole job, on any layout.
        """
        if not self._iterating:
            if self._loaded is not None:
                return dict(self._loaded)
            return self._state(None)
        reply = self._request({"t": "state", "step": self._step}, "state")
        self._latest = self._state(reply["planner"])
        return dict(self._latest)

    def _state(self, planner: dict | None) -> dict:
        return {
            "version": STATE_VERSION,
            "job": self.spec.name,
            "data_digest": self.spec.data_digest(),
            "position": {"step": self._step, "micro": self._micro},
            "layout": self.spec.layout(),
            "planner": planner,
        }

    def load_state_dict(self, state: dict) -> None:
        """Continue from a saved state (any layout: a different mesh is a reshard); call before iterating."""
        if self._window is not None:
            raise ConfigError("a replay=(A, B) client is read-only: it takes no state; use a DataClient without it")
        if self._iterating:
            raise CheckpointError("load_state_dict after iteration started; call it before the first next()")
        if not isinstance(state, dict):
            raise CheckpointError(f"a state must be a dict (from state_dict()), not {type(state).__name__}")
        if state.get("version") != STATE_VERSION:
            raise CheckpointError(
                f"state version {state.get('version')!r} is not {STATE_VERSION}; it was saved by another msdata version"
            )
        if state.get("data_digest") != self.spec.data_digest():
            raise CheckpointError(
                f"state belongs to job {state.get('job')!r} with another data identity (name, seed, "
                "sources, transforms, mixture or cost differ); load it into the job that saved it"
            )
        try:
            pos = state["position"]
            step, micro = int(pos["step"]), int(pos["micro"])
            planner = state["planner"]
            layout = state["layout"]
        except (KeyError, TypeError, ValueError):
            raise CheckpointError(
                "state lacks 'position', 'layout' or 'planner'; it is truncated or malformed"
            ) from None
        if step < 0 or micro < 0:
            raise CheckpointError(f"state position {pos} is negative")
        if planner is None:  # saved before the job started: the beginning
            if step or micro:
                raise CheckpointError("state has a position but no planner state; it is truncated")
            self._loaded = None
            return
        if not isinstance(planner, dict) or planner.get("step") != step or not isinstance(layout, dict):
            raise CheckpointError("state's planner position does not match its step; it is truncated or edited")
        if layout != self.spec.layout():
            micro = 0  # another layout: the step restarts under the new partition (see README: resharding)
        self._loaded = dict(state)
        self._latest = dict(state)
        self._step, self._micro = step, micro

    def set_mixture(self, weights: dict) -> int:
        """Change the whole job's mixture from the first step not yet published to any rank; returns that step.

        Recorded by the server (and in the state) before this returns, so a resume reproduces it.
        """
        if self._window is not None:
            raise ConfigError("a replay=(A, B) client is read-only: set_mixture from a rank of the running job")
        weights = check_mixture_change(weights, self.spec.source_names())
        if not self._iterating:
            self._iterating = True  # registering now is what makes the rank part of the job
        if self._sock is None:
            self._connect()
        cut = int(self._request({"t": "mixture", "weights": dict(weights)}, "mixture")["step"])
        self._latest = self._state(self._request({"t": "state", "step": cut}, "state")["planner"])  # carried
        return cut

    def lineage(self, step: int):
        """The document pieces of this rank's micro-batches of ``step`` (replayed by the server, nothing stored):
        a pyarrow Table with the columns of ``msdata_client.lineage`` (a list of dicts without pyarrow)."""
        if isinstance(step, bool) or not isinstance(step, int) or step < 0:
            raise ConfigError(f"lineage(step={step!r}): step must be an int >= 0")
        cols = _lineage.fetch(self.endpoint, self.spec.name, step, step + 1, rank=self.rank)
        return _lineage.table_or_rows(cols)

    def skip(self, steps: int, defer: bool = False) -> None:
        """Advance the whole job's plan ``steps`` steps from the loaded state without delivering them (after a
        loss spike: reload the checkpoint of step s, skip s..s+k). Call after ``load_state_dict`` and before
        iterating, with the same arguments on every rank (the start refuses ranks that disagree). The skipped
        steps' pieces are dropped from this epoch, or with ``defer`` delivered after the rest of their source's
        epoch; ``lineage`` shows the skipped steps as skipped."""
        skip = _lineage.check_skip(steps, defer)
        if self._iterating:
            raise CheckpointError("skip() after iteration started; call it after load_state_dict, before next()")
        if self._loaded is None:
            raise CheckpointError("skip() counts from a loaded position: call load_state_dict(state) before skip()")
        if "skip" in self._loaded:
            raise CheckpointError("skip() was already called on this state; call it once with the total steps")
        self._loaded = {**self._loaded, "skip": skip}

    def _request(self, frame: dict, reply: str) -> dict:
        """Send a request and wait for its reply; batch notices that arrive meanwhile wait for next()."""
        if self._closed:
            raise ClosedError("DataClient is closed")
        sock = self._connection()
        self._req_id += 1
        rid = self._req_id
        frame = dict(frame, id=rid)
        with self._send_lock:
            try:
                sock.sendall(encode(frame))
            except OSError:
                pass  # the socket broke: the receive below reconnects and sends the request again
        while True:
            f = self._recv_frame(on_reconnect=lambda: self._connection().sendall(encode(frame)))
            t = f["t"]
            if t == "batch":
                self._pending.append(f)
            elif t == reply and f.get("id") == rid:
                return f
            elif t == "refused" and f.get("id") == rid:
                raise _ERRORS.get(f.get("kind", ""), RemoteError)(f.get("message", "refused"))
            else:
                self._control(f)

    # ---- iteration -----------------------------------------------------------------------------------------
    def __iter__(self) -> DataClient:
        return self

    def __next__(self) -> Batch:
        if self._closed:
            raise ClosedError("DataClient is closed; create a new one to read more")
        if self._window is not None:  # a read-only replay client: rebuilt batches, no ring, no registration
            return Batch({k: torch.from_numpy(v) for k, v in self._window.next()[2].items()})
        self._iterating = True
        t0 = time.perf_counter()
        if self._sock is None:
            self._connect()
        if self._pending:
            return self._waited(t0, self._make_batch(self._pending.popleft()))
        while True:
            frame = self._recv_frame()
            t = frame["t"]
            if t == "batch":
                return self._waited(t0, self._make_batch(frame))
            self._control(frame)

    def _waited(self, t0: float, batch: Batch) -> Batch:
        """Note how long this ``next()`` waited for its batch (the server hears it with the next releases)."""
        self._waits.append(round(time.perf_counter() - t0, 6))
        return batch

    def release(self, batch: Batch) -> None:
        """Return the batch's slot now (its tensors must not be used afterwards)."""
        fin = getattr(batch, "_finalizer", None)
        if fin is None:
            raise ValueError("release() takes a batch that this DataClient yielded")
        fin()
        self._flush_releases()

    def _make_batch(self, frame: dict) -> Batch:
        ring, slot = int(frame["ring"]), int(frame["slot"])
        rm = self._rings.get(ring)
        if rm is None:
            raise ProtocolError(f"batch in unknown ring {ring}")
        try:
            owner, arrays, start, end = rm.batch(int(frame["base"]), frame["fields"])
        except (TypeError, ValueError) as e:
            raise ProtocolError(f"malformed batch notice from the server: {e}") from None
        batch = Batch()
        for name, arr in arrays.items():
            batch[name] = torch.from_numpy(arr)
        step, micro = int(frame["step"]), int(frame["micro"])
        if "step" not in batch:  # the server writes them into the slot; a producer that does not, gets them here
            batch["step"] = torch.tensor(step, dtype=torch.int64)
            batch["micro"] = torch.tensor(micro, dtype=torch.int64)
        ticket = _Ticket(ring, slot, self._gen)
        with self._ticket_lock:
            self._live.add(ticket)
        batch._finalizer = weakref.finalize(owner, _release_cb, weakref.ref(self), rm, start, end, ticket)
        del owner, arrays
        micro += 1
        if micro >= self.spec.micro_batches:
            step, micro = step + 1, 0
        self._step, self._micro = step, micro
        self._received = True
        self._loaded = None
        return batch

    def _queue_release(self, ticket: _Ticket) -> None:
        with self._ticket_lock:
            self._live.discard(ticket)
            ticket.released = True
            if ticket.gen != self._gen or self._closed:
                return  # that connection is gone: the server took the slot back (or keeps it for the carry)
            self._releases.append((ticket.ring, ticket.slot, ticket.gen))
        if len(self._releases) >= self._release_batch:
            self._flush_releases()

    def _flush_releases(self) -> None:
        # A finalizer may run inside another send on this thread: never block on the lock, the holder flushes.
        while self._releases:
            if not self._send_lock.acquire(blocking=False):
                return
            try:
                items = []
                while self._releases:
                    r, s, g = self._releases.popleft()
                    if g == self._gen:
                        items.append([r, s])
                waits, self._waits = self._waits, []
                if (items or waits) and self._sock is not None:
                    try:
                        self._sock.sendall(encode({"t": "release", "s": items, "w": waits, "step": self._step}))
                    except OSError:
                        pass  # the reconnect path re-registers; the server freed our slots
            finally:
                self._send_lock.release()

    def _control(self, frame: dict) -> None:
        t = frame["t"]
        if t == "welcome":
            self._add_rings(frame["rings"], frame.get("fds", 0))
            self.node = frame.get("node")
            self._carry_over(frame.get("kept") or [])
        elif t == "ring":
            self._add_rings([frame["ring"]], frame.get("fds", 0))
        elif t == "unring":
            self._rings.pop(int(frame["ring"]), None)  # batches still viewing it keep the mapping alive
        elif t == "error":
            kind, msg = frame.get("kind", "error"), frame.get("message", "")
            self._drop_connection()
            self._closed = True
            raise _ERRORS.get(kind, RemoteError)(msg) if kind in _ERRORS else RemoteError(msg, kind)
        elif t == "shutdown":
            log.info("msdata server at %s is shutting down; will reconnect", self.endpoint)
        elif t in ("pong", "status"):
            pass
        else:
            raise ProtocolError(f"unexpected frame {t!r} from the server")

    def _carry_over(self, kept: list) -> None:
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

    def _add_rings(self, rings: list, nfds: int) -> None:
        fds = self._reader.take_fds(nfds)
        if len(fds) != len(rings):
            raise ProtocolError(f"{len(rings)} rings announced with {len(fds)} descriptors")
        for r, fd in zip(rings, fds):
            try:
                size = int(r["base"]) + int(r["slots"]) * int(r["slot_size"])
                self._rings[int(r["id"])] = RingMap(fd, size)
            finally:
                os.close(fd)  # the mapping holds the segment; the descriptor is no longer needed
            self._release_batch = max(1, int(r["slots"]) // 4)

    # ---- connection ----------------------------------------------------------------------------------------
    def _recv_frame(self, on_reconnect=None) -> dict:
        while True:
            frame = self._reader.next_frame()
            if frame is not None:
                return frame
            self._flush_releases()  # about to wait: the server gets our releases first
            try:
                recv_into_reader(self._connection(), self._reader)
            except (PeerLostError, OSError) as e:
                log.warning(
                    "lost the msdata server at %s (%s); reconnecting at step %d micro %d",
                    self.endpoint,
                    e,
                    self._step,
                    self._micro,
                )
                self._drop_connection()
                self._connect()
                if on_reconnect is not None:
                    on_reconnect()

    def _connection(self) -> socket.socket:
        """The socket to the server, connecting (and registering) first when there is none."""
        return self._sock if self._sock is not None else self._connect()

    def _connect(self) -> socket.socket:
        deadline = time.monotonic() + self.connect_timeout
        delay = 0.02
        last: Exception | None = None
        while True:
            s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            try:
                s.connect(self.endpoint)
                break
            except (FileNotFoundError, ConnectionRefusedError, OSError) as e:
                s.close()
                last = e
                if time.monotonic() + delay > deadline:
                    raise ConnectError(
                        f"no msdata server answered at {self.endpoint!r} within "
                        f"{self.connect_timeout:.0f}s ({type(last).__name__}: {last}); start one with "
                        f"`msdata-server serve` or point {ENDPOINT_ENV} at its socket"
                    ) from None
                time.sleep(delay)
                delay = min(delay * 2, 0.5)
        check_server_uid(s, self.endpoint)  # the server's uid is the socket's, before any batch is trusted
        self._sock = s
        self._reader = FrameReader()
        hello = {
            "t": "hello",
            "v": PROTOCOL_VERSION,
            "job": self._job_dict,
            "digest": self._digest,
            "rank": self.rank,
            "world_size": self.world_size,
            "pid": os.getpid(),
            "position": {"step": self._step, "micro": self._micro},
            "state": self._loaded,
            "resume": self._received or self._gen > 0,  # a reconnect continues this client's run
            "client": self._token,
            "held": [[t.ring, t.slot] for t in self._carry],
            "latest": self._latest if self._received or self._gen > 0 else None,
        }
        with self._send_lock:
            s.sendall(encode(hello))
        return s


def _release_cb(client_ref, rm: RingMap, start: int, end: int, ticket: _Ticket) -> None:
    rm.scrub(start, end)  # pages this rank wrote must not hide the next batch in this slot
    client = client_ref()
    if client is not None:
        client._queue_release(ticket)
