"""A node that lacks plans gets them again: from the leader's memory, else re-planned from etcd; a node
whose ranks rejoin a run (its server restarted) is told the run again first.

Links break and nodes restart; frames sent meanwhile are lost. The leader keeps the encoded plans of the
steps not yet fed on every live node and re-sends them; a step it no longer holds (or that an earlier leader
planned) is planned again from the etcd state at or before it. Plans are deterministic, so re-planned ones
equal the originals, and nodes ignore duplicates.
"""

from __future__ import annotations

import asyncio
import logging
from typing import Any, Protocol

from msdata_client.spec import JobSpec

from ...errors import PeerLostError
from ...job.view import ThreadView
from ...planner import Planner
from ...planner.spec import planner_config
from ...tasks import TaskSet
from ..parts import RunParts
from ..planwire import encode_plan
from .statestore import EtcdStateStore

__all__ = ["CatchUp", "RunPlans"]

log = logging.getLogger(__name__)


class RunPlans(Protocol):
    """What catching up reads of a run's coordinator (``coordinator.JobCoordinator``)."""

    spec: JobSpec
    digest: str
    run_id: str
    jobs: Any  # the node's ClusterJobs: rpc, runs
    tasks: TaskSet
    store: EtcdStateStore
    stopped: bool
    start_frame: dict | None
    planned: int  # the next step the main planner will send
    sent: dict[int, tuple[dict, bytes]]  # encoded plans not yet fed on every live node
    mix_states: dict[int, dict]  # cut -> the planner state with that mixture change
    gen: int
    last_cut: int | None
    views: set[ThreadView]
    rank_nodes: dict[int, str]  # where each rank of the run is registered
    parts: RunParts  # the run's partition table (every plan carries it)

    @property
    def token(self) -> int: ...

    def view(self, run, loop: asyncio.AbstractEventLoop) -> ThreadView: ...

    def insts_frame(self) -> dict[str, list[str]]: ...


class CatchUp:
    """Re-sending and re-planning of one job run's plans for nodes that lack some (at most one at a time each)."""

    def __init__(self, coord: RunPlans):
        self.coord = coord
        self._resending: dict[str, asyncio.Task] = {}

    def update(self, per: dict[str, dict]) -> None:
        """A later report: ranks that (re)joined on a node are told the run (a restarted follower rejoins)."""
        c = self.coord
        if c.start_frame is None:
            return
        changed = False
        for nid, j in per.items():
            for r in j["ranks"]:
                if c.rank_nodes.get(int(r)) != nid:
                    c.rank_nodes[int(r)] = nid
                    changed = True
            if j["ranks"] and not j["running"]:
                changed = True
        if changed:
            c.tasks.spawn(self._rejoin(per), name="rejoin")

    async def _rejoin(self, per: dict[str, dict]) -> None:
        c = self.coord
        if c.start_frame is None:
            return  # not started (update() checks it too)
        positions = dict(c.start_frame["positions"])
        for j in per.values():
            for r, info in j["ranks"].items():
                if info.get("resume"):
                    positions[str(r)] = info["pos"]
        frame = {
            **c.start_frame,
            "rank_nodes": {str(r): n for r, n in c.rank_nodes.items()},
            "positions": positions,
            "token": c.token,
            "insts": c.insts_frame(),
        }
        for nid, j in per.items():
            if j["ranks"] and not j["running"]:
                low = min(int(info["pos"][0]) for info in j["ranks"].values())
                delay = 0.05
                while not c.stopped:  # a node that restarted at once is linked again shortly
                    try:
                        await c.jobs.rpc.send(nid, frame)
                        break
                    except PeerLostError:
                        await asyncio.sleep(delay)  # back-off until the link to the restarted node is up
                        delay = min(2 * delay, 0.5)
                await self.replay(nid, low)

    def relink(self, nid: str, step: int) -> None:
        """Our link to ``nid`` is (back) up: tell it the run first, then send it the plans from ``step`` again. A
        node that restarted with no ranks of the job (it only owns data) has not heard of the run otherwise, yet
        the others deal it partitions again and fetch from it. The frame names no registrations: it starts no job
        there (``_rejoin`` does, for ranks that come back)."""
        c = self.coord
        if c.stopped or c.start_frame is None:
            return
        frame = {
            **c.start_frame,
            "rank_nodes": {str(r): n for r, n in c.rank_nodes.items()},
            "token": c.token,
            "insts": {},
        }
        c.tasks.spawn(self._relink(nid, frame, step), name=f"relink-{nid}")

    async def _relink(self, nid: str, frame: dict, step: int) -> None:
        await self.coord.jobs.rpc.quiet_send(nid, frame)
        self.resend(nid, step)

    def resend(self, nid: str, step: int) -> None:
        """Send a node the plans of [step, planned) again (it lost some): from memory, else re-planned."""
        c = self.coord
        if c.stopped or c.start_frame is None or step >= c.planned or nid in self._resending:
            return
        t = c.tasks.spawn(self._resend(nid, max(step, 0)), name=f"resend-{nid}")
        self._resending[nid] = t
        t.add_done_callback(lambda _t: self._resending.pop(nid, None))

    async def _resend(self, nid: str, step: int) -> None:
        c = self.coord
        end = c.planned
        log.info("job %s: re-sending the plans of steps %d..%d to %s", c.spec.name, step, end - 1, nid)
        for s in range(step, end):
            kept = c.sent.get(s)
            if kept is None:  # no longer in memory (or planned by an earlier leader): re-plan from etcd
                await self.replay(nid, s)
                return
            await c.jobs.rpc.quiet_send(nid, *kept)

    async def replay(self, nid: str, low: int) -> None:
        """Re-plan steps [low, now) for a node that rejoined (deterministic: the same plans)."""
        c = self.coord
        found = await c.store.load_at_or_before(low)
        if found is None:
            return
        step, state = found
        planner = Planner(planner_config(c.spec), state=state)
        run = c.jobs.runs.get(c.digest)
        if run is None or run.id != c.run_id:
            return
        view = c.view(run, asyncio.get_running_loop())
        gen, last_cut = c.gen, c.last_cut  # a mixture change meanwhile makes these plans stale (nodes drop them)
        try:
            while planner.step < c.planned and not c.stopped:
                if planner.step in c.mix_states and planner.step > step:  # a mixture change from this step on
                    planner = Planner(planner_config(c.spec), state=c.mix_states[planner.step])
                st = planner.state_dict()
                plan = await asyncio.to_thread(planner.plan_step, view)
                header, buf = encode_plan(plan, job=c.spec.name, digest=c.digest, token=c.token)
                header.update(state=st, gen=gen, run=c.run_id, cut=last_cut, parts=c.parts.table.wire())
                await c.jobs.rpc.quiet_send(nid, header, buf)
        finally:
            c.views.discard(view)
