"""Planner checkpoints on the node's disk: the small state at each step boundary, so a server killed with
SIGKILL continues a job where its ranks were (large buffers are rebuilt by deterministic replay, never
snapshotted). One file per step, written atomically (tmp + rename), the last ``keep`` kept."""

from __future__ import annotations

import logging
import os
import re
from collections.abc import Mapping
from dataclasses import dataclass

import orjson

from .errors import CheckpointError

__all__ = ["RankStart", "StartPoint", "StateStore", "start_from_states", "start_point"]

log = logging.getLogger(__name__)

_STEP_FILE = re.compile(r"^step-(\d{12})\.json$")


class StateStore:
    """Per-job directory ``{state_dir}/{job}/{digest16}`` of ``step-NNNNNNNNNNNN.json`` planner states."""

    def __init__(self, state_dir: str, job: str, digest: str, keep: int = 64):
        self.dir = os.path.join(state_dir, job, digest[:16])
        self.keep = keep
        self._steps: list[int] | None = None

    def _list(self) -> list[int]:
        if self._steps is None:
            try:
                names = os.listdir(self.dir)
            except FileNotFoundError:
                names = []
            self._steps = sorted(int(m.group(1)) for n in names if (m := _STEP_FILE.match(n)))
        return self._steps

    def _path(self, step: int) -> str:
        return os.path.join(self.dir, f"step-{step:012d}.json")

    def save(self, step: int, state: dict) -> None:
        """Write the state at the start of ``step``; drop the oldest beyond ``keep``."""
        os.makedirs(self.dir, mode=0o700, exist_ok=True)
        tmp = self._path(step) + ".tmp"
        with open(tmp, "wb") as f:
            f.write(orjson.dumps(state))
        os.replace(tmp, self._path(step))
        steps = self._list()
        if step not in steps:
            steps.append(step)
            steps.sort()
        while len(steps) > self.keep:
            old = steps.pop(0)
            try:
                os.unlink(self._path(old))
            except FileNotFoundError:
                pass

    def load_at_or_before(self, step: int) -> tuple[int, dict] | None:
        """The newest readable state at a step <= ``step`` (a torn or corrupt file is skipped)."""
        for s in reversed([s for s in self._list() if s <= step]):
            try:
                with open(self._path(s), "rb") as f:
                    return s, orjson.loads(f.read())
            except (OSError, orjson.JSONDecodeError) as e:
                log.warning("skipping unreadable planner checkpoint %s: %s", self._path(s), e)
        return None

    def clear(self) -> None:
        """Forget every checkpoint of this job (a new run that brought no state starts from the beginning)."""
        for s in self._list():
            try:
                os.unlink(self._path(s))
            except FileNotFoundError:
                pass
        self._steps = []


def start_from_states(states: dict, layout: dict) -> tuple[dict, dict[int, tuple[int, int]]]:
    """Where a job starts when ranks brought states (``states``: rank -> state or None, at least one given).

    Every given state must hold the same planner position (else CheckpointError for every rank); ranks that
    brought none adopt it. Returns the planner state and each rank's (step, micro): a rank keeps its micro-batch
    only when its state was saved under this same layout (another layout restarts the step).
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
    step = int(first["planner"]["step"])
    positions = {}
    for r, st in states.items():
        same = st is not None and st.get("layout") == layout
        positions[r] = (step, int(st["position"]["micro"]) if same else 0)
    return first["planner"], positions


@dataclass(frozen=True, slots=True)
class RankStart:
    """What a rank brings to a run's start: its position (step, micro), a state it loaded, whether it
    reconnects mid-run (its server restarted: continue where it was)."""

    position: tuple[int, int]
    state: dict | None = None
    resume: bool = False


@dataclass(frozen=True, slots=True)
class StartPoint:
    """Where a run starts. ``planner``: the state to plan from (None: the beginning, or the stored state at or
    before ``load_at`` when that is set); ``clear``: the stored states belong to another run, forget them."""

    positions: dict[int, tuple[int, int]]
    planner: dict | None = None
    load_at: int | None = None
    clear: bool = False


def start_point(ranks: Mapping[int, RankStart], layout: dict) -> StartPoint:
    """The one start rule (a single node and the cluster leader alike), in order of precedence:

    1. ranks brought states (``load_state_dict``): they must agree; ranks without one adopt it;
    2. ranks reconnect mid-run: continue from the stored state at or before the lowest of their steps; ranks
       that do not resume join at the start of that step;
    3. otherwise a new run from the beginning, whatever is stored.
    """
    if any(r.state is not None for r in ranks.values()):
        planner, positions = start_from_states({k: r.state for k, r in ranks.items()}, layout)
        return StartPoint(positions=positions, planner=planner, clear=True)
    resumed = [r.position for r in ranks.values() if r.resume]
    if resumed:
        low = min(resumed)
        positions = {k: (r.position[0], r.position[1]) if r.resume else (low[0], 0) for k, r in ranks.items()}
        return StartPoint(positions=positions, load_at=low[0])
    return StartPoint(positions={k: (0, 0) for k in ranks}, clear=True)
