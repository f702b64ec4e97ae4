"""Per-step plan statistics of a job: the recent ones (bounded) and running totals, for ``status``."""

from __future__ import annotations

from ..planner import PlanStats

__all__ = ["PlanLog"]

_RECENT = 64


class PlanLog:
    """What the plans of a job's steps looked like: imbalance, padding, planning time, tokens per source."""

    def __init__(self) -> None:
        self.steps = 0
        self.recent: list[PlanStats] = []  # the newest _RECENT
        self._imbalance = self._padding = self._plan_ms = 0.0
        self._tokens: dict[str, int] = {}

    def record(self, st: PlanStats) -> None:
        self.steps += 1
        self.recent.append(st)
        del self.recent[:-_RECENT]
        self._imbalance += st.imbalance
        self._padding += st.padding_fraction
        self._plan_ms += st.plan_ms
        for name, n in st.tokens.items():
            self._tokens[name] = self._tokens.get(name, 0) + int(n)

    def summary(self) -> dict:
        n = self.steps
        last = self.recent[-1] if self.recent else None
        return {
            "steps_planned": n,
            "imbalance": self._imbalance / n if n else None,
            "padding_fraction": self._padding / n if n else None,
            "plan_ms": self._plan_ms / n if n else None,
            "last_step": last.to_dict() if last is not None else None,
            "tokens_per_source": dict(self._tokens),
        }
