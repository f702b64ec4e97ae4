"""The ranks of one job on this node: who is connected, where each is, what it brought; the start barrier.

A rank's position is the next micro-batch it expects. A rank reads a micro-batch when it is connected and
not already past it (a rank that resumed further along skips what it had).
"""

from __future__ import annotations

import logging
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


class RankRegistry:
    """Connections, positions and brought states of a job's ranks on this node."""

    def __init__(self, spec: JobSpec):
        self.spec = spec
        self.mesh = spec.mesh
        self.conns: dict[int, Any] = {}  # rank -> ClientConn (msdata_server.endpoint)
        self.positions: dict[int, RankPosition] = {}
        self.states: dict[int, dict | None] = {}  # rank -> the state it brought (load_state_dict), if any
        self.resuming: dict[int, bool] = {}  # rank -> it reconnects mid-run (continue where it was)
        self._selectors: dict[int, tuple[set, str]] = {}  # rank -> (fields it reads, its CP index)

    # ---- who is here ----
    @property
    def connected(self) -> int:
        return sum(1 for c in self.conns.values() if not c.closed)

    def live_ranks(self) -> list[int]:
        """Ranks whose client is still there (a client that hung up but whose EOF is unread is not)."""
        return [r for r, c in self.conns.items() if not c.gone()]

    def complete(self) -> bool:
        """The start barrier on one node: every rank of the mesh registered here and still connected."""
        return len(self.conns) == self.mesh.world_size and all(not c.closed for c in self.conns.values())

    def connected_ranks(self) -> list[int]:
        return sorted(r for r, c in self.conns.items() if not c.closed)

    # ---- admission ----
    def check_rank(self, rank: int, world_size: int) -> None:
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
        old = self.conns.get(rank)
        if old is not None and not old.gone():
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

    def add(self, conn, rank: int, position: RankPosition, state: dict | None, resume: bool) -> None:
        self.conns[rank] = conn
        self.positions[rank] = position
        self.states[rank] = state
        self.resuming[rank] = resume

    def owns(self, conn) -> bool:
        """Whether ``conn`` is the registered connection of its rank."""
        return conn.rank is not None and self.conns.get(conn.rank) is conn

    def starts(self) -> dict[int, RankStart]:
        """What every registered rank brings to the start (see ``checkpoint.start_point``)."""
        return {
            r: RankStart((p.step, p.micro), self.states.get(r), self.resuming.get(r, False))
            for r, p in self.positions.items()
        }

    def place(self, positions: dict[int, tuple[int, int]]) -> None:
        """Set the positions the run starts ranks at (only ranks registered here)."""
        self.positions.update({r: RankPosition(*p) for r, p in positions.items() if r in self.positions})

    def report(self) -> dict[str, dict]:
        """Connected ranks as the cluster leader reads them: position, brought state, resuming."""
        return {
            str(r): {
                "pos": [self.positions[r].step, self.positions[r].micro],
                "state": self.states.get(r),
                "resume": self.resuming.get(r, False),
            }
            for r, c in self.conns.items()
            if not c.closed
        }

    # ---- reading ----
    def readers(self, group_readers: tuple[int, ...], pos: RankPosition) -> list[int]:
        """The group's ranks that read the micro-batch at pos (connected, and not resuming past it)."""
        return [
            r
            for r in group_readers
            if (c := self.conns.get(r)) is not None and not c.closed and self.positions[r] <= pos
        ]

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
