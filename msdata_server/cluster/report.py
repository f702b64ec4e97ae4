"""What a node tells the leader: a report of its jobs (and its autoscaler's profile and budget), whenever they
change, the leader does or the autoscaler decided.

Reports are pushed by one task, coalesced through a dirty flag, and retried with back-off while the link to
a new leader comes up. The per-run ``need``/``ack`` frames go by ``ClusterContext.need``/``ack``.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable, Iterable
from typing import TYPE_CHECKING

from ..errors import PeerLostError
from .context import ClusterContext
from .run import RunTable

if TYPE_CHECKING:
    from ..job import Job

__all__ = ["LeaderReports"]

log = logging.getLogger(__name__)


class LeaderReports:
    """The report pushed to the leader (``jobs`` frames): every registration of a job here, with its run."""

    def __init__(self, ctx: ClusterContext, runs: RunTable, registrations: Callable[[], Iterable[Job]]) -> None:
        self.ctx = ctx
        self.runs = runs  # digest -> Run, the job layer's
        self.registrations = registrations  # the node's jobs, running and pending
        self.dirty = asyncio.Event()

    def changed(self) -> None:
        """Something the leader reads changed: push a new report."""
        self.dirty.set()

    def report(self) -> dict:
        jobs = []
        for job in self.registrations():
            if job.state == "closed":
                continue
            run = self.runs.get(job.digest)
            mine = run if run is not None and run.inst == job.inst else None  # this registration is in that run
            jobs.append(
                {
                    "name": job.name,
                    "digest": job.digest,
                    "spec": job.spec.to_dict(),
                    "ranks": job.ranks.report(),
                    "inst": job.inst,
                    "run": mine.id if mine is not None else None,
                    "running": mine is not None,
                    "next": mine.next_step if mine is not None else None,
                    "fed": mine.fed_step if mine is not None else None,
                    "parts": mine.parts_wire() if mine is not None else None,  # splits and merges
                }
            )
        rep: dict = {"t": "jobs", "node": self.ctx.node_id, "jobs": jobs}
        scaler = self.ctx.autoscaler
        if scaler is not None:  # its profile and budget: the leader sizes its workers (autoscale.cluster)
            rep["autoscale"] = scaler.report()
        return rep

    async def push(self) -> None:
        """Runs for the node's life: send a report whenever one is due."""
        delay = 0.05
        ctx = self.ctx
        while True:
            await self.dirty.wait()
            self.dirty.clear()
            leader = ctx.leader_id
            if leader is None:
                await ctx.wait_leader()
                self.dirty.set()
                continue
            try:
                await ctx.rpc.send(leader, self.report())
                delay = 0.05
            except PeerLostError:
                self.dirty.set()
                await asyncio.sleep(delay)  # back-off until the link to the new leader is up
                delay = min(delay * 2, 0.5)
