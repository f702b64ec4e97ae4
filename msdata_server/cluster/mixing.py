"""Mixture changes across nodes, the node side: a rank's ``set_mixture`` goes to the leader, whose coordinator
holds every node, cuts and re-plans (``coordinator.JobCoordinator.set_mixture``); a node held for a change
asks the leader where it stands when the cut is late (``run.Run``).

The relay also answers those two requests when this node leads: ``mix`` (with the cut step, a refusal for
bad weights, or the error that stopped it) and ``mixstate``.
"""

from __future__ import annotations

from typing import Any

from ..errors import ConfigError, MsdataError, PeerLostError
from .net.rpc import error_reply

__all__ = ["MixtureRelay"]


class MixtureRelay:
    """``set_mixture`` and ``mix_state`` of a run, asked of the leader; the leader's answers to them."""

    def __init__(self, jobs: Any):
        self.jobs = jobs  # the node's ClusterJobs: cluster, rpc, coordinator, tasks

    def _leader(self, what: str) -> str:
        leader = self.jobs.cluster.leader_id
        if leader is None:
            raise PeerLostError(f"{what}: the cluster has no leader right now (etcd unreachable?); retry shortly")
        return leader

    async def set_mixture(self, run, weights: dict) -> int:
        """A rank's set_mixture: the leader's coordinator cuts, re-plans and records it; returns the cut step."""
        frame = {"t": "mix", "digest": run.digest, "run": run.id, "weights": weights}
        head, _ = await self.jobs.rpc.request(self._leader("set_mixture"), frame)
        if head.get("refused"):
            raise ConfigError(head["refused"])
        return int(head["step"])

    async def mix_state(self, run) -> dict:
        """The leader's mixture-change state of a run (PeerLostError while there is no leader to ask)."""
        head, _ = await self.jobs.rpc.request(
            self._leader("mixture state"), {"t": "mixstate", "digest": run.digest, "run": run.id}
        )
        return head

    # ---- the leader's side ----
    async def on_mix(self, peer: str, frame: dict, payload) -> None:
        self.jobs.tasks.spawn(self._serve_mix(frame), name="serve-mix")

    async def _serve_mix(self, frame: dict) -> None:
        c = self.jobs.coordinator.coordinating(frame)
        rpc = self.jobs.rpc
        try:
            if c is None:
                raise PeerLostError(
                    f"node {self.jobs.node_id} does not coordinate job {str(frame.get('digest'))[:12]} "
                    "(the leader changed); retry"
                )
            await rpc.reply(frame, {"step": await c.set_mixture(dict(frame["weights"]))})
        except ConfigError as e:
            await rpc.reply(frame, {"refused": str(e)})
        except (MsdataError, KeyError, TypeError, ValueError) as e:
            await rpc.reply(frame, error_reply(e))

    async def on_mixstate(self, peer: str, frame: dict, payload) -> None:
        """A held node asks where the leader's mixture changes stand."""
        c = self.jobs.coordinator.coordinating(frame)
        if c is None:
            err = PeerLostError(f"node {self.jobs.node_id} does not coordinate that run")
            await self.jobs.rpc.reply(frame, error_reply(err))
        else:
            await self.jobs.rpc.reply(frame, {"busy": c.mixing, "token": c.token, "gen": c.gen, "cut": c.last_cut})
