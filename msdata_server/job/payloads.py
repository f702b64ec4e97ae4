"""The single-node PayloadSource: this node's source loaders, one per source, and their piece references."""

from __future__ import annotations

import logging
from dataclasses import asdict

import numpy as np

from ..loader import SourceLoader
from ..planner import StepPlan
from .pieces import PieceRefs, hold_figures

__all__ = ["LocalPayloads", "loader_figures"]

log = logging.getLogger(__name__)


def loader_figures(ld: SourceLoader) -> dict:
    """A loader's statistics as status JSON (scalars and tables only)."""
    return {k: v for k, v in asdict(ld.statistics()).items() if isinstance(v, (int, float, str, dict, type(None)))}


class LocalPayloads:
    """Documents from this node's loaders (``loaders[s]`` reads source s whole). Owns and closes them."""

    def __init__(self, loaders: list[SourceLoader]):
        self.loaders = loaders
        self.refs = PieceRefs()  # payloads held for planned pieces not yet built

    # counted by the plan feed as plans are made, or taken back when a mixture change cuts them
    def planned(self, plan: StepPlan) -> None:
        self._free(self.refs.plan(plan.source, plan.ordinal, plan.last))

    def unplanned(self, plan: StepPlan) -> None:
        self.refs.unplan(plan.source, plan.ordinal, plan.last)

    async def fetch(
        self, source: np.ndarray, ordinal: np.ndarray, offset: np.ndarray, length: np.ndarray
    ) -> list[np.ndarray]:
        out = []
        for s, o, a, n in zip(source.tolist(), ordinal.tolist(), offset.tolist(), length.tolist()):
            doc = await self.loaders[s].tokens(o)
            out.append(doc[a : a + n])
        self._free(self.refs.done(source, ordinal))
        return out

    async def skip(self, source: np.ndarray, ordinal: np.ndarray) -> None:
        self._free(self.refs.done(source, ordinal))

    def _free(self, docs: list[tuple[int, int]]) -> None:
        for s, ords in self.refs.by_source(docs).items():
            self.loaders[s].release(ords)

    def sample_ids(self, source: int, ordinals: np.ndarray) -> np.ndarray:
        return self.loaders[source].sample_ids(ordinals)

    def status(self, newest_state: dict | None) -> dict[str, dict]:
        return {
            ld.name: {**loader_figures(ld), **hold_figures(s, [ld], self.refs, newest_state)}
            for s, ld in enumerate(self.loaders)
        }

    async def lengths(self, source: int, start: int, count: int) -> np.ndarray:
        """For the planner's view: lengths of ordinals [start, start+count) of ``source``."""
        return await self.loaders[source].lengths(start, count)

    async def aclose(self) -> None:
        for ld in self.loaders:
            try:
                await ld.aclose()
            except Exception:
                log.exception("closing the loader of source %s failed", ld.name)
            finally:
                ld.source.close()
