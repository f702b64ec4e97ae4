"""Where a job starts: the one start rule from the states ranks bring and the stored ones (both modes).

The node's stored planner states (``state_dir``) live in ``statedir.StateStore``, re-exported here."""

from __future__ import annotations

import logging
from collections.abc import Mapping
from dataclasses import dataclass

from msdata_client.lineage import check_skip

from .errors import CheckpointError, ConfigError
from .planner.state import K_PENDING
from .statedir import StateStore

__all__ = [
    "Carried",
    "RankStart",
    "StartPoint",
    "StateStore",
    "carried_start",
    "skip_of",
    "start_from_states",
    "start_point",
    "start_skip",
]

log = logging.getLogger(__name__)


def start_from_states(states: dict, layout: dict) -> tuple[dict, dict[int, tuple[int, int]], tuple[int, bool]]:
    """Where a job starts when ranks brought states (``states``: rank -> state or None, at least one given).

    Every given state must hold the same planner position (else CheckpointError for every rank); ranks that
    brought none adopt it. Returns the planner state and each rank's (step, micro): a rank keeps its micro-batch
    only when its state was saved under this same layout (another layout restarts the step). The third value:
    the steps to skip before delivering and whether to defer their pieces (``loader.skip``; every given state
    must ask for the same skip, which ranks start after).
    """
    given = {r: st for r, st in states.items() if st is not None}
    first = next(iter(given.values()))
    for r, st in given.items():
        if st["planner"] != first["planner"]:
            raise CheckpointError(
                f"ranks brought states of different positions (rank {r} at step "
                f"{st['planner'].get('step')}, others at {first['planner'].get('step')}); "
                "load the same checkpoint on every rank"
            )
    planner, skip, defer = start_skip(first)
    for r, st in given.items():
        if st.get("skip") != first.get("skip"):
            raise CheckpointError(
                f"ranks disagree on the skip: rank {r} asked for {st.get('skip')!r}, another for "
                f"{first.get('skip')!r}; call loader.skip(...) with the same arguments on every rank (or on none)"
            )
    step = int(first["planner"]["step"]) + skip
    positions = {}
    for r, st in states.items():
        same = st is not None and st.get("layout") == layout
        positions[r] = (step, int(st["position"]["micro"]) if same else 0)
    return planner, positions, (skip, defer)


def skip_of(state: Mapping) -> tuple[int, bool]:
    """The steps a rank's state asks to skip (``loader.skip``) before delivering, and whether their pieces are
    deferred to the end of their source's epoch; CheckpointError if malformed. A range (``skip(steps=(A, B))``)
    skips nothing before delivering unless the state is at A (then B - A): see ``start_skip``."""
    _, skip, defer = start_skip(state)
    return skip, defer


def start_skip(state: Mapping) -> tuple[dict, int, bool]:
    """Where a run from a rank's state starts (``loader.skip``): the planner state to plan from, the steps to
    skip before delivering and whether their pieces are deferred. ``skip(steps=(A, B))`` from a state at A is
    ``skip(steps=B-A)``; from a state before A it rides in the planner state as its pending skip (the planning
    home skips A..B-1 when it gets there). CheckpointError if malformed or the state is past A."""
    raw, planner = state.get("skip"), state["planner"]
    if raw is None:
        return planner, 0, False
    try:
        if not isinstance(raw, Mapping) or set(raw) not in ({"steps", "defer"}, {"start", "stop", "defer"}):
            raise ConfigError(
                f"a state's skip must be {{'steps': k, 'defer': bool}} or {{'start': A, 'stop': B, 'defer': bool}},"
                f" got {raw!r}"
            )
        check_skip(raw["steps"] if "steps" in raw else (raw["start"], raw["stop"]), raw["defer"])
    except ConfigError as e:
        raise CheckpointError(str(e)) from None
    if "steps" in raw:
        return planner, int(raw["steps"]), bool(raw["defer"])
    step, start, stop = int(planner["step"]), int(raw["start"]), int(raw["stop"])
    if start < step:
        raise CheckpointError(
            f"skip(steps=({start}, {stop})) from a state at step {step}: the state is already past step {start};"
            f" load a checkpoint saved at or before step {start}"
        )
    if start == step:
        return planner, stop - start, bool(raw["defer"])
    return {**planner, K_PENDING: {"start": start, "stop": stop, "defer": bool(raw["defer"])}}, 0, False


@dataclass(frozen=True, slots=True)
class RankStart:
    """What a rank brings to a run's start: its position (step, micro), a state it loaded, whether it
    reconnects mid-run (its server restarted: continue where it was)."""

    position: tuple[int, int]
    state: dict | None = None
    resume: bool = False
    latest: dict | None = None  # reconnecting: the newest state the rank knows (it carries it; see carried_start)


@dataclass(frozen=True, slots=True)
class StartPoint:
    """Where a run starts. ``planner``: the state to plan from (None: the beginning, or the stored state at or
    before ``load_at`` when that is set); ``clear``: the stored states belong to another run, forget them."""

    positions: dict[int, tuple[int, int]]
    planner: dict | None = None
    load_at: int | None = None
    clear: bool = False
    skip: int = 0  # plan this many steps from ``planner`` without delivering them first (``loader.skip``)
    defer: bool = False  # ...and deliver their pieces after the rest of each source's epoch


def start_point(ranks: Mapping[int, RankStart], layout: dict) -> StartPoint:
    """The one start rule (a single node and the cluster leader alike), in order of precedence:

    1. ranks brought states (``load_state_dict``): they must agree; ranks without one adopt it;
    2. ranks reconnect mid-run: continue from the stored state at or before the lowest of their steps; ranks
       that do not resume join at the start of that step;
    3. otherwise a new run from the beginning, whatever is stored.
    """
    if any(r.state is not None for r in ranks.values()):
        planner, positions, (skip, defer) = start_from_states({k: r.state for k, r in ranks.items()}, layout)
        return StartPoint(positions=positions, planner=planner, clear=True, skip=skip, defer=defer)
    resumed = [r.position for r in ranks.values() if r.resume]
    if resumed:
        low = min(resumed)
        positions = {k: (r.position[0], r.position[1]) if r.resume else (low[0], 0) for k, r in ranks.items()}
        return StartPoint(positions=positions, load_at=low[0])
    return StartPoint(positions={k: (0, 0) for k in ranks}, clear=True)


@dataclass(frozen=True, slots=True)
class Carried:
    """A resumed run's start from the states its ranks carry (when the node stored none): the state to plan
    from (None: the beginning) with the skip it asks for, and the mixture changes of later steps to apply."""

    planner: dict | None
    skip: int = 0
    defer: bool = False
    overrides: tuple[tuple[int, dict], ...] = ()


def carried_start(ranks: Mapping[int, RankStart], step: int) -> Carried | None:
    """Where ranks that resume at ``step`` continue when the node has no stored state (no ``state_dir``, or a
    fresh one): from the newest state they carry that starts at or before ``step`` (skip included), with the
    mixture changes the newest state of all records from there on (set_mixture calls after it). None when no
    rank carries a state."""
    carried = [r.latest for r in ranks.values() if r.latest is not None and isinstance(r.latest.get("planner"), dict)]
    if not carried:
        return None

    def begins(st: dict) -> int:
        return int(st["planner"]["step"]) + skip_of(st)[0]

    fits = [st for st in carried if begins(st) <= step]
    base = max(fits, key=begins) if fits else None
    newest = max(carried, key=lambda st: int(st["planner"]["step"]))
    since = begins(base) if base is not None else 0
    overrides = tuple(
        (int(s), dict(w)) for s, w in (newest["planner"].get("mixture") or {}).get("overrides", ()) if int(s) >= since
    )
    if base is None:
        return Carried(None, overrides=overrides)
    planner, skip, defer = start_skip(base)
    return Carried(planner, skip, defer, overrides)
