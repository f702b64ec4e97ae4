"""Source auto-partitioning in a cluster, the pure part: the leader's decision (the one-node Partitioner rule over
the cluster-wide read need), the placement of new partitions (measured cost over each node's worker budget),
the partition table that plans carry (generations appended at the planner's cursor, so nothing counted moves),
and the layout every node derives from it. The three-node test is in test_autoscale_cluster_split.py."""

from __future__ import annotations

import itertools
import math

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from msdata_server.autoscale.cluster import MAX_PARTITIONS, RunView, Scaler, Split
from msdata_server.autoscale.policy import Partitioner, PolicyConfig, read_needs
from msdata_server.autoscale.profile import Counters, SourceProfile
from msdata_server.cluster.parts import Gen, PartsTable, RunParts, longest
from msdata_server.cluster.placement import PartitionLayout, place_split
from msdata_server.cluster.shardmeta import BLOCK
from msdata_server.errors import ConfigError
from msdata_server.planner.mixture import Mixture

from .autoscale_util import demand


# ---- the table ----------------------------------------------------------------------------------------------
def test_a_split_deals_the_blocks_past_its_start_and_leaves_those_before_it():
    t = PartsTable.base(2, 3)
    assert [t.part(0, o) for o in (0, BLOCK, 2 * BLOCK, 3 * BLOCK)] == [0, 1, 2, 0]  # block b -> b % 3
    t2 = t.split(0, 10, 5, ["a", "b", "c", "d", "e"])
    assert t2 != t
    assert t.count(0) == 3
    assert t2.count(0) == 8
    assert t2.partitions(0) == 5
    assert list(t2.newest(0)) == [3, 4, 5, 6, 7]
    assert all(t2.part(0, b * BLOCK + 7) == t.part(0, b * BLOCK) for b in range(10))  # before block 10: as before
    assert [t2.part(0, b * BLOCK) for b in (10, 11, 14, 15)] == [3 + 0, 3 + 1, 3 + 4, 3 + 0]  # 10 % 5 = 0 ...
    assert t2.part(1, 20 * BLOCK) == t.part(1, 20 * BLOCK)  # the other source is untouched
    gen, k, end = t2.slot(0, 1)
    assert (gen.n, k, end) == (3, 1, 10)  # a first partition, ended at block 10
    gen, k, end = t2.slot(0, 6)
    assert (gen.start, gen.n, k, end, gen.owners) == (10, 5, 3, None, ("a", "b", "c", "d", "e"))
    t3 = t2.split(0, 12, 2, ["c", "a"])  # merged back: ids go on counting
    assert list(t3.newest(0)) == [8, 9]
    assert t3.part(0, 11 * BLOCK) == t2.part(0, 11 * BLOCK)
    assert t3.slot(0, 6)[2] == 12
    assert t3.ended
    assert not PartsTable.base(1, 2).ended
    with pytest.raises(KeyError, match="source 0 has no partition 10 \\(it has 10\\)"):
        t3.slot(0, 10)
    with pytest.raises(ValueError, match="must start past block 12, not at 12"):
        t3.split(0, 12, 2, ["a", "b"])
    with pytest.raises(ValueError, match="one owner each"):
        t3.split(0, 13, 2, ["a"])


def test_the_table_travels_whole_and_only_grows():
    base = PartsTable.base(2, 3)
    t = base.split(0, 4, 4, ["n0", "n1", "n2", "n0"]).split(1, 7, 2, ["n2", "n2"]).split(0, 9, 3, ["n1"] * 3)
    wire = t.wire()
    assert wire[1] == [[7, 2, ["n2", "n2"]]]
    assert len(wire[0]) == 2
    assert base.applied(wire) == t  # a node that had none of it
    assert t.applied(wire) == t
    assert t.applied(base.wire()) == t
    partial = base.split(0, 4, 4, ["n0", "n1", "n2", "n0"])
    assert partial.applied(wire) == t  # a node that had the first change gets the rest
    with pytest.raises(ValueError, match="generation 1 differs"):
        base.split(0, 5, 4, ["n0", "n1", "n2", "n0"]).applied(wire)
    with pytest.raises(ValueError, match="each of the 2 sources"):
        base.applied([[]])
    with pytest.raises(ValueError, match="is not \\[start block, n"):
        base.applied([[[4, 2, [1, 2]]], []])
    assert Gen(0, 3, 0) == base.gens[0][0]


def test_a_new_leader_resumes_with_the_table_that_went_furthest():
    """A leader that died may have sent a change to some nodes only: its successor takes the table with the most
    changes any node reports (they are prefixes of one history), so no node's counted references move."""
    base = PartsTable.base(2, 3)
    one = base.split(0, 4, 4, ["n0", "n1", "n2", "n0"])
    two = one.split(1, 6, 2, ["n1", "n2"])
    assert longest([one.wire(), None, two.wire(), base.wire()]) == two.wire()
    assert longest([None, None]) is None
    assert longest([]) is None
    assert base.applied(longest([base.wire(), one.wire()])) == one


def test_the_leader_starts_a_change_at_the_block_past_the_planners_cursor():
    rp = RunParts("j", ["a", "b"], PartsTable.base(2, 3))
    assert rp.at(0, [0, 0]) == [[], []]  # nothing asked: the base table
    rp.want(0, 5, ["n0", "n1", "n2", "n0", "n1"], "test")
    wire = rp.at(7, [10 * BLOCK + 3, 50])  # the cursor is inside block 10: the change starts at block 11
    assert wire == [[[11, 5, ["n0", "n1", "n2", "n0", "n1"]]], []]
    assert not rp.pending
    rp.want(0, 2, ["n2", "n2"], "test")
    assert rp.at(8, [10 * BLOCK + 9, 60])[0][-1][:2] == [12, 2]  # never at or before the last start
    rp.want(1, 3, ["n0", "n1", "n2"], "same as now")
    assert rp.at(9, [0, 0])[1] == []  # split and merged back before a step was planned: no change


@given(
    changes=st.lists(
        st.tuples(st.integers(0, 3 * BLOCK), st.integers(1, 6)),  # (cursor advance, new partition count)
        min_size=1,
        max_size=6,
    )
)
def test_nothing_a_plan_could_name_before_a_change_moves(changes):
    """The soundness rule: every ordinal below the planner's cursor when a change is made keeps its partition
    (and so its owner) in every later table; only ordinals at or past it may be read elsewhere."""
    nodes = ["n0", "n1", "n2"]
    rp = RunParts("j", ["a"], PartsTable.base(1, 3))
    cursor = 0
    seen: dict[int, int] = {}  # ordinal -> its partition when it was first below the cursor
    for advance, n in changes:
        cursor += advance
        table = rp.table
        for o in range(cursor):
            seen.setdefault(o, table.part(0, o))
        rp.want(0, n, [nodes[k % 3] for k in range(n)], "test")
        rp.at(0, [cursor])
        assert all(rp.table.part(0, o) == k for o, k in seen.items())


# ---- placement ------------------------------------------------------------------------------------------------
def test_new_partitions_go_to_the_nodes_with_spare_budget_first():
    # n0 reads a lot already; n2 has twice the workers of n1: n2 takes two (load over budget 0.75, then 1.0),
    # n1 the third (1.0, a tie with n2 broken by the lesser load); n0 (1.75) none
    load = {"n0": 3.0, "n1": 0.5, "n2": 0.5}
    budget = {"n0": 2.0, "n1": 1.0, "n2": 2.0}
    assert place_split(3, 0.5, load, budget) == ["n2", "n2", "n1"]
    assert place_split(2, 1.0, {"n0": 0.0, "n1": 0.0}, {}) == ["n0", "n1"]  # ties: by id
    assert place_split(4, 0.0, {"n1": 0.0, "n0": 0.0}, {}) == ["n0", "n0", "n0", "n0"]  # no cost known: stable
    with pytest.raises(ConfigError, match="no members"):
        place_split(1, 1.0, {}, {})
    with pytest.raises(ConfigError, match="n >= 1"):
        place_split(0, 1.0, {"n0": 0.0}, {})


def test_every_node_derives_the_same_layout_and_a_gone_owner_fails_over():
    live = ["n0", "n1", "n2"]
    lay = PartitionLayout("j", 2, 3, 0, [1.0, 1.0], lambda: list(live), "n0")
    first = lay.placement()
    lay.table = lay.table.split(1, 5, 4, ["n2", "n2", "n1", "n0"])
    rows = lay.placement()
    assert rows[0] == first[0]
    assert rows[1][:3] == first[1]
    assert rows[1][3:] == ["n2", "n2", "n1", "n0"]
    live.remove("n2")  # n2's partitions of the new generation go where fail_over puts them; others stay
    after = lay.placement()
    assert "n2" not in after[1]
    assert after[1][5:] == ["n1", "n0"]
    shadowed = PartitionLayout("j", 2, 3, 1, [1.0, 1.0], lambda: ["n0", "n1", "n2"], "n0")
    shadowed.table = shadowed.table.split(0, 2, 2, ["n1", "n1"])
    owners, standbys = shadowed.layout()
    assert len(owners[0]) == len(standbys[0]) == 5
    assert standbys[0][3:] == [(), ()]


# ---- the decision ---------------------------------------------------------------------------------------------
def _view(owners: dict[str, list[str]], *, run_id="r1", base=3, step=0) -> RunView:
    return RunView(
        name="j",
        mixture=Mixture.constant({"a": 0.5, "b": 0.5}),
        sources=("a", "b"),
        planned_step=step,
        tokens_per_step=1000,
        owners=owners,
        run_id=run_id,
        base=base,
        costs={"a": 0.5 / 3, "b": 0.5 / 3},
    )


def _reports(read_b: float, rate: float = 10.0, max_workers=(2, 2, 4)) -> dict:
    """Three nodes; 10 steps/s x 1000 tokens x 0.5 share / 100 tokens per sample = 50 samples/s per source."""
    return {
        f"n{i}": {
            "enabled": True,
            "max_workers": mw,
            "sources": {
                "a": {"worker_s_per_sample": 0.001, "tokens_per_sample": 100.0, "read_s_per_sample": 1e-4},
                "b": {"worker_s_per_sample": 0.004, "tokens_per_sample": 100.0, "read_s_per_sample": read_b},
            },
            "rates": {"j": rate},
        }
        for i, mw in enumerate(max_workers)
    }


BASE = {"a": ["n0", "n1", "n2"], "b": ["n1", "n2", "n0"]}


def test_the_leader_splits_a_source_whose_reading_outgrows_its_partitions_and_merges_it_back():
    sc = Scaler(headroom=0.25, cooldown_s=2.0)
    assert sc.repartition([_view(BASE)], _reports(read_b=0.01), now=0.0, lead_s=0.3) == []  # 0.5 readers: 3 do
    got = sc.repartition([_view(BASE)], _reports(read_b=0.1), now=1.0, lead_s=0.3)  # 50/s x 0.1 s = 5 readers
    assert len(got) == 1
    sp = got[0]
    assert isinstance(sp, Split)
    assert (sp.run_id, sp.source, sp.n_from, sp.n_to) == ("r1", "b", 3, 7)
    assert "50.0 samples/s" in sp.reason
    assert "read need 5.00 readers" in sp.reason
    # placed by measured cost x share: b's tokens cost 4x a's; the load leaves b's own current partitions out
    assert math.isclose(sp.cost / (0.5 / 3 * 0.004 / 100), 3 / 7, rel_tol=1e-6)
    assert set(sp.load) == {"n0", "n1", "n2"}
    assert all(math.isclose(v, 0.5 / 3 * 0.001 / 100) for v in sp.load.values())
    assert sp.budget == {"n0": 2.0, "n1": 2.0, "n2": 4.0}
    owners = place_split(sp.n_to, sp.cost, sp.load, sp.budget)
    assert owners == ["n2", "n2", "n0", "n1", "n2", "n2", "n0"]  # n2 has twice the workers: twice the partitions
    split = {"a": BASE["a"], "b": owners}
    # the demand falls: no merge before the cooldown, then back down, never below the run's first count
    low = [sc.repartition([_view(split)], _reports(read_b=1e-4), now=t, lead_s=0.3) for t in (1.5, 2.5, 3.4)]
    assert low == [[], [], []]
    back = sc.repartition([_view(split)], _reports(read_b=1e-4), now=4.0, lead_s=0.3)
    assert [(s.source, s.n_from, s.n_to) for s in back] == [("b", 7, 3)]
    assert "suffice" in back[0].reason
    assert sc.repartition([_view(BASE)], _reports(read_b=0.0), now=20.0, lead_s=0.3) == []  # 3 is the floor
    assert sc.repartition([_view(BASE)], _reports(read_b=10.0), now=30.0, lead_s=0.3)[0].n_to == MAX_PARTITIONS


def test_the_leader_applies_the_one_node_rule_and_holds_while_unmeasured():
    """The same Partitioner as one node, fed the cluster-wide read need: the same decisions (one copy of the
    rule); noise around a threshold does not flap; nothing goes down while a rank's pace is unmeasured."""
    need = read_needs({"a": demand("a", 1.0), "b": demand("b", 1.0)}, lambda n: 0.002 if n == "a" else None)
    assert need == {"a": 2.0, "b": 0.0}  # 1000 samples/s x 2 ms: two readers busy; unmeasured: none
    rng = np.random.default_rng(3)
    sc = Scaler(headroom=0.25, cooldown_s=1.0)
    one = Partitioner(PolicyConfig(min_workers=3, max_workers=MAX_PARTITIONS, headroom=0.25, cooldown_s=1.0))
    counts = []
    for i in range(300):
        read_b = 0.064 * (1 + rng.uniform(-0.1, 0.1))  # 3.2 readers x 1.25 = 4: around the threshold
        got = sc.repartition([_view(BASE)], _reports(read_b=read_b), now=i * 0.1, lead_s=0.3)
        want = one.decide(i * 0.1, {"a": 50.0 * 1e-4, "b": 50.0 * read_b}, current={"a": 3, "b": 3})
        assert [(s.source, s.n_from, s.n_to) for s in got] == [(n, a, b) for n, (a, b, _) in sorted(want.items())]
        counts.append(one.partitions("b"))
    assert sum(a != b for a, b in itertools.pairwise(counts)) <= 1
    assert counts[-1] in (4, 5)
    held = Scaler(cooldown_s=0.0)
    held.repartition([_view(BASE)], _reports(read_b=0.1), now=0.0, lead_s=0.3)
    assert held.repartition([_view(BASE)], _reports(read_b=0.0, rate=0.0), now=50.0, lead_s=0.3) == []  # no pace
    off = {n: {**r, "enabled": False} for n, r in _reports(read_b=1.0).items()}
    assert held.repartition([_view(BASE)], off, now=60.0, lead_s=0.3) == []  # autoscaling off: never
    held.repartition([], _reports(read_b=0.1), now=70.0, lead_s=0.3)
    assert held.parts == {}  # a run that ended is forgotten


def test_the_leaders_choice_places_by_measured_cost_across_runs():
    """Two runs: a new partition avoids the node that reads the other run's costly partitions."""
    sc = Scaler(cooldown_s=1.0)
    other = RunView(
        name="k",
        mixture=Mixture.constant({"c": 1.0}),
        sources=("c",),
        planned_step=0,
        tokens_per_step=1000,
        owners={"c": ["n0", "n0", "n0"]},
        run_id="r2",
        base=3,
        costs={"c": 1.0},
    )
    got = sc.repartition([_view(BASE), other], _reports(read_b=0.1), now=0.0, lead_s=0.3)
    sp = next(s for s in got if s.run_id == "r1")
    assert sp.load["n0"] > 100 * sp.load["n1"]  # the other run's partitions on n0 (its own cost: unmeasured)
    assert "n0" not in place_split(sp.n_to, sp.cost, sp.load, sp.budget)


def test_a_partition_closed_after_a_split_never_makes_the_read_time_negative():
    """A node's counters sum its open loaders; one that closes (drained after a split or merge) takes its read
    seconds away while new loaders add samples: that interval restarts the baseline (it measured nothing)."""
    prof = SourceProfile(tau=1.0)
    prof.observe(0.0, Counters(samples_read=1000, read_s=2.0))
    prof.observe(1.0, Counters(samples_read=2000, read_s=4.0))
    prof.observe(2.0, Counters(samples_read=2100, read_s=0.5))  # a loader with 3.7 s of reading closed
    prof.observe(3.0, Counters(samples_read=3100, read_s=2.5))
    assert math.isclose(prof.figures().read_s_per_sample, 0.002)


def test_an_ended_generations_loader_drops_what_it_read_past_its_end():
    """A node applying a split stops the old loaders at the new generation's first block: what they read ahead
    there is dropped (the new partitions read it), and a sample there asked for anyway is still served."""
    import asyncio

    import msdata_client as msd
    from msdata_server.loader import SourceLoader
    from msdata_server.sources import open_source

    from .aio import run

    g = msd.DGraph("drop", seed=1)
    g.source("a", "synthetic", samples=2000, median=20.0, sigma=0.3, min_len=4, max_len=64)
    g.mix({"a": 1.0}).pack(256, rows=1, micro_batches=1).mesh(dp=1)
    spec = g.plan()

    async def main():
        src = await asyncio.to_thread(open_source, spec.sources[0], seed=spec.seed)
        ld = SourceLoader(src, None, transform=None, seed=spec.seed, batch=8, readahead=64)
        try:
            want = await ld.tokens(3 * 8 + 1)  # batch 3; the read-ahead goes on to batches 4..11
            await ld.wait_idle()
            assert ld.statistics().ready >= 9 * 8
            ld.stop_at(5)
            st = ld.statistics()
            assert st.ready == 5 * 8
            assert ld.frontier() >= 5
            assert np.array_equal(await ld.tokens(3 * 8 + 1), want)
            assert len(await ld.tokens(7 * 8)) > 0
            assert ld.statistics().ready == 5 * 8
        finally:
            await ld.aclose()
            src.close()

    run(main())


def test_parts_module_all_sorted_and_torch_free():
    import subprocess
    import sys
    from pathlib import Path

    code = (
        "import sys, msdata_server.cluster.parts as m; names = list(m.__all__); assert names == sorted(names), names; "
        "assert all(hasattr(m, n) for n in names); assert 'torch' not in sys.modules, 'torch was imported'"
    )
    subprocess.run([sys.executable, "-c", code], check=True, cwd=str(Path(__file__).resolve().parents[1]))
