"""Shadow loaders (`[job] shadow_loaders`): standby placement (pure), and a takeover on real etcd and three
server processes: the node owning partitions is SIGKILLed mid-run, its standbys serve at once, and the
surviving ranks get exactly the batches of an uninterrupted run on one node."""

from __future__ import annotations

import re
import threading

import numpy as np
import pytest

import msdata_client as msd
from msdata_server.cluster.placement import fail_over, place_shadows, place_sources
from msdata_server.cluster.shard import JobShard
from msdata_server.cluster.shardrefs import STANDBY_SLACK
from msdata_server.errors import ConfigError
from msdata_server.planner import Mixture, Planner, PlannerConfig

from .cluster_util import node_status
from .e2e_util import batch_record, run_ranks, small_job
from .polling import wait_for

NODES = ["node-0", "node-1", "node-2"]


def test_standbys_are_other_nodes_spread_by_load_and_deterministic():
    cost = [0.6, 0.4]
    owners = place_sources([6, 6], NODES, cost)
    sh = place_shadows(owners, NODES, 1, cost)
    assert sh == place_shadows(owners, list(reversed(NODES)), 1, cost)  # a function of the set, not its order
    load = dict.fromkeys(NODES, 0.0)
    for s, row in enumerate(sh):
        for k, nids in enumerate(row):
            assert len(nids) == 1
            assert owners[s][k] not in nids
            load[nids[0]] += cost[s]
    assert max(load.values()) - min(load.values()) <= max(cost) + 1e-9, load  # within one partition of even
    two = place_shadows(owners, NODES, 2, cost)
    assert all(len(set(n)) == 2 and owners[s][k] not in n for s, row in enumerate(two) for k, n in enumerate(row))
    # more standbys asked than other nodes: as many as there are; one node: none (accepted, no effect)
    assert all(len(n) == 2 for row in place_shadows(owners, NODES, 5, cost) for n in row)
    assert place_shadows([["a", "a"]], ["a"], 1) == [[(), ()]]
    assert place_shadows(owners, NODES, 0, cost) == [[()] * 6, [()] * 6]
    with pytest.raises(ConfigError, match="shadow_loaders=-1"):
        place_shadows(owners, NODES, -1)


def test_fail_over_moves_only_the_lost_nodes_partitions_to_their_standbys():
    cost = [0.6, 0.4]
    owners = place_sources([6, 6], NODES, cost)
    sh = place_shadows(owners, NODES, 1, cost)
    new, taken = fail_over(owners, sh, ["node-0", "node-1"], cost)
    lost = [(s, k) for s, row in enumerate(owners) for k, n in enumerate(row) if n == "node-2"]
    assert lost
    assert sorted(taken) == sorted(lost)
    for s, row in enumerate(owners):
        for k, n in enumerate(row):
            assert new[s][k] == (sh[s][k][0] if n == "node-2" else n)
    # no standby left alive: the plain placement over the live nodes (cold), as without shadows
    cold = place_sources([6, 6], ["node-0"], cost)
    new2, taken2 = fail_over(owners, [[("node-1",)] * 6] * 2, ["node-0"], cost)
    assert new2 == cold
    assert taken2 == []


def test_shadow_loaders_key_round_trips_and_is_layout_not_data():
    spec = small_job("sh", seed=3)
    with_shadow = msd.DGraph.from_spec(spec).shadow_loaders(2).plan()
    assert with_shadow.shadow_loaders == 2
    assert spec.shadow_loaders == 0
    assert msd.JobSpec.from_dict(with_shadow.to_dict()) == with_shadow
    assert "shadow_loaders" in with_shadow.to_toml()
    assert "shadow_loaders" not in spec.to_toml()
    assert with_shadow.data_digest() == spec.data_digest()
    assert with_shadow.digest() != spec.digest()
    with pytest.raises(ConfigError, match="shadow_loaders=-1 must be an integer >= 0"):
        msd.DGraph.from_spec(spec).shadow_loaders(-1).plan()


class _Host:
    """What a JobShard asks of its node's ClusterJobs for placement and references (no loaders are opened)."""

    node_id = "node-1"
    pool = None

    def live_nodes(self) -> list[str]:
        return list(NODES)


def test_a_standby_counts_references_of_recent_steps_only():
    """A standby counts its partitions' piece references like the owner (they are its own if it takes over),
    but forgets those of steps every builder has fetched: its counts stay bounded however long it stands by;
    the owned partitions' counts are the same as without shadows."""
    spec = small_job("refs", dp=2, seq_len=64, prefetch=1)
    cold = JobShard(_Host(), spec, "d", 3, run="r")
    warm = JobShard(_Host(), msd.DGraph.from_spec(spec).shadow_loaders(1).plan(), "d", 3, run="r")
    owners, standbys = warm.where.layout()
    assert owners == cold.placement()
    assert any("node-1" in n for row in standbys for n in row)

    class View:
        def lengths(self, source, start, count):
            return np.random.default_rng(source * 1000003 + start).integers(1, 24, size=count).astype(np.int64)

    cfg = PlannerConfig(
        sources=("a", "b"), seq_len=64, dp=2, micro_batches=2, rows=1, mixture=Mixture.constant({"a": 0.4, "b": 0.6})
    )
    planner, builders = Planner(cfg), {0: ("node-0",), 1: ("node-2",)}
    steps = 300
    stood: dict[int, set] = {}  # step -> documents of partitions stood by for on node-1
    for _ in range(steps):
        plan = planner.plan_step(View())
        cold.add_refs(plan, builders)
        warm.add_refs(plan, builders)
        stood[plan.step] = {
            (s, o)
            for s, o in zip(plan.source.tolist(), plan.ordinal.tolist())
            if "node-1" in standbys[s][warm.part(s, o)]
        }
    window = spec.prefetch_steps + STANDBY_SLACK
    recent = set().union(*(stood[s] for s in range(steps - window - 1, steps)))
    every = set().union(*stood.values())
    extra = len(warm.refs) - len(cold.refs)
    assert 0 < extra <= len(recent) < len(every) / 2, (extra, len(recent), len(every))
    # a cut plan is taken back whole (owned and stood-by pieces)
    warm.drop_refs(plan, builders)
    cold.drop_refs(plan, builders)
    assert len(warm.refs) - len(cold.refs) <= extra


def test_owner_sigkilled_mid_run_its_standbys_take_over_and_batches_are_exact(
    etcd_server, cluster_factory, server_factory
):
    """Ranks on two nodes; the third only owns data and is SIGKILLed after a few steps. Its partitions' standbys
    take over (when the peer link breaks, before its lease ends) and the ranks get exactly the batches of an
    uninterrupted one-node run."""
    spec = msd.DGraph.from_spec(small_job("shadow", dp=2, samples=400, seed=23, prefetch=1)).shadow_loaders(1).plan()
    mb = spec.micro_batches
    n, before = 12 * mb, 3 * mb
    want = run_ranks(spec, server_factory().start().socket, n)
    c = cluster_factory(etcd_server.url).start()
    leader, _ = wait_for(lambda: c.settled(set(c.nodes)), 30, "one leader that every node agrees on")
    owner = next(nid for nid in sorted(c.nodes) if nid != leader)
    rank_nodes = [nid for nid in sorted(c.nodes) if nid != owner]
    got: dict[int, list] = {0: [], 1: []}
    errs: list[BaseException] = []
    go = threading.Event()

    def body(r):
        try:
            with msd.DataClient(spec, endpoint=c.nodes[rank_nodes[r]].socket, rank=r, world_size=2) as dc:
                for i in range(n):
                    if i == before:
                        go.wait(60)
                    got[r].append(batch_record(next(dc)))
        except BaseException as e:  # reported to the test
            errs.append(e)

    threads = [threading.Thread(target=body, args=(r,), daemon=True) for r in range(2)]
    for t in threads:
        t.start()

    def standing():
        runs = [(node_status(c.nodes[nid].socket) or {}).get("cluster", {}).get("runs", []) for nid in rank_nodes]
        return sum(r["shadows_here"] for rs in runs for r in rs if r["job"] == "shadow") > 0

    wait_for(lambda: (all(len(got[r]) == before for r in range(2)) and standing()) or errs, 60, "ranks at the pause")
    assert not errs, errs
    c.nodes[owner].kill()
    go.set()
    for t in threads:
        t.join(90)
        assert not t.is_alive(), "a rank hung after the data owner was killed"
    assert not errs, errs
    for r in range(2):
        assert got[r] == want[r], f"rank {r} saw other batches than an uninterrupted run"
    logs = "".join(c.nodes[nid].log() for nid in rank_nodes)
    assert re.search(r"took over partition \d+/\d+ of \w+ \(standby", logs), "no standby took a partition over"
    assert re.search(rf"{owner} gone; \d+ partition\(s\) taken over by their standbys", logs)
