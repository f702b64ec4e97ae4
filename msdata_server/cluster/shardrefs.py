"""Reference counts of one run's shard: which payloads of the partitions on this node (and of those it stands by
for) planned pieces still need, per building node; a payload is released to its loader once nothing needs it.
A standby counts its partitions' pieces too, for the steps their owner may still serve, and forgets them after."""

from __future__ import annotations

from typing import Any, Protocol

import numpy as np

__all__ = ["STANDBY_SLACK", "ShardRefs"]

STANDBY_SLACK = 16  # steps past prefetch_steps a standby keeps the references it counted (see ShardRefs._age)


class Shard(Protocol):
    """What the counts use of their ``JobShard`` (shard.py builds them; this module does not import it)."""

    jobs: Any  # the node's ClusterJobs: node_id
    spec: Any  # the job spec: prefetch_steps
    refs: Any  # PieceRefs
    n_shadows: int
    loaders: dict
    where: Any  # PartitionLayout: the owner and standbys of each partition

    def placement(self) -> list[list[str]]: ...

    def part(self, s: int, ordinal: int) -> int: ...


class ShardRefs:
    """``JobShard.counts``: the node's piece references of one run (``add`` a plan, ``drop`` a cut plan, ``done``
    for occurrences fetched or skipped)."""

    def __init__(self, shard: Shard):
        self.shard = shard
        self.standby: dict[int, tuple] = {}  # step -> the pieces of stood-by partitions counted for it

    def _owned(
        self, plan, group_nodes: dict[int, tuple[str, ...]], *, standby: bool = False
    ) -> tuple[np.ndarray, list[int]]:
        """Indices of a plan's pieces owned here (``standby``: of partitions stood by for here), and how many
        nodes build each."""
        me = self.shard.jobs.node_id
        if standby:
            sh = self.shard.where.layout()[1]
            keep = [me in sh[s][self.shard.part(s, o)] for s, o in zip(plan.source.tolist(), plan.ordinal.tolist())]
        else:
            pl = self.shard.placement()
            keep = [pl[s][self.shard.part(s, o)] == me for s, o in zip(plan.source.tolist(), plan.ordinal.tolist())]
        idx = [i for i, k in enumerate(keep) if k]
        return np.asarray(idx, dtype=np.int64), [len(group_nodes.get(int(g), ())) for g in plan.group[idx].tolist()]

    def add(self, plan, group_nodes: dict[int, tuple[str, ...]]) -> None:
        """A new plan: each occurrence of a piece owned here is fetched (or skipped) once per building node. A
        standby counts its partitions' pieces too (they are its references if it takes over), for the steps
        its owner may still serve (``_age``)."""
        idx, n = self._owned(plan, group_nodes)
        self._free(self.shard.refs.plan(plan.source[idx], plan.ordinal[idx], plan.last[idx], n))
        if not self.shard.n_shadows:
            return
        idx, n = self._owned(plan, group_nodes, standby=True)
        if len(idx):
            got = (plan.source[idx], plan.ordinal[idx], plan.last[idx], n)
            self._free(self.shard.refs.plan(*got))
            self.standby[plan.step] = got
        self._age(plan.step)

    def _age(self, step: int) -> None:
        """Forget the references a standby counted for steps every builder has fetched by now, of partitions
        not taken over here: their owner served them. Planning runs at most ``prefetch_steps + 1`` ahead of the
        slowest node's fed step and a node queues at most ``prefetch_steps``; ``STANDBY_SLACK`` more steps
        leave a wide margin (forgetting too early would only pin a payload, never change one). Keeps a
        standby's counts bounded however long it stands by."""
        horizon = step - self.shard.spec.prefetch_steps - STANDBY_SLACK
        for old in [s for s in self.standby if s < horizon]:
            src, ords, last, n = self.standby.pop(old)
            keep = [
                i
                for i, (s, o) in enumerate(zip(src.tolist(), ords.tolist()))
                if (s, self.shard.part(s, o)) not in self.shard.loaders
            ]
            self.shard.refs.unplan(src[keep], ords[keep], last[keep], [n[i] for i in keep])

    def drop(self, plan, group_nodes: dict[int, tuple[str, ...]]) -> None:
        """A plan cut by a mixture change (never built): take back what add_refs counted for it."""
        idx, n = self._owned(plan, group_nodes)
        self.shard.refs.unplan(plan.source[idx], plan.ordinal[idx], plan.last[idx], n)
        got = self.standby.pop(plan.step, None)
        if got is not None:
            self.shard.refs.unplan(*got)

    def done(self, src, ords) -> None:
        """Occurrences fetched or skipped (one reference each)."""
        self._free(self.shard.refs.done(src, ords))

    def _free(self, docs: list[tuple[int, int]]) -> None:
        for s, o in docs:
            ld = self.shard.loaders.get((s, self.shard.part(s, o)))
            if ld is not None:
                ld.release(np.array([o], dtype=np.int64))
