"""The single-node PayloadSource: this node's source loaders, its partitions per source (``parts``; one until
the autoscaler splits a source), and their piece references."""

from __future__ import annotations

import logging

import numpy as np

from ..document import cut_piece
from ..job.pieces import PieceRefs, hold_figures
from ..loader import SourceLoader
from ..loader.budget import node_budget
from ..planner import StepPlan
from .sourceparts import SourceParts

__all__ = ["LocalPayloads", "merged_figures"]

log = logging.getLogger(__name__)


_SUMMED_NOT = frozenset({"buffer_fill", "cursor"})  # figures of a source's partitions that do not add up


def merged_figures(loaders: list[SourceLoader], partitions: int) -> dict:
    """The figures of one source's loaders as one: counts and rates summed, the fill averaged, the cursor the
    furthest; ``partitions`` is how many it reads with now (older loaders may still drain)."""
    figs = [ld.statistics().figures() for ld in loaders]
    out = dict(figs[-1])
    for k, v in out.items():
        if isinstance(v, (int, float)) and not isinstance(v, bool) and k not in _SUMMED_NOT:
            out[k] = sum(f[k] for f in figs)
        elif isinstance(v, dict):
            merged: dict = {}
            for f in figs:
                for kk, vv in f[k].items():
                    merged[kk] = merged.get(kk, 0) + vv
            out[k] = merged
    out["buffer_fill"] = sum(f["buffer_fill"] for f in figs) / len(figs)
    out["cursor"] = max(f["cursor"] for f in figs)
    out["partitions"] = partitions
    return out


class LocalPayloads:
    """Documents from this node's loaders (``parts[s]``: source s, in one or more partitions). Owns and closes
    them."""

    def __init__(self, loaders: list[SourceLoader]):
        self.parts = [SourceParts(ld) for ld in loaders]
        for p in self.parts:
            p.follow_plans()  # payloads held up to the read-ahead past the plans; beyond, lengths only
        self.refs = PieceRefs()  # payloads held for planned pieces not yet built

    @property
    def loaders(self) -> list[SourceLoader]:
        """One loader per source, in source order (each reads its source's files; for per-source facts)."""
        return [p.loaders()[-1] for p in self.parts]

    async def set_partitions(self, source: str, n: int) -> tuple[int, int] | None:
        """Read ``source`` in ``n`` partitions from here on (the autoscaler's split or merge); the batches are
        the same at any n. Returns (boundary batch, n), or None when it already had n."""
        for p in self.parts:
            if p.name == source:
                return await p.set_partitions(n)
        raise KeyError(f"no source {source!r} in this job; its sources are {[p.name for p in self.parts]}")

    async def repartition(self, source: str, n: int) -> bool:
        await self.set_partitions(source, n)
        return True

    # counted by the plan feed as plans are made, or taken back when a mixture change cuts them
    def planned(self, plan: StepPlan) -> None:
        self._free(self.refs.plan(plan.source, plan.ordinal, plan.last))
        if plan.source.size:
            src, ords = np.asarray(plan.source), np.asarray(plan.ordinal)
            highest = np.full(len(self.parts), -1, dtype=np.int64)
            np.maximum.at(highest, src.astype(np.int64), ords)
            for s in np.flatnonzero(highest >= 0).tolist():
                self.parts[s].planned_to(int(highest[s]))

    def unplanned(self, plan: StepPlan) -> None:
        self.refs.unplan(plan.source, plan.ordinal, plan.last)

    async def fetch(self, source: np.ndarray, ordinal: np.ndarray, offset: np.ndarray, length: np.ndarray) -> list:
        out = []
        for s, o, a, n in zip(source.tolist(), ordinal.tolist(), offset.tolist(), length.tolist()):
            doc = await self.parts[s].tokens(o)
            out.append(cut_piece(doc, a, n))
        self._free(self.refs.done(source, ordinal))
        return out

    async def skip(self, source: np.ndarray, ordinal: np.ndarray) -> None:
        self._free(self.refs.done(source, ordinal))

    def _free(self, docs: list[tuple[int, int]]) -> None:
        for s, ords in self.refs.by_source(docs).items():
            self.parts[s].release(ords)

    def sample_ids(self, source: int, ordinals: np.ndarray) -> np.ndarray:
        return self.parts[source].sample_ids(ordinals)

    def status(self, newest_state: dict | None) -> dict[str, dict]:
        return {
            p.name: {**merged_figures(lds, p.partitions), **hold_figures(s, lds, self.refs, newest_state)}
            for s, p in enumerate(self.parts)
            for lds in [p.loaders()]
        }

    async def lengths(self, source: int, start: int, count: int) -> np.ndarray:
        """For the planner's view: lengths of ordinals [start, start+count) of ``source``."""
        return await self.parts[source].lengths(start, count)

    async def vision(self, source: int, start: int, count: int) -> tuple[np.ndarray, np.ndarray]:
        """For the planner's view ("vlm" cost): images per sample and patches per image of those ordinals."""
        return await self.parts[source].vision(start, count)

    async def aclose(self) -> None:
        with node_budget().changes():  # the loaders left (other jobs') read on once, not once per loader closed
            for p in self.parts:
                try:
                    await p.aclose()
                except Exception:
                    log.exception("closing the loaders of source %s failed", p.name)
