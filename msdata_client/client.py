"""DataClient: what a trainer rank imports. Attaches to its node server, registers the job and its rank,
and yields micro-batches as torch tensors mapped straight from shared memory (no copy).

A batch's slot returns to the ring when the batch's last tensor is garbage-collected (a finalizer on the
mapping sends the release) or at once with ``release(batch)``; never because the next batch was asked for.
Views are private copy-on-write mappings: writable, and writes never reach other readers. The socket, its
reconnects and the slots the server holds for this rank are ``connection.Connection``'s.
"""

from __future__ import annotations

import logging
import os
import time
import weakref
from typing import Any

import torch

from . import lineage as _lineage
from ._paths import ENDPOINT_ENV, default_endpoint
from .connection import Connection, Registration, Ticket
from .errors import CheckpointError, ClosedError, ConfigError, ProtocolError
from .graph import DGraph, JobSpec
from .mix import check_mixture_change
from .ring import RingMap
from .tokenizer import pad_warning

__all__ = ["Batch", "DataClient"]

log = logging.getLogger(__name__)

STATE_VERSION = 2


class Batch(dict[str, torch.Tensor]):
    """A micro-batch: dict[str, torch.Tensor] whose tensors view one ring slot."""

    __slots__ = ("__weakref__", "_finalizer")
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
    ) -> None:
        """Check the arguments (job, rank and world from torch.distributed's environment when not given) and
        set up the connection state; nothing connects before the first ``next()``. ``replay=(A, B)``: a
        read-only client that yields this rank's micro-batches of steps A..B (B excluded) as the rank saw
        them, then stops, without joining or disturbing the running job (``msdata_client.lineage.ReplayWindow``)."""
        if isinstance(job, DGraph):
            spec = job.spec
        elif isinstance(job, JobSpec):
            spec = job
        else:
            raise ConfigError(
                f"job must be a DGraph or JobSpec, not {type(job).__name__}; use msd.DGraph.from_toml('job.toml')"
            )
        self.spec = spec
        endpoint = endpoint or os.environ.get(ENDPOINT_ENV) or default_endpoint()
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
        self._iterating = False
        # the rank and its position (and loaded state) that every hello carries: moved here, read by the connection
        self._reg = Registration(job=spec.to_dict(), digest=spec.digest(), rank=rank, world_size=world_size)
        self._conn = Connection(endpoint, float(connect_timeout), self._reg)
        self._window = None if replay is None else _lineage.ReplayWindow(endpoint, spec.name, rank, replay)
        if rank == 0 and (warning := pad_warning(spec.pad_id, (s.transform for s in spec.sources))):
            log.warning("job %s: %s", spec.name, warning)  # once per job, from its first rank

    # The attributes a rank had before the connection moved out, read and written through to where they live
    # (the next hello carries them).
    @property
    def rank(self) -> int:
        return self._reg.rank

    @rank.setter
    def rank(self, rank: int) -> None:
        self._reg.rank = rank

    @property
    def world_size(self) -> int:
        return self._reg.world_size

    @world_size.setter
    def world_size(self, world_size: int) -> None:
        self._reg.world_size = world_size

    @property
    def endpoint(self) -> str:
        return self._conn.endpoint

    @endpoint.setter
    def endpoint(self, endpoint: str) -> None:
        self._conn.endpoint = endpoint

    @property
    def connect_timeout(self) -> float:
        return self._conn.connect_timeout

    @connect_timeout.setter
    def connect_timeout(self, seconds: float) -> None:
        self._conn.connect_timeout = seconds

    @property
    def node(self) -> str | None:
        """The name of the node server this rank is attached to (None before its welcome)."""
        return self._conn.node

    # ---- lifecycle ---------------------------------------------------------------------------------------
    def __enter__(self) -> DataClient:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __del__(self) -> None:
        conn = getattr(self, "_conn", None)  # None: the constructor refused its arguments
        if conn is not None:
            conn.abandon()

    def close(self) -> None:
        """Disconnect; the server frees every slot this rank still held. Idempotent."""
        self._conn.close()

    # ---- state ---------------------------------------------------------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        """This rank's position in the job's global order: small, JSON-serialisable; put it in the checkpoint.

        Holds the planner state at the start of the rank's current step (per-source cursors, carried pieces,
        mixture history), so any rank's state restores the whole job, on any layout.
        """
        if not self._iterating:
            if self._reg.state is not None:
                return dict(self._reg.state)
            return self._state(None)
        reply = self._conn.request({"t": "state", "step": self._reg.step}, "state")
        self._reg.latest = self._state(reply["planner"])
        return dict(self._reg.latest)

    def _state(self, planner: dict[str, Any] | None) -> dict[str, Any]:
        return {
            "version": STATE_VERSION,
            "job": self.spec.name,
            "data_digest": self.spec.data_digest(),
            "position": {"step": self._reg.step, "micro": self._reg.micro},
            "layout": self.spec.layout(),
            "planner": planner,
        }

    def load_state_dict(self, state: dict[str, Any] | None) -> None:
        """Continue from a saved state (any layout: a different mesh is a reshard); call before iterating.
        ``None`` (no checkpoint yet: ``ckpt.get("data")`` on a first run) is a fresh start at the beginning."""
        if self._window is not None:
            raise ConfigError("a replay=(A, B) client is read-only: it takes no state; use a DataClient without it")
        if self._iterating:
            raise CheckpointError("load_state_dict after iteration started; call it before the first next()")
        if state is None:  # a first run: the trainer has no checkpoint to give
            self._reg.state = self._reg.latest = None
            self._reg.step, self._reg.micro = 0, 0
            return
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
            self._reg.state = None
            return
        if not isinstance(planner, dict) or planner.get("step") != step or not isinstance(layout, dict):
            raise CheckpointError("state's planner position does not match its step; it is truncated or edited")
        if layout != self.spec.layout():
            micro = 0  # another layout: the step restarts under the new partition (see README: resharding)
        self._reg.state = dict(state)
        self._reg.latest = dict(state)
        self._reg.step, self._reg.micro = step, micro

    def set_mixture(self, weights: dict[str, float]) -> int:
        """Change the whole job's mixture from the first step not yet published to any rank; returns that step.

        Recorded by the server (and in the state) before this returns, so a resume reproduces it.
        """
        if self._window is not None:
            raise ConfigError("a replay=(A, B) client is read-only: set_mixture from a rank of the running job")
        weights = check_mixture_change(weights, self.spec.source_names())
        self._iterating = True  # registering now is what makes the rank part of the job
        cut = int(self._conn.request({"t": "mixture", "weights": dict(weights)}, "mixture")["step"])
        reply = self._conn.request({"t": "state", "step": cut}, "state")
        self._reg.latest = self._state(reply["planner"])  # a reconnect to a server that lost it carries it
        return cut

    def lineage(self, step: int) -> Any:
        """The document pieces of this rank's micro-batches of ``step`` (replayed by the server, nothing stored):
        a pyarrow Table with the columns of ``msdata_client.lineage`` (a list of dicts without pyarrow)."""
        if isinstance(step, bool) or not isinstance(step, int) or step < 0:
            raise ConfigError(f"lineage(step={step!r}): step must be an int >= 0")
        cols = _lineage.fetch(self.endpoint, self.spec.name, step, step + 1, rank=self.rank)
        return _lineage.table_or_rows(cols)

    def skip(self, steps: int | tuple[int, int], defer: bool = False) -> None:
        """Advance the whole job's plan without delivering some steps (after a loss spike). ``steps=k``: the k
        steps from the loaded state (reload the checkpoint of step s, skip s..s+k-1). ``steps=(A, B)``: the
        absolute steps A..B-1, from a state saved at or before A (steps before A are delivered as usual; from B
        on the run is the one ``skip(steps=B-A)`` from the state at A gives). Call after ``load_state_dict`` and
        before iterating, with the same arguments on every rank (the start refuses ranks that disagree). The
        skipped steps' pieces are dropped from this epoch, or with ``defer`` delivered after the rest of their
        source's epoch; ``lineage`` shows the skipped steps as skipped."""
        skip = _lineage.check_skip(steps, defer)
        if self._iterating:
            raise CheckpointError("skip() after iteration started; call it after load_state_dict, before next()")
        if self._reg.state is None:
            raise CheckpointError("skip() counts from a loaded position: call load_state_dict(state) before skip()")
        if "skip" in self._reg.state:
            raise CheckpointError("skip() was already called on this state; call it once with the total steps")
        at = self._reg.step
        if "start" in skip and skip["start"] < at:
            raise CheckpointError(
                f"skip(steps=({skip['start']}, {skip['stop']})): the loaded state is at step {at}, past step "
                f"{skip['start']}; load a checkpoint saved at or before step {skip['start']}"
            )
        self._reg.state = {**self._reg.state, "skip": skip}

    # ---- iteration -----------------------------------------------------------------------------------------
    def __iter__(self) -> DataClient:
        return self

    def __next__(self) -> Batch:
        if self._conn.closed:
            raise ClosedError("DataClient is closed; create a new one to read more")
        if self._window is not None:  # a read-only replay client: rebuilt batches, no ring, no registration
            return Batch({k: torch.from_numpy(v) for k, v in self._window.next()[2].items()})
        self._iterating = True
        t0 = time.perf_counter()
        frame = self._conn.next_batch()
        batch = self._make_batch(frame)
        self._conn.note_wait(time.perf_counter() - t0)  # the server hears it with the next releases
        return batch

    def release(self, batch: Batch) -> None:
        """Return the batch's slot now (its tensors must not be used afterwards)."""
        fin = getattr(batch, "_finalizer", None)
        if fin is None:
            raise ValueError("release() takes a batch that this DataClient yielded")
        fin()
        self._conn.flush_releases()

    def _make_batch(self, frame: dict[str, Any]) -> Batch:
        """Map a batch notice's slot as torch tensors (no copy) and move this rank's position past it."""
        ring, slot = int(frame["ring"]), int(frame["slot"])
        rm = self._conn.ring(ring)
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
        ticket = self._conn.lease(ring, slot)
        batch._finalizer = weakref.finalize(owner, _release_cb, weakref.ref(self._conn), rm, start, end, ticket)
        del owner, arrays
        micro += 1
        if micro >= self.spec.micro_batches:
            step, micro = step + 1, 0
        reg = self._reg
        reg.step, reg.micro = step, micro
        reg.received = True
        reg.state = None
        return batch


def _release_cb(conn_ref: weakref.ReferenceType[Connection], rm: RingMap, start: int, end: int, ticket: Ticket) -> None:
    rm.scrub(start, end)  # pages this rank wrote must not hide the next batch in this slot
    conn = conn_ref()
    if conn is not None:
        conn.queue_release(ticket)
