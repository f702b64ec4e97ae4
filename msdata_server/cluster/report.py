"""What a node tells the leader: a report of its jobs (and its autoscaler's profile and budget), whenever they
change, the leader does or the autoscaler decided, and per run the step it lacks (the leader re-sends from
there) and the last step it fed (planning may run ahead of it).

Reports are pushed by one task, coalesced through a dirty flag, and retried with back-off while the link to
a new leader comes up; ``need``/``ack`` are fire-and-forget (a lost one is repeated by the next probe).
"""

from __future__ import annotations

import asyncio
import logging
from contextlib import suppress

from ..errors import PeerLostError
from ..tasks import TaskSet
from .net.rpc import PeerRpc

__all__ = ["LeaderReports"]

log = logging.getLogger(__name__)


class LeaderReports:
    """The report pushed to the leader (``jobs`` frames) and the ``need``/``ack`` frames of runs."""

    def __init__(self, node, rpc: PeerRpc, runs: dict, tasks: TaskSet):
        self.node = node
        self.cluster = node.cluster
        self.node_id = node.config.node.id
        self.rpc = rpc
        self.runs = runs  # digest -> Run, shared with the job layer
        self.tasks = tasks
        self.dirty = asyncio.Event()

    def changed(self) -> None:
        """Something the leader reads changed: push a new report."""
        self.dirty.set()

    def report(self) -> dict:
        jobs = []
        for job in list(self.node.jobs.values()) + list(self.node.pending.values()):
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
                    "parts": mine.shard.where.table.wire() if mine is not None else None,  # splits and merges
                }
            )
        rep: dict = {"t": "jobs", "node": self.node_id, "jobs": jobs}
        scaler = getattr(self.node, "autoscaler", None)
        if scaler is not None:  # its profile and budget: the leader sizes its workers (autoscale.cluster)
            rep["autoscale"] = scaler.report()
        return rep

    async def push(self) -> None:
        """Runs for the node's life: send a report whenever one is due."""
        delay = 0.05
        ttl = self.node.config.cluster.lease_ttl
        while True:
            await self.dirty.wait()
            self.dirty.clear()
            leader = self.cluster.leader_id
            if leader is None:
                with suppress(TimeoutError):
                    await asyncio.wait_for(self.cluster.election.wait_leader(), ttl)
                self.dirty.set()
                continue
            try:
                await self.rpc.send(leader, self.report())
                delay = 0.05
            except PeerLostError:
                self.dirty.set()
                await asyncio.sleep(delay)  # back-off until the link to the new leader is up
                delay = min(delay * 2, 0.5)

    def _to_leader(self, frame: dict) -> None:
        leader = self.cluster.leader_id
        if leader is not None:
            self.tasks.spawn(self.rpc.quiet_send(leader, frame), name=frame["t"])

    def need(self, run) -> None:
        """Tell the leader the lowest step this node lacks and the last it fed (it re-sends what is missing)."""
        self._to_leader(
            {
                "t": "need",
                "digest": run.digest,
                "run": run.id,
                "node": self.node_id,
                "step": run.next_step,
                "fed": run.fed_step,
            }
        )

    def ack(self, run) -> None:
        self._to_leader({"t": "ack", "digest": run.digest, "run": run.id, "node": self.node_id, "step": run.fed_step})
