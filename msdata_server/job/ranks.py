"""The ranks of one job on this node: who is connected, where each is, what it brought; the start barrier.

A rank's position is the next micro-batch it expects. A rank reads a micro-batch when it is present (connected,
or away: it lost its socket while its process still runs) and not already past it (a rank that resumed further
along skips what it had).

Reconnects are exact: every batch notice published to a rank is kept until the rank releases its slot. A rank
that comes back (same client, ``resume``) names the first micro-batch it did not receive and the slots it still
holds; it gets the kept notices from there on again, the slots it no longer holds are freed. Bound: the kept
notices of a rank are its published, unreleased slots (at most the slots of its group's rings). An away rank
holds its slots until it comes back, its process exits, or ``grace`` seconds pass; then it is dropped.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any

from msdata_client.ring import FieldLayout
from msdata_client.spec import JobSpec

from ..batch import BATCH_FIELDS
from ..checkpoint import RankStart
from ..errors import CheckpointError, ConfigError

__all__ = ["RankPosition", "RankRegistry"]

log = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True, order=True)
class RankPosition:
    """The next micro-batch a rank expects: (step, micro)."""

    step: int = 0
    micro: int = 0


RECONNECT_GRACE = 60.0  # seconds an away rank keeps its slots (the client's default connect_timeout)


@dataclass(frozen=True, slots=True, kw_only=True)
class Rejoin:
    """What a rank that comes back gets: the kept notices from its position on (in order), the slots it
    holds from before (they stay taken), and the slots it no longer holds (to free)."""

    resend: list[dict]
    kept: list[list[int]]
    free: list[tuple[int, int]]

    def report(self, job: str, rank: int, position: RankPosition) -> None:
        """Log what the rank gets again, if anything."""
        if self.resend or self.kept:
            log.info(
                "job %s: rank %d is back at step %d micro %d: %d micro-batch(es) sent again, %d still held",
                job,
                rank,
                position.step,
                position.micro,
                len(self.resend),
                len(self.kept),
            )


class RankRegistry:
    """Connections, positions and brought states of a job's ranks on this node."""

    def __init__(self, spec: JobSpec, *, grace: float = RECONNECT_GRACE):
        self.spec = spec
        self.mesh = spec.mesh
        self.grace = grace
        self.conns: dict[int, Any] = {}  # rank -> ClientConn (msdata_server.endpoint)
        self.positions: dict[int, RankPosition] = {}
        self.states: dict[int, dict | None] = {}  # rank -> the state it brought (load_state_dict), if any
        self.latest: dict[int, dict | None] = {}  # rank -> the newest state it carries when it reconnects
        self.resuming: dict[int, bool] = {}  # rank -> it reconnects mid-run (continue where it was)
        self.clients: dict[int, str | None] = {}  # rank -> its client's token (one DataClient across reconnects)
        self.sent: dict[int, dict[tuple[int, int], dict]] = {}  # rank -> (ring, slot) -> unreleased notice
        self.away: dict[int, tuple[Any, asyncio.TimerHandle]] = {}  # rank -> (its lost conn, the grace timer)
        self.expired: dict[int, str | None] = {}  # rank -> the client that was dropped while away
        self._selectors: dict[int, tuple[set, str]] = {}  # rank -> (fields it reads, its CP index)

    # ---- who is here ----
    @property
    def connected(self) -> int:
        """Ranks whose connection is still read: one at EOF counts until its handler has detached it (then it is
        dropped or away), never by a peek at its socket, so a job never closes under a rank about to be away."""
        return sum(1 for c in self.conns.values() if not (c.closed or c.eof))

    def live_ranks(self) -> list[int]:
        """Ranks whose client is still there (a client that hung up but whose EOF is unread is not)."""
        return [r for r, c in self.conns.items() if not c.gone()]

    def complete(self) -> bool:
        """The start barrier on one node: every rank of the mesh registered here and still connected."""
        return len(self.conns) == self.mesh.world_size and all(not c.closed for c in self.conns.values())

    def connected_ranks(self) -> list[int]:
        return sorted(r for r, c in self.conns.items() if not c.closed)

    def present(self, ranks: Iterable[int]) -> list[int]:
        """Those of ``ranks`` that read here: connected, or away and expected back."""
        return [r for r in ranks if r in self.away or ((c := self.conns.get(r)) is not None and not c.closed)]

    # ---- admission ----
    def check_rank(self, rank: int, world_size: int, client: str | None = None) -> None:
        name, ws = self.spec.name, self.mesh.world_size
        if world_size != ws:
            raise ConfigError(
                f"rank {rank} says world_size={world_size} but job {name!r} has a mesh of {ws} ranks "
                f"({self.mesh.to_dict()}); make WORLD_SIZE and the [mesh] agree"
            )
        if not 0 <= rank < ws:
            raise ConfigError(
                f"rank {rank} is outside the world of job {name!r} (world_size={ws}); ranks are 0..{ws - 1}"
            )
        if client and self.expired.get(rank) == client:
            raise CheckpointError(
                f"rank {rank} of job {name!r} was away longer than reconnect_grace ({self.grace:g} s) and the "
                "micro-batches built meanwhile were not kept for it; restart the ranks from their last checkpoint "
                "(or raise [node] reconnect_grace)"
            )
        old = self.conns.get(rank)
        if old is not None and not old.gone() and not (client and self.clients.get(rank) == client):
            raise ConfigError(
                f"rank {rank} of job {name!r} is already connected (pid {old.pid}); "
                "two trainer processes claim the same RANK (for a new run, stop the old one first)"
            )

    def check_state(self, state: dict | None) -> None:
        """A state a rank brings must belong to this job's data identity (any layout)."""
        if state is None:
            return
        if not isinstance(state, dict) or not isinstance(state.get("planner"), dict):
            raise CheckpointError("the state has no planner position; it is truncated or not an msdata state")
        if state.get("data_digest") != self.spec.data_digest():
            raise CheckpointError(
                f"the state belongs to another data identity than job {self.spec.name!r} (name, "
                "seed, sources, transforms, mixture or cost differ); restore it into the job that "
                "saved it"
            )

    def add(
        self,
        conn,
        rank: int,
        position: RankPosition,
        state: dict | None,
        resume: bool,
        client: str | None = None,
        latest: dict | None = None,
    ) -> None:
        old = self.conns.get(rank)
        if old is not None and old is not conn:
            old.close()  # the same client's previous connection (check_rank let it through): it is stale
        self._back(rank)
        self.conns[rank] = conn
        self.positions[rank] = position
        self.states[rank] = state
        self.resuming[rank] = resume
        self.clients[rank] = client
        self.latest[rank] = latest

    # ---- ranks that lose their socket ----
    def hold(self, rank: int, conn, expire: Callable[[int], None]) -> bool:
        """``rank`` lost its connection ``conn`` without saying bye: keep it as a reader (its slots and notices
        stay) until it comes back; ``expire(rank)`` runs when its process exits or the grace runs out first.
        False when its process is already gone (drop it now)."""
        if conn.peer.exited():
            return False
        timer = asyncio.get_running_loop().call_later(self.grace, self._expire, rank, expire)
        self.away[rank] = (conn, timer)
        conn.peer.watch(lambda: self._expire(rank, expire))
        return True

    def _expire(self, rank: int, expire: Callable[[int], None]) -> None:
        if rank in self.away:
            self._back(rank)
            self.expired[rank] = self.clients.get(rank)
            expire(rank)

    def _back(self, rank: int) -> None:
        """The rank is no longer away (it came back, or it is dropped): stop its timer and process watch."""
        entry = self.away.pop(rank, None)
        if entry is not None:
            conn, timer = entry
            timer.cancel()
            conn.peer.close()

    def forget(self, rank: int) -> None:
        """The rank is gone for good: nothing is kept for it."""
        self._back(rank)
        self.sent.pop(rank, None)

    def close(self) -> None:
        """The job closes: no timers, watches or kept notices remain."""
        for rank in list(self.away):
            self._back(rank)
        self.sent.clear()

    def rejoin(self, rank: int, position: RankPosition, held: Iterable[tuple[int, int]]) -> Rejoin:
        """A rank registers again in a running job at ``position`` and still holds the slots ``held``."""
        sent = self.sent.get(rank, {})
        holds = {(int(r), int(s)) for r, s in held}
        resend: list[dict] = []
        kept: list[list[int]] = []
        free: list[tuple[int, int]] = []
        for key, frame in list(sent.items()):
            if RankPosition(frame["step"], frame["micro"]) >= position:
                resend.append(frame)
            elif key in holds:
                kept.append(list(key))
            else:
                free.append(key)
                del sent[key]
        resend.sort(key=lambda f: (f["step"], f["micro"]))
        return Rejoin(resend=resend, kept=kept, free=free)

    def owns(self, conn) -> bool:
        """Whether ``conn`` is the registered connection of its rank."""
        return conn.rank is not None and self.conns.get(conn.rank) is conn

    def starts(self) -> dict[int, RankStart]:
        """What every registered rank brings to the start (see ``checkpoint.start_point``)."""
        return {
            r: RankStart((p.step, p.micro), self.states.get(r), self.resuming.get(r, False), self.latest.get(r))
            for r, p in self.positions.items()
        }

    def place(self, positions: dict[int, tuple[int, int]]) -> None:
        """Set the positions the run starts ranks at (only ranks registered here)."""
        self.positions.update({r: RankPosition(*p) for r, p in positions.items() if r in self.positions})

    def report(self) -> dict[str, dict]:
        """Present ranks (an away rank is still part of the run) as the cluster leader reads them: position,
        brought state, resuming."""
        return {
            str(r): {
                "pos": [self.positions[r].step, self.positions[r].micro],
                "state": self.states.get(r),
                "resume": self.resuming.get(r, False),
            }
            for r in self.present(self.conns)
        }

    # ---- reading ----
    def readers(self, group_readers: tuple[int, ...], pos: RankPosition) -> list[int]:
        """The group's ranks that read the micro-batch at pos (present, and not resuming past it)."""
        return [r for r in self.present(group_readers) if self.positions[r] <= pos]

    def deliver(self, rank: int, frame: dict) -> None:
        """Send a batch notice (``ring``, ``slot``, ``step``, ``micro``) to a reader, and keep it until the rank
        releases the slot: a rank that reconnects gets again what it did not consume."""
        self.sent.setdefault(rank, {})[(frame["ring"], frame["slot"])] = frame
        c = self.conns.get(rank)
        if c is not None and not c.closed:
            c.send(frame)

    def released(self, rank: int, ring: int, slot: int) -> None:
        """The rank is done with a slot: its notice is no longer kept."""
        sent = self.sent.get(rank)
        if sent is not None:
            sent.pop((ring, slot), None)

    def send(self, ranks, frame: dict, fds: list[int] | None = None) -> None:
        """Send a frame (with descriptors) to those of ``ranks`` that are connected here."""
        for r in ranks:
            c = self.conns.get(r)
            if c is not None and not c.closed:
                c.send(frame, fds=fds or ())

    def fields(self, rank: int, layouts: list[FieldLayout]) -> list:
        """The wire layout of the fields this rank reads (its PP stage's fields, its own CP slice)."""
        sel = self._selectors.get(rank)
        if sel is None:
            wanted = set(self.spec.fields(rank, BATCH_FIELDS))
            sel = self._selectors[rank] = (wanted, str(self.mesh.coord(rank).cp))
        wanted, cp = sel
        out = []
        for f in layouts:
            name, _, part = f.name.partition("@")
            if name in wanted and (not part or part == cp):
                out.append([name, f.dtype, f.shape, f.offset])
        return out
