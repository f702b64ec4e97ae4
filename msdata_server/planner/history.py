"""Planner states at the start of recent steps, and the one rule for a mixture change at a cut step.

Both planning homes keep one: a single node's plan feed and the cluster leader's coordinator. A rank's
``state_dict()`` reads the state of its step from it; a mixture change re-plans from the state of the cut.
"""

from __future__ import annotations

from collections.abc import Mapping

from msdata_server.errors import CheckpointError

from .planner import Planner

__all__ = ["StateHistory", "held_window"]


class StateHistory:
    """States by step, the newest ``keep`` steps (bounded: a state is kilobytes).

    Invariant: ``states`` is in ascending step order (a dict keeps insertion order), so forgetting old states
    pops from its front: ``record`` is O(1) amortised. A step recorded out of order (rare: ranks that rejoin
    behind the steps a node holds) re-sorts once."""

    def __init__(self, keep: int):
        self.keep = keep
        self.states: dict[int, dict] = {}

    def __contains__(self, step: int) -> bool:
        return step in self.states

    def __getitem__(self, step: int) -> dict:
        return self.states[step]

    def __len__(self) -> int:
        return len(self.states)

    def record(self, step: int, state: dict) -> None:
        """The state at the start of ``step``; states older than ``keep`` steps before it are dropped."""
        states = self.states
        in_order = not states or step >= next(reversed(states))
        states[step] = state
        if not in_order:
            self.states = states = dict(sorted(states.items()))
        horizon = step - self.keep
        while states:
            first = next(iter(states))
            if first > horizon:
                return
            del states[first]

    def forget_from(self, step: int) -> None:
        """Drop the states of steps >= ``step`` (a mixture change cut there: those steps are planned again)."""
        states = self.states
        while states:
            last = next(reversed(states))
            if last < step:
                return
            del states[last]

    def window(self, start: int, stop: int) -> tuple[tuple[int, dict] | None, dict[int, dict]]:
        """``held_window`` of the states held: the newest at or before ``start``, those in (start, stop)."""
        return held_window(self.states, start, stop)

    def get(self, step: int) -> dict | None:
        return self.states.get(step)

    def newest(self) -> dict | None:
        return self.states[next(reversed(self.states))] if self.states else None

    def span(self) -> str:
        """The steps held, for error messages."""
        return f"{self.oldest()}..{max(self.states, default=0)}"

    def oldest(self) -> int:
        """The oldest step held (0: none)."""
        return next(iter(self.states), 0)

    def rebase(self, planner: Planner, cut: int, weights: Mapping[str, float]) -> Planner:
        """A planner at ``cut`` (a step not yet taken up anywhere) that uses ``weights`` from there on; records
        its state at ``cut`` and forgets the states after it (those steps are planned again). ConfigError for
        unknown sources or bad weights, and then nothing changed."""
        base = planner.state_dict() if cut == planner.step else self.states.get(cut)
        if base is None:
            raise CheckpointError(
                f"no planner state of step {cut} (states held: {self.span()}, planned up to {planner.step})"
            )
        rebased = Planner(planner.config, state=base)
        rebased.set_mixture(cut, weights)
        self.forget_from(cut + 1)
        self.states[cut] = rebased.state_dict()  # in order: every state held is of a step before it
        return rebased


def held_window(states: Mapping[int, dict], start: int, stop: int) -> tuple[tuple[int, dict] | None, dict[int, dict]]:
    """From states by step: the newest at or before ``start``, and those at steps in (start, stop) (what a
    replay of [start, stop) may follow). The one rule for every plan feed's ``saved_states``."""
    steps = list(states)  # a copy: the loop may record a state meanwhile
    before = [s for s in steps if s <= start]
    base = (max(before), states[max(before)]) if before else None
    return base, {s: states[s] for s in steps if start < s < stop}
