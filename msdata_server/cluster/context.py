"""What every part of a node's cluster job layer may use of the node: one typed, frozen ``ClusterContext``.

``ClusterJobs`` builds it once and hands it to each part (``Run``, ``JobShard``, its reference counts and
metadata, ``LeaderReports``, the leader's ``Coordinator`` and its ``JobCoordinator``s, the fault module):
this node's id, the cluster and autoscale settings, the peer RPC, the layer's task set, the worker pool and
the autoscaler when the node has them, and the cluster runtime (members, leader, fencing token). No part is
handed its parent; what a child needs of the node is here, named and typed.

The context also holds the follower's few requests to the leader (``need``, ``ack``, ``set_mixture``,
``mix_state``): they need nothing but the RPC and the leader's id, and every run sends them.
"""

from __future__ import annotations

import asyncio
from contextlib import suppress
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Protocol

from ..config import AutoscaleConfig, ClusterConfig
from ..errors import ClosedError, ConfigError, PeerLostError
from ..tasks import TaskSet
from .net.rpc import PeerRpc

if TYPE_CHECKING:
    from ..autoscale import Autoscaler
    from ..pool import WorkerPool
    from .net.peers import PeerLink
    from .net.runtime import ClusterNode

__all__ = ["ACK_EVERY", "ClusterContext", "RunId", "Settle", "ack_due"]

# A node acknowledges the last step it fed every ACK_EVERY steps, and at once when the leader is about to wait
# for it (``ack_due``): a leader that plans faster than nodes feed hears from each node every few steps, not
# every step; one that waits on its nodes hears from each at every step it may plan, as before.
ACK_EVERY = 4


def ack_due(fed: int, last: int | None, newest: int, window: int) -> bool:
    """Whether a node tells the leader now that it fed up to step ``fed``, having last told it ``last`` (None:
    nothing yet) and holding the plans up to ``newest``: every ``ACK_EVERY`` steps; at once when our plans
    reach one step short of all that ``last`` lets the leader plan (up to the lowest acknowledged step +
    ``window``), so the acknowledgement travels while the leader plans that last step and it never waits for
    it; at once when our position moved back (a mixture change's cut)."""
    if last is None or fed < last:
        return True
    return fed > last and (fed >= last + ACK_EVERY or newest >= last + window - 1)


class RunId(Protocol):
    """A run as the leader's requests name it, and where this node stands in it (``cluster.run.Run``)."""

    @property
    def digest(self) -> str: ...

    @property
    def id(self) -> str: ...

    @property
    def next_step(self) -> int: ...

    @property
    def fed_step(self) -> int: ...


class Settle:
    """Wakes whoever waits for placement to settle: at a membership change, or when a link breaks."""

    def __init__(self) -> None:
        self._ev = asyncio.Event()

    def wake(self) -> None:
        self._ev.set()
        self._ev = asyncio.Event()

    async def wait(self, timeout: float) -> None:  # noqa: ASYNC109  (a bounded wait is what it is)
        """Until the next wake, or ``timeout`` seconds."""
        with suppress(TimeoutError):
            await asyncio.wait_for(self._ev.wait(), timeout)


@dataclass(frozen=True, slots=True, kw_only=True)
class ClusterContext:
    """The node as the cluster job layer sees it; built once by ``ClusterJobs``."""

    node_id: str
    config: ClusterConfig
    autoscale: AutoscaleConfig
    rpc: PeerRpc
    tasks: TaskSet  # the job layer's tasks (they end with it)
    cluster: ClusterNode  # members, leader, fencing token, etcd
    pool: WorkerPool | None = None
    autoscaler: Autoscaler | None = None  # with a pool: profiles sources for the leader, follows its targets
    settled: Settle = field(default_factory=Settle)

    @property
    def probe(self) -> float:
        """Seconds a node waits for a plan (or a hold's end) before asking the leader again."""
        return self.config.lease_ttl / 2

    # ---- the cluster ------------------------------------------------------------------------------------
    def live_nodes(self) -> list[str]:
        """The live members and this node, sorted."""
        return sorted(set(self.cluster.members) | {self.node_id})

    @property
    def leader_id(self) -> str | None:
        return self.cluster.leader_id

    @property
    def token(self) -> int:
        """Our fencing token while we lead (0: we do not)."""
        election = self.cluster.election
        return int(election.token or 0) if election is not None else 0

    def link(self, nid: str) -> PeerLink | None:
        """Our outgoing link to ``nid``, if up."""
        return self.cluster.links.get(nid)

    async def wait_leader(self) -> None:
        """Until the cluster has a leader (or a lease period passed)."""
        election = self.cluster.election
        if election is None:
            raise ClosedError("the node has not joined the cluster yet; call ClusterNode.start() first")
        with suppress(TimeoutError):
            await asyncio.wait_for(election.wait_leader(), self.config.lease_ttl)

    async def members_settle(self) -> None:
        """Wait for the next membership change (or a lease period): a lost owner is replaced by then."""
        await self.settled.wait(self.config.lease_ttl)

    # ---- a follower's requests to the leader ------------------------------------------------------------
    def _leader(self, what: str) -> str:
        leader = self.cluster.leader_id
        if leader is None:
            raise PeerLostError(f"{what}: the cluster has no leader right now (etcd unreachable?); retry shortly")
        return leader

    def to_leader(self, frame: dict) -> None:
        """Fire and forget (a lost frame is repeated by the next probe)."""
        leader = self.cluster.leader_id
        if leader is not None:
            self.tasks.spawn(self.rpc.quiet_send(leader, frame), name=str(frame["t"]))

    def need(self, run: RunId) -> None:
        """Tell the leader the lowest step this node lacks and the last it fed (it re-sends what is missing)."""
        frame = {"t": "need", "digest": run.digest, "run": run.id, "node": self.node_id}
        self.to_leader({**frame, "step": run.next_step, "fed": run.fed_step})

    def ack(self, run: RunId) -> None:
        """Tell the leader the last step fed here (planning may run ahead of it; the run says when: ``ack_due``)."""
        self.to_leader({"t": "ack", "digest": run.digest, "run": run.id, "node": self.node_id, "step": run.fed_step})

    async def set_mixture(self, run: RunId, weights: dict) -> int:
        """A rank's set_mixture: the leader's coordinator cuts, re-plans and records it; returns the cut step."""
        frame = {"t": "mix", "digest": run.digest, "run": run.id, "weights": weights}
        head, _ = await self.rpc.request(self._leader("set_mixture"), frame)
        if head.get("refused"):
            raise ConfigError(head["refused"])
        return int(head["step"])

    async def mix_state(self, run: RunId) -> dict:
        """The leader's mixture-change state of a run (PeerLostError while there is no leader to ask)."""
        frame = {"t": "mixstate", "digest": run.digest, "run": run.id}
        head, _ = await self.rpc.request(self._leader("mixture state"), frame)
        return head
