"""Planner states at the start of recent steps, and the one rule for a mixture change at a cut step.

Both planning homes keep one: a single node's plan feed and the cluster leader's coordinator. A rank's
``state_dict()`` reads the state of its step from it; a mixture change re-plans from the state of the cut.

Beyond its newest ``keep`` steps a history thins out: it keeps the state of every ``every``-th step (and of every
step where anything but the per-step counters changed: a mixture cut, a skip, deferred pieces, a listing), the
newest ``sparse`` of them, as compressed base records (``planner/delta.py``, a few kB each at dp 4096). Lineage
of an older step then replays at most ``every`` steps from the nearest of them instead of from the beginning.
"""

from __future__ import annotations

from collections.abc import Mapping

from msdata_server.errors import CheckpointError

from .delta import decode, encode_base
from .planner import Planner
from .state import K_CARRY, K_COUNTS, K_CURSOR, K_PLACED, K_STEP, K_TAKEN, K_TARGET

__all__ = ["SPARSE_EVERY", "SPARSE_KEEP", "StateHistory", "held_window"]

SPARSE_EVERY = 16  # beyond the newest `keep` steps, the state of every 16th step is kept...
SPARSE_KEEP = 64  # ...the newest 64 of those (1024 steps back), compressed
# what changes every step; a state that differs from the one before it in anything else is always kept
_PER_STEP = frozenset((K_STEP, K_CURSOR, K_TAKEN, K_TARGET, K_PLACED, K_CARRY, K_COUNTS))


class StateHistory:
    """States by step, the newest ``keep`` steps (bounded: a state is kilobytes).

    Invariant: ``states`` is in ascending step order (a dict keeps insertion order), so forgetting old states
    pops from its front: ``record`` is O(1) amortised. A step recorded out of order (rare: ranks that rejoin
    behind the steps a node holds) re-sorts once."""

    def __init__(self, keep: int, *, every: int = SPARSE_EVERY, sparse: int = SPARSE_KEEP):
        self.keep, self.every, self.sparse_keep = keep, every, sparse
        self.states: dict[int, dict] = {}
        self.sparse: dict[int, bytes] = {}  # older states kept (thinned), encoded; ascending steps
        self._left: dict | None = None  # the last state that left the newest `keep` (its lasting keys)

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
            self._thin(first, states.pop(first))

    def _thin(self, step: int, state: dict) -> None:
        """``state`` left the newest ``keep``: keep it (encoded) when it is an ``every``-th step's or differs from
        the one that left before it in more than the per-step counters; forget the oldest beyond ``sparse``."""
        lasting = {k: v for k, v in state.items() if k not in _PER_STEP}
        changed, self._left = lasting != self._left, lasting
        if self.sparse_keep <= 0 or not (changed or step % self.every == 0):
            return
        sparse = self.sparse
        in_order = not sparse or step > next(reversed(sparse))
        sparse[step] = encode_base(step, state)
        if not in_order:
            self.sparse = sparse = dict(sorted(sparse.items()))
        while len(sparse) > self.sparse_keep:
            del sparse[next(iter(sparse))]

    def forget_from(self, step: int) -> None:
        """Drop the states of steps >= ``step`` (a mixture change cut there: those steps are planned again)."""
        for held in (self.states, self.sparse):
            while held:
                last = next(reversed(held))
                if last < step:
                    break
                del held[last]

    def window(self, start: int, stop: int) -> tuple[tuple[int, dict] | None, dict[int, dict]]:
        """``held_window`` of the states held, the thinned older ones included: the newest at or before ``start``,
        those in (start, stop)."""
        base, held = held_window(self.states, start, stop)
        sparse = dict(self.sparse)  # a copy: a planning thread may record a state meanwhile
        if base is not None or not sparse:  # (the thinned states are all older than the newest)
            return base, held
        steps = [s for s in sparse if s < stop]
        before = [s for s in steps if s <= start]
        found = (before[-1], _decoded(before[-1], sparse)) if before else None
        return found, {**{s: _decoded(s, sparse) for s in steps if s > start}, **held}

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


def _decoded(step: int, sparse: Mapping[int, bytes]) -> dict:
    """The state of ``step`` among a history's thinned (encoded) ones."""
    state = decode(sparse[step], f"the kept planner state of step {step}").state
    if state is None:  # (never: encode_base wrote it)
        raise CheckpointError(f"the kept planner state of step {step} is not a whole state")
    return state


def held_window(states: Mapping[int, dict], start: int, stop: int) -> tuple[tuple[int, dict] | None, dict[int, dict]]:
    """From states by step: the newest at or before ``start``, and those at steps in (start, stop) (what a
    replay of [start, stop) may follow). The one rule for every plan feed's ``saved_states``."""
    steps = list(states)  # a copy: the loop may record a state meanwhile
    before = [s for s in steps if s <= start]
    base = (max(before), states[max(before)]) if before else None
    return base, {s: states[s] for s in steps if start < s < stop}
