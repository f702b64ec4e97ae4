"""The leader's server is SIGKILLed mid-run and started again (as systemd would) while its rank lives on, on real
etcd and three server processes: another node leads and resumes the run from the planner states in etcd; the
restarted node, whose rank is behind the step the new leader resumes planning at, gets the steps between (it
asks for them after a probe period without plans); every rank gets exactly the batches of an uninterrupted
run."""

from __future__ import annotations

import re

import pytest

from .cluster_util import NODES, at_pause, node_ranks
from .e2e_util import run_ranks, small_job
from .polling import wait_for


@pytest.mark.timeout(300)  # a killed server restarting and rejoining is slow on 2 busy cores, not stuck
def test_leader_restarted_its_rank_reconnects_behind_the_new_leader_and_continues_exact(
    etcd_server, cluster_factory, server_factory
):
    spec = small_job("relead", dp=3, samples=400, seed=11, prefetch=1)
    n, before = 10 * spec.micro_batches, 3 * spec.micro_batches
    want = run_ranks(spec, server_factory().start().socket, n)

    c = cluster_factory(etcd_server.url).start()
    leader, _ = wait_for(lambda: c.settled(set(c.nodes)), 30, "one leader that every node agrees on")
    # the ranks end together, as a training run's do: ranks far ahead that left (closing the job on their nodes)
    # before the new leader resumed would leave the behind rank's node alone with a run nobody coordinates
    got, errs, go, threads = node_ranks(c, spec, n, before, together=True)
    at_pause(got, errs, before)
    c.nodes[leader].kill()
    c.nodes[leader].start()  # its supervisor restarts it; its rank reconnects
    go.set()
    for t in threads:
        t.join(120)
        assert not t.is_alive(), "a rank hung after the leader restarted"
    assert not errs, errs
    for r in range(NODES):
        assert got[r] == want[r], f"rank {r} saw other batches than an uninterrupted run"
    logs = "".join(srv.log() for srv in c.nodes.values())
    m = re.search(r"job relead: resumed run \w+ across \d node\(s\) from step (\d+)", logs)
    assert m is not None, "no node resumed the run after the leader was killed"
