"""The planner's per-step state in etcd, written only by the leader (fenced), for a new leader to continue.

Keys ``{prefix}/jobs/{job}/{digest16}/state/{step:012d}``; each save writes step s and deletes the step that
left the window in one fenced transaction, so etcd holds the last ``keep`` steps and the bases their deltas
need (a new leader re-plans from the earliest step any node still lacks). Values are records of
``planner/delta.py``: a base (the whole state) every ``every`` steps, deltas between; values written as the
planner's state_dict in JSON (version 1) still load.
"""

from __future__ import annotations

import logging

from ...errors import CheckpointError
from ...planner.delta import DeltaWriter, expired, newest
from ..net.election import LeaderElection
from ..net.etcd import Etcd, Op

__all__ = ["EtcdStateStore"]

log = logging.getLogger(__name__)


class EtcdStateStore:
    """A window of the last ``keep`` planner states of one job run in etcd."""

    def __init__(
        self,
        etcd: Etcd,
        election: LeaderElection | None,
        *,
        prefix: str,
        job: str,
        digest: str,
        keep: int = 16,
        every: int = 16,
    ):
        if keep < 1:
            raise CheckpointError(f"{keep=} must be >= 1")
        self.etcd = etcd
        self.election = election
        self.keep = keep
        self.every = every
        self.base = f"{prefix}/jobs/{job}/{digest[:16]}/state/"
        self.bytes_written = 0
        self._writer = DeltaWriter(every)

    def _key(self, step: int) -> str:
        return f"{self.base}{step:012d}"

    async def _txn(self, ops: list[Op], size: int) -> bool:
        """A fenced write; on failure (or without the lead) the next record is a base."""
        try:
            ok = await self.election.txn_fenced(ops) if self.election is not None else False
        except BaseException:
            self._writer.reset()
            raise
        if ok:
            self.bytes_written += size
        else:
            self._writer.reset()
        return ok

    async def save(self, step: int, state: dict) -> bool:
        """Write the state of ``step`` (and forget the step that left the window) while we lead; False if we
        do not."""
        if self.election is None:
            return False
        data, _ = self._writer.encode(step, state)
        ops = [Op.put(self._key(step), data)]
        gone = expired(step, self.keep, self.every)
        if gone >= 0:
            ops.append(Op.delete(self._key(gone)))
        return await self._txn(ops, len(data))

    async def save_cut(self, step: int, state: dict, end: int) -> bool:
        """A mixture change at ``step``: write its state (a base) and delete the old plan's states of (step, end)."""
        if self.election is None:
            return False
        self._writer.reset()
        data, _ = self._writer.encode(step, state)
        ops = [Op.put(self._key(step), data)]
        ops += [Op.delete(self._key(s)) for s in range(max(step + 1, end - self.keep - self.every), end)]
        return await self._txn(ops, len(data))

    async def steps(self) -> list[int]:
        return [int(kv.key.decode()[len(self.base) :]) for kv in await self.etcd.get(self.base, prefix=True)]

    async def load_at_or_before(self, step: int | None = None) -> tuple[int, dict] | None:
        """The newest saved state at or before ``step`` (None: the newest of all) that loads, or None; a corrupt
        record (or a delta whose base is gone) is skipped with a warning."""
        values = {
            int(kv.key.decode()[len(self.base) :]): kv.value for kv in await self.etcd.get(self.base, prefix=True)
        }
        steps = [s for s in values if step is None or s <= step]
        found, skipped = newest(steps, values.get, lambda s: f"planner state of step {s} in etcd ({self._key(s)})")
        for why in skipped:
            log.warning("skipping a planner state: %s", why)
        return found

    async def clear(self) -> None:
        """Forget every saved state of this job run (a new run starts from its own beginning)."""
        self._writer.reset()
        if self.election is not None:
            await self.election.txn_fenced([Op.delete(self.base, prefix=True)])
