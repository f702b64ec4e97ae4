"""The planner's per-step state in etcd, written only by the leader (fenced), for a new leader to continue.

Keys ``{prefix}/jobs/{job}/{digest16}/state/{step:012d}``; each save writes step s and deletes step s-keep in
one fenced transaction, so etcd holds a window of the last ``keep`` steps (a new leader re-plans from the
earliest step any node still lacks). Values are the planner's state_dict as JSON (kilobytes).
"""

from __future__ import annotations

import orjson

from ..errors import CheckpointError
from .election import LeaderElection
from .etcd import Etcd, Op

__all__ = ["EtcdStateStore"]


class EtcdStateStore:
    """A window of the last ``keep`` planner states of one job run in etcd."""

    def __init__(
        self, etcd: Etcd, election: LeaderElection | None, *, prefix: str, job: str, digest: str, keep: int = 16
    ):
        if keep < 1:
            raise CheckpointError(f"{keep=} must be >= 1")
        self.etcd = etcd
        self.election = election
        self.keep = keep
        self.base = f"{prefix}/jobs/{job}/{digest[:16]}/state/"

    def _key(self, step: int) -> str:
        return f"{self.base}{step:012d}"

    async def save(self, step: int, state: dict) -> bool:
        """Write the state of ``step`` (and forget step - keep) while we lead; False if we do not."""
        if self.election is None:
            return False
        ops = [Op.put(self._key(step), orjson.dumps(state))]
        if step - self.keep >= 0:
            ops.append(Op.delete(self._key(step - self.keep)))
        return await self.election.txn_fenced(ops)

    async def save_cut(self, step: int, state: dict, end: int) -> bool:
        """A mixture change at ``step``: write its state and delete the old plan's states of (step, end)."""
        if self.election is None:
            return False
        ops = [Op.put(self._key(step), orjson.dumps(state))]
        ops += [Op.delete(self._key(s)) for s in range(max(step + 1, end - self.keep), end)]
        return await self.election.txn_fenced(ops)

    async def steps(self) -> list[int]:
        return [int(kv.key.decode()[len(self.base) :]) for kv in await self.etcd.get(self.base, prefix=True)]

    async def load_at_or_before(self, step: int | None = None) -> tuple[int, dict] | None:
        """The newest saved state at or before ``step`` (None: the newest of all), or None."""
        best = None
        for kv in await self.etcd.get(self.base, prefix=True):
            s = int(kv.key.decode()[len(self.base) :])
            if (step is None or s <= step) and (best is None or s > best[0]):
                best = (s, kv.value)
        if best is None:
            return None
        try:
            return best[0], orjson.loads(best[1])
        except orjson.JSONDecodeError as e:
            raise CheckpointError(
                f"planner state of step {best[0]} in etcd ({self._key(best[0])}) is corrupt: {e}"
            ) from None

    async def clear(self) -> None:
        """Forget every saved state of this job run (a new run starts from its own beginning)."""
        if self.election is not None:
            await self.election.txn_fenced([Op.delete(self.base, prefix=True)])
