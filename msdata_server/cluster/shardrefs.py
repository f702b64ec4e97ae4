"""Reference counts of one run's shard: which payloads of the partitions on this node (and of those it stands by
for) planned pieces still need, per building node; a payload is released to its loader once nothing needs it.
A standby counts its partitions' pieces too, for the steps their owner may still serve, and forgets them after.

The counts own their references (``PieceRefs``) and read the run's partition layout and the loaders of the
partitions here (to release a payload); ``shard.JobShard`` builds them with those.
"""

from __future__ import annotations

from collections.abc import Mapping

import numpy as np

from ..job.pieces import PieceRefs
from ..loader import SourceLoader
from ..planner import StepPlan
from .placement import PartitionLayout

__all__ = ["STANDBY_SLACK", "ShardRefs"]

STANDBY_SLACK = 16  # steps past prefetch_steps a standby keeps the references it counted (see ShardRefs._age)

_Counted = tuple[np.ndarray, np.ndarray, np.ndarray, list[int]]  # sources, ordinals, last flags, builders each


class ShardRefs:
    """``JobShard.counts``: the node's piece references of one run (``add`` a plan, ``drop`` a cut plan, ``done``
    for occurrences fetched or skipped)."""

    def __init__(
        self,
        node_id: str,
        where: PartitionLayout,
        loaders: Mapping[tuple[int, int], SourceLoader],
        *,
        prefetch_steps: int,
        n_shadows: int,
    ) -> None:
        self.node_id = node_id
        self.where = where  # the owner and standbys of each partition (the run's, updated in place)
        self.loaders = loaders  # the partitions read here (the shard's, updated in place)
        self.prefetch_steps = prefetch_steps
        self.n_shadows = n_shadows
        self.refs = PieceRefs()  # payloads of partitions here held for planned pieces (per building node)
        self.standby: dict[int, _Counted] = {}  # step -> the pieces of stood-by partitions counted for it

    def _part(self, s: int, ordinal: int) -> int:
        return self.where.table.part(s, ordinal)

    def _owned(
        self, plan: StepPlan, group_nodes: dict[int, tuple[str, ...]], *, standby: bool = False
    ) -> tuple[np.ndarray, list[int]]:
        """Indices of a plan's pieces owned here (``standby``: of partitions stood by for here), and how many
        nodes build each."""
        me = self.node_id
        if standby:
            sh = self.where.layout()[1]
            keep = [me in sh[s][self._part(s, o)] for s, o in zip(plan.source.tolist(), plan.ordinal.tolist())]
        else:
            pl = self.where.placement()
            keep = [pl[s][self._part(s, o)] == me for s, o in zip(plan.source.tolist(), plan.ordinal.tolist())]
        idx = [i for i, k in enumerate(keep) if k]
        return np.asarray(idx, dtype=np.int64), [len(group_nodes.get(int(g), ())) for g in plan.group[idx].tolist()]

    def add(self, plan: StepPlan, group_nodes: dict[int, tuple[str, ...]]) -> None:
        """A new plan: each occurrence of a piece owned here is fetched (or skipped) once per building node. A
        standby counts its partitions' pieces too (they are its references if it takes over), for the steps
        its owner may still serve (``_age``)."""
        idx, n = self._owned(plan, group_nodes)
        self._free(self.refs.plan(plan.source[idx], plan.ordinal[idx], plan.last[idx], n))
        if not self.n_shadows:
            return
        idx, n = self._owned(plan, group_nodes, standby=True)
        if len(idx):
            got = (plan.source[idx], plan.ordinal[idx], plan.last[idx], n)
            self._free(self.refs.plan(*got))
            self.standby[plan.step] = got
        self._age(plan.step)

    def _age(self, step: int) -> None:
        """Forget the references a standby counted for steps every builder has fetched by now, of partitions
        not taken over here: their owner served them. Planning runs at most ``prefetch_steps + 1`` ahead of the
        slowest node's fed step and a node queues at most ``prefetch_steps``; ``STANDBY_SLACK`` more steps
        leave a wide margin (forgetting too early would only pin a payload, never change one). Keeps a
        standby's counts bounded however long it stands by."""
        horizon = step - self.prefetch_steps - STANDBY_SLACK
        for old in [s for s in self.standby if s < horizon]:
            src, ords, last, n = self.standby.pop(old)
            keep = [
                i
                for i, (s, o) in enumerate(zip(src.tolist(), ords.tolist()))
                if (s, self._part(s, o)) not in self.loaders
            ]
            self.refs.unplan(src[keep], ords[keep], last[keep], [n[i] for i in keep])

    def drop(self, plan: StepPlan, group_nodes: dict[int, tuple[str, ...]]) -> None:
        """A plan cut by a mixture change (never built): take back what add_refs counted for it."""
        idx, n = self._owned(plan, group_nodes)
        self.refs.unplan(plan.source[idx], plan.ordinal[idx], plan.last[idx], n)
        got = self.standby.pop(plan.step, None)
        if got is not None:
            self.refs.unplan(*got)

    def skipped(self, plan: StepPlan) -> None:
        """A plan nobody builds (``loader.skip``): its pieces owned here count planned and done at once, so what
        the loaders read ahead for them is freed (a document with pieces carried on stays)."""
        idx, _ = self._owned(plan, {})
        src, ords = plan.source[idx], plan.ordinal[idx]
        self._free(self.refs.plan(src, ords, plan.last[idx]))
        self._free(self.refs.done(src, ords))

    def done(self, src: np.ndarray, ords: np.ndarray) -> None:
        """Occurrences fetched or skipped (one reference each)."""
        self._free(self.refs.done(src, ords))

    def _free(self, docs: list[tuple[int, int]]) -> None:
        for s, o in docs:
            ld = self.loaders.get((s, self._part(s, o)))
            if ld is not None:
                ld.release(np.array([o], dtype=np.int64))
