"""The autoscaler in a cluster: the leader splits each job's demand over the nodes by the partitions they own
and sends every node its targets (fenced); the batches are the same with autoscaling on and off.

Pure tests of the split and the targets, then three real node servers on a real etcd."""

from __future__ import annotations

import math

import pytest

from msdata_server.autoscale.cluster import (
    LeaderTargets,
    RunView,
    Scaler,
    measured_costs,
    node_targets,
    placement_costs,
    split_by_owner,
)
from msdata_server.autoscale.demand import job_demands
from msdata_server.cluster.placement import place_sources
from msdata_server.planner.mixture import Mixture

from .autoscale_util import autoscale_cluster, burner_graph
from .cluster_util import NODES, at_pause, node_ranks, send_peer_frame
from .polling import wait_for


# ---- the per-node split (pure) -------------------------------------------------------------------------------
def test_split_by_owner_follows_the_partitions_each_node_owns():
    owners = {"a": ["n0", "n1", "n2"], "b": ["n1", "n1", "n2", "n0"]}
    got = split_by_owner({"a": 30.0, "b": 40.0}, owners)
    assert got == {"n0": {"a": 10.0, "b": 10.0}, "n1": {"a": 10.0, "b": 20.0}, "n2": {"a": 10.0, "b": 10.0}}
    assert math.isclose(sum(v.get("b", 0.0) for v in got.values()), 40.0)  # nothing lost or counted twice
    assert split_by_owner({"a": 5.0}, {"a": ["n2"]}) == {"n2": {"a": 5.0}}  # a node without partitions gets none
    with pytest.raises(ValueError, match="no partition placed"):
        split_by_owner({"a": 1.0}, {"a": []})


def _run(mixture: Mixture, owners, step: int = 0) -> RunView:
    return RunView(
        name="j", mixture=mixture, sources=("a", "b"), planned_step=step, tokens_per_step=1000, owners=owners
    )


def _report(cost_a: float, cost_b: float, rate: float | None = 10.0) -> dict:
    return {
        "enabled": True,
        "sources": {
            "a": {"worker_s_per_sample": cost_a, "tokens_per_sample": 100.0},
            "b": {"worker_s_per_sample": cost_b, "tokens_per_sample": 200.0},
        },
        "rates": {"j": rate} if rate else {},
    }


def test_node_targets_split_the_job_demand_and_price_it_at_each_nodes_cost():
    mix = Mixture.constant({"a": 0.4, "b": 0.6})
    owners = {"a": ["n0", "n1"], "b": ["n0", "n1", "n1"]}
    reports = {"n0": _report(0.01, 0.002), "n1": _report(0.02, 0.004)}
    per, hold = node_targets([_run(mix, owners)], reports, lead_s=0.3)
    assert not hold
    # the job's demand by the one rule of a single node: 10 steps/s x 1000 tokens x share / tokens per sample
    want, _ = job_demands(
        mixture=mix,
        sources=("a", "b"),
        planned_step=0,
        tokens_per_step=1000,
        steps_per_s=10.0,
        lead_s=0.3,
        figures=lambda n: ({"a": 100.0, "b": 200.0}[n], None),
    )
    job = {d.name: d.samples_s for d in want}
    assert math.isclose(job["a"], 40.0)
    assert math.isclose(job["b"], 30.0)
    assert math.isclose(per["n0"]["a"].samples_s, 20.0)
    assert math.isclose(per["n1"]["a"].samples_s, 20.0)
    assert math.isclose(per["n0"]["b"].samples_s, 10.0)
    assert math.isclose(per["n1"]["b"].samples_s, 20.0)
    assert math.isclose(per["n0"]["a"].workers, 20.0 * 0.01)  # its own cost
    assert math.isclose(per["n1"]["a"].workers, 20.0 * 0.02)
    assert math.isclose(per["n1"]["b"].workers, 20.0 * 0.004)


def test_node_targets_look_ahead_of_a_schedule_shift_and_hold_until_measured():
    mix = Mixture.schedule([(0, {"a": 0.9, "b": 0.1}), (50, {"a": 0.1, "b": 0.9})])
    owners = {"a": ["n0"], "b": ["n1"]}
    reports = {"n0": _report(0.01, 0.01), "n1": _report(0.01, 0.01)}
    before, _ = node_targets([_run(mix, owners, step=10)], reports, lead_s=0.3)  # 4 steps ahead: not there yet
    near, _ = node_targets([_run(mix, owners, step=48)], reports, lead_s=0.3)  # the shift is within the horizon
    assert math.isclose(before["n1"]["b"].share_ahead, 0.1)
    assert math.isclose(near["n1"]["b"].share_ahead, 0.9)
    assert near["n1"]["b"].samples_s > 8 * before["n1"]["b"].samples_s
    assert "b" not in near["n0"]  # n0 owns no partition of b
    # no rank pulled yet anywhere: nothing measured, hold (nodes give nothing back)
    unmeasured = {"n0": _report(0.01, 0.01, rate=None), "n1": _report(0.01, 0.01, rate=None)}
    per, hold = node_targets([_run(mix, owners)], unmeasured, lead_s=0.3)
    assert hold
    assert per == {"n0": {}, "n1": {}}


def test_scaler_sends_on_change_only_and_a_node_ignores_an_older_leader():
    mix = Mixture.constant({"a": 0.4, "b": 0.6})
    owners = {"a": ["n0", "n1"], "b": ["n0", "n1"]}
    reports = {"n0": _report(0.01, 0.002), "n1": _report(0.01, 0.002)}
    sc = Scaler()
    first = sc.update([_run(mix, owners)], reports, token=7, lead_s=0.3)
    assert set(first) == {"n0", "n1"}
    assert first["n0"]["token"] == 7
    assert first["n0"]["t"] == "scale"
    assert sc.update([_run(mix, owners)], reports, token=7, lead_s=0.3) == {}  # nothing moved: nothing sent
    busier = {n: _report(0.1, 0.002) for n in reports}  # a's cost went up tenfold: its need moves
    again = sc.update([_run(mix, owners)], busier, token=7, lead_s=0.3)
    assert set(again) == {"n0", "n1"}
    assert again["n0"]["sources"]["a"]["workers"] > first["n0"]["sources"]["a"]["workers"]
    idle = sc.update([], busier, token=7, lead_s=0.3)  # the job ended: no demand anywhere, workers go back
    assert set(idle) == {"n0", "n1"}
    assert idle["n0"]["sources"] == {}
    assert not idle["n0"]["hold"]

    node = LeaderTargets()
    assert node.demands is None
    assert node.status("a") is None
    assert node.accept(again["n0"])
    assert math.isclose(node.demands["a"].workers, again["n0"]["sources"]["a"]["workers"], rel_tol=1e-3)
    stale = {**first["n0"], "token": 6}
    assert not node.accept(stale)  # an older leader's targets change nothing
    assert node.token == 7
    assert node.status("a")["workers"] == again["n0"]["sources"]["a"]["workers"]


def test_placement_weighs_measured_cost_by_share_once_every_source_is_measured():
    # b's tokens cost 8x a's (0.004 / 200 vs 0.001 / 400 worker-s per token); shares 0.5 / 0.5 over 3 partitions
    reports = {
        "n0": {"sources": {"a": {"worker_s_per_sample": 0.001, "tokens_per_sample": 400.0}}},
        "n1": {
            "sources": {
                "a": {"worker_s_per_sample": 0.001, "tokens_per_sample": 400.0},
                "b": {"worker_s_per_sample": 0.004, "tokens_per_sample": 200.0},
            }
        },
    }
    declared = [0.5 / 3, 0.5 / 3]
    costs = measured_costs(("a", "b"), declared, reports)
    assert costs is not None
    assert math.isclose(costs[1] / costs[0], 8.0)
    assert measured_costs(("a", "b", "c"), [0.2, 0.2, 0.2], reports) is None  # c unmeasured: the share only

    def held(placed):
        return {n: sum(row.count(n) for row in placed) for n in ("n0", "n1")}

    # by share alone each node reads 3 of the 6 partitions; by measured cost one node reads two of b's, the
    # other b's third and all of a's cheap ones (loads 16 vs 11 in a's units, not 17 vs 10)
    assert held(place_sources([3, 3], ["n0", "n1"], declared)) == {"n0": 3, "n1": 3}
    placed = place_sources([3, 3], ["n0", "n1"], costs)
    assert held(placed) == {"n0": 2, "n1": 4}
    assert placed[0] == ["n1", "n1", "n1"]
    assert placement_costs({"costs": costs}, 2) == costs
    assert placement_costs({}, 2) is None
    assert placement_costs({"costs": [1.0]}, 2) is None
    assert placement_costs({"costs": [1.0, -1.0]}, 2) is None


def _frame(token: int, **need: float) -> dict:
    """A leader's targets: each source's need in workers (1000 samples/s at need/1000 worker-s each)."""
    sources = {
        n: {"samples_s": 1000.0, "worker_s_per_sample": w / 1000.0, "workers": w, "share": 0.5, "share_ahead": 0.5}
        for n, w in need.items()
    }
    return {"t": "scale", "token": token, "hold": False, "sources": sources}


def test_a_node_applies_the_targets_through_its_policy_and_pool_and_keeps_them(tmp_path):
    """A real pool under an autoscaler in cluster mode: nothing moves before a leader's targets; then the policy
    sizes the pool from them (clamped to max_workers, down only after the cooldown); an older leader's targets
    are ignored, and without new ones the node keeps its allocation."""
    import asyncio
    import secrets

    from msdata_server.autoscale import Autoscaler
    from msdata_server.config import AutoscaleConfig
    from msdata_server.ops.scaletable import autoscale_table
    from msdata_server.pool import WorkerPool

    from .aio import run

    async def main():
        cfg = AutoscaleConfig(min_workers=1, max_workers=3, interval=1.0, cooldown=5.0, headroom=0.25)
        async with WorkerPool(1, shm_prefix="msdac" + secrets.token_hex(3)) as pool:
            sc = Autoscaler(pool, cfg, lambda: [], cluster=True)
            assert sc.step(0.0) is None
            assert not sc.acting
            assert pool.size == 1
            sc.follow(_frame(4, a=0.1, b=1.9))
            dec = sc.step(1.0, why="targets")
            assert sc.acting
            assert dec is not None
            assert dec.size_to == 3
            await sc.apply(dec)
            sc.follow(_frame(4, a=0.1, b=9.0))
            assert sc.step(2.0) is None
            assert pool.size == 3
            sc.follow(_frame(3, a=0.1, b=0.1))  # a deposed leader: ignored
            assert sc.leader is not None
            assert sc.leader.token == 4
            assert sc.step(3.0) is None
            sc.follow(_frame(5, a=0.1, b=0.3))  # the new leader: less demand, but the cooldown holds
            held = sc.step(4.0)  # the sources' shares are redrawn, the size stays
            assert held is not None
            assert held.size_to == 3
            assert held.workers_to == {"a": 1, "b": 2}
            down = [sc.step(t) for t in (6.0, 8.0, 10.0, 12.0)]
            dec = next(d for d in down if d is not None)
            assert dec.size_to == 1
            assert "suffice" in dec.reason
            await sc.apply(dec)
            assert [sc.step(t) for t in (14.0, 16.0)] == [None, None]
            assert pool.size == 1
            st = sc.status()
            assert st["acting"]
            assert st["leader_token"] == 5
            assert st["sources"]["b"]["target"]["workers"] == 0.3
            assert "following the leader's targets (token 5)" in autoscale_table(st)[0]
            await asyncio.sleep(0)

    run(main())


# ---- three node servers on etcd --------------------------------------------------------------------------------
def _job():
    g = burner_graph("ascl", seed=5, ms={"a": 0.05, "b": 0.5}, samples=600)
    g.mix({"a": 0.5, "b": 0.5}).pack(512, rows=1, micro_batches=2).mesh(dp=NODES).prefetch(2)
    return g.plan()


def _targets(st: dict) -> dict:
    return {n: s.get("target") for n, s in st["autoscale"]["sources"].items()}


def test_three_nodes_follow_the_leaders_targets_and_batches_equal_autoscaling_off(etcd_server, cluster_factory):
    spec = _job()
    n, before = 10 * spec.micro_batches, 5 * spec.micro_batches

    on = autoscale_cluster(cluster_factory, etcd_server.url, True)
    leader, token = wait_for(lambda: on.settled(set(on.nodes)), 30, "one leader that every node agrees on")
    got, errs, go, threads = node_ranks(on, spec, n, before)
    at_pause(got, errs, before)

    def following():
        sts = on.statuses()
        ok = len(sts) == NODES and all(
            st["autoscale"]["acting"] and all(t is not None for t in _targets(st).values()) and len(_targets(st)) == 2
            for st in sts.values()
        )
        return sts if ok else None

    sts = wait_for(following, 60, "every node to follow the leader's targets for both sources")
    for nid, st in sts.items():
        a = st["autoscale"]
        assert a["leader_token"] == token
        for name, s in a["sources"].items():
            assert s["target"]["token"] == token, (nid, name, s)
            assert s["target"]["samples_s"] > 0, (nid, name, s)
            assert math.isclose(s["demand_samples_s"], s["target"]["samples_s"], abs_tol=1e-3)  # the leader's
        assert 1 <= a["size"] <= 2
    lead = on.nodes[leader]
    assert "autoscale: leader (token" in lead.log()
    assert "first targets from this leader" in lead.log()

    # a targets frame with a stale token (an older leader's) is dropped by the node's fence: nothing changes
    victim = next(nid for nid in sorted(on.nodes) if nid != leader)
    bogus = {"t": "scale", "token": token - 1, "hold": False, "sources": {"zz": {"samples_s": 99.0, "workers": 2.0}}}
    send_peer_frame(on.nodes[victim], on.token_file.read_text().strip(), bogus)
    wait_for(lambda: "dropped 'scale' from tester" in on.nodes[victim].log(), 30, "the node to drop the stale targets")
    st = on.statuses()[victim]
    assert "zz" not in st["autoscale"]["sources"]
    assert st["autoscale"]["leader_token"] == token

    go.set()
    for t in threads:
        t.join(120)
        assert not t.is_alive(), "a rank hung"
    assert not errs, errs
    assert "placed by measured cost" not in lead.log()  # nothing was measured when the first run started

    # a second run of the job: its partitions are placed by measured cost x share; the data is the same
    again, errs, go, threads = node_ranks(on, spec, n, n)
    for t in threads:
        t.join(120)
        assert not t.is_alive(), "a rank of the second run hung"
    assert not errs, errs
    assert f"job {spec.name}: partitions placed by measured cost x share" in lead.log()
    assert again == got, "the second run (placed by measured cost) got other batches"
    on.stop()

    off = autoscale_cluster(cluster_factory, etcd_server.url, False)
    wait_for(lambda: off.settled(set(off.nodes)), 30, "one leader that every node agrees on")
    got_off, errs, go, threads = node_ranks(off, spec, n, n)
    for t in threads:
        t.join(120)
        assert not t.is_alive(), "a rank hung"
    assert not errs, errs
    for r in range(NODES):
        assert got[r] == got_off[r], f"rank {r} got other batches with autoscaling on than off"
    assert all(not st["autoscale"]["acting"] for st in off.statuses().values())
