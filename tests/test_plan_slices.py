"""Per-node plan slices (issue 29): each node decodes exactly the pieces it builds or reads, with the step's
figures; the leader's bytes stay near one plan's whatever the node count."""

import numpy as np
import orjson
import pytest

from msdata_server.cluster.leader.slices import PlanSlicer, partitions_of
from msdata_server.cluster.parts import PartsTable
from msdata_server.cluster.placement import PartitionLayout, partition_costs
from msdata_server.cluster.planwire import Cut, decode_plan, encode_plan, encode_slices, plan_state
from msdata_server.planner import Mixture, Planner, PlannerConfig

SOURCES = ("a", "b", "c")


class _View:
    def lengths(self, source, start, count):
        rng = np.random.default_rng(source * 1000003 + start)
        return rng.integers(4, 600, count).astype(np.int64)


def _plan(dp, steps=2):
    p = Planner(
        PlannerConfig(
            sources=SOURCES, seq_len=512, dp=dp, micro_batches=2, mixture=Mixture.constant(dict.fromkeys(SOURCES, 1.0))
        )
    )
    return [p.plan_step(_View()) for _ in range(steps)][-1]


def _layout(nodes, n_shadows=0, table=None):
    from msdata_client.spec import MixSpec

    costs = partition_costs(MixSpec(weights=dict.fromkeys(SOURCES, 1.0)), list(SOURCES), len(nodes))
    lay = PartitionLayout("j", len(SOURCES), len(nodes), n_shadows, costs, lambda: list(nodes), nodes[0])
    if table is not None:
        lay.table = table
    return lay


def _slices(plan, nodes, rank_nodes, layout, table):
    cuts = PlanSlicer(lambda r: r, lambda g: (g,)).cuts(
        plan.source, plan.ordinal, plan.group, dp=len(plan.stats.cost), nodes=nodes, rank_nodes=rank_nodes,
        layout=layout, table=table,
    )  # fmt: skip
    frames = encode_slices(plan, cuts, job="j", digest="d" * 64, token=3, state={"step": 5, "cursor": [1, 2, 3]})
    return {n: (h, b, decode_plan(orjson.loads(orjson.dumps(h)), memoryview(b))) for n, (h, b) in frames.items()}


def test_partitions_of_matches_the_table_also_after_splits():
    table = PartsTable.base(3, 4).split(1, 5, 3, ["x", "y", "z"]).split(1, 9, 2, ["x", "y"])
    rng = np.random.default_rng(0)
    src = rng.integers(0, 3, 2000)
    ords = rng.integers(0, 64 * 20, 2000)
    want = [table.part(int(s), int(o)) for s, o in zip(src, ords)]
    assert partitions_of(table, src, ords).tolist() == want


@pytest.mark.parametrize("n_shadows", [0, 1])
def test_each_node_gets_its_groups_and_its_partitions_pieces(n_shadows):
    dp, nodes = 8, ["n0", "n1", "n2", "n3"]
    plan = _plan(dp)
    rank_nodes = {r: nodes[r // 2] for r in range(dp)}  # two groups per node
    table = PartsTable.base(len(SOURCES), len(nodes))
    layout = _layout(nodes, n_shadows, table)
    got = _slices(plan, nodes, rank_nodes, layout, table)
    pl, sh = layout.layout()
    part = partitions_of(table, plan.source, plan.ordinal)
    for i, nid in enumerate(nodes):
        sl = got[nid][2]
        for g in (2 * i, 2 * i + 1):  # the micro-batches it builds: exactly the full plan's
            for m in range(2):
                a, b = plan.micro_batch(g, m), sl.micro_batch(g, m)
                for f in ("source", "ordinal", "offset", "length", "row", "last"):
                    assert np.array_equal(getattr(a, f), getattr(b, f)), (nid, g, m, f)
        cols = ("source", "ordinal", "group", "last")  # what counting references reads
        mine = {
            tuple(int(getattr(plan, f)[i]) for f in cols)
            for i, (s, k) in enumerate(zip(plan.source, part))
            if pl[s][k] == nid or nid in sh[s][k]
        }
        have = set(zip(*(getattr(sl, f).tolist() for f in cols)))
        assert mine <= have  # every piece of its partitions (owned or stood by for) to count
        assert plan_state(*got[nid][:2]) == {"step": 5, "cursor": [1, 2, 3]}
        assert sl.stats.imbalance == plan.stats.imbalance
        assert sl.stats.tokens == plan.stats.tokens
        assert sl.stats.to_dict()["max_cost"] == pytest.approx(plan.stats.to_dict()["max_cost"])
        assert sl.stats.to_dict()["mean_cost"] == pytest.approx(plan.stats.to_dict()["mean_cost"])
        assert np.array_equal(sl.stats.micro_cost[2 * i], plan.stats.micro_cost[2 * i])
    # every piece reaches its builder; nobody gets much more than its share
    total = sum(len(h[1]) for h in got.values())
    _, whole = encode_plan(plan, job="j", digest="d" * 64, token=3)
    assert total <= (2 + n_shadows) * len(whole)


def test_a_new_generation_goes_to_its_named_owner_before_the_layout_has_it():
    dp, nodes = 16, ["n0", "n1"]
    plan = _plan(dp, steps=6)
    rank_nodes = dict.fromkeys(range(dp), "n0")  # every group built on n0
    base = PartsTable.base(len(SOURCES), 2)
    table = base.split(0, 1, 1, ["n1"])  # source a from block 1 on: one partition, on n1
    got = _slices(plan, nodes, rank_nodes, _layout(nodes, 0, base), table)
    sl = got["n1"][2]
    late = (plan.source == 0) & (plan.ordinal >= 64)
    assert late.any()
    have = set(zip(sl.source.tolist(), sl.ordinal.tolist()))
    assert set(zip(plan.source[late].tolist(), plan.ordinal[late].tolist())) <= have


def test_leader_bytes_stay_near_one_plan_as_nodes_grow():
    dp = 64
    plan = _plan(dp)
    _, whole = encode_plan(plan, job="j", digest="d" * 64, token=3)
    for n in (4, 16, 32):
        nodes = [f"n{i:02d}" for i in range(n)]
        rank_nodes = {r: nodes[r * n // dp] for r in range(dp)}
        table = PartsTable.base(len(SOURCES), n)
        got = _slices(plan, nodes, rank_nodes, _layout(nodes, 0, table), table)
        sent = sum(len(b) for _, b, _ in got.values())
        assert sent <= 2.2 * len(whole), (n, sent, len(whole))
        if n >= 16:  # a node's slice is a fraction of the plan (it was the whole plan)
            assert max(len(b) for _, b, _ in got.values()) <= 0.7 * len(whole), n


def test_a_group_with_a_reader_nowhere_goes_to_every_node_whole():
    """A rank not registered anywhere (its node server restarted; a new leader has not heard of it) may come
    back on any node, which then builds its group from the plans it holds (job.late): every node gets it."""
    dp, nodes = 8, ["n0", "n1", "n2", "n3"]
    plan = _plan(dp)
    rank_nodes = {r: nodes[r // 2] for r in range(dp) if r != 5}  # rank 5 (group 5) is nowhere yet
    table = PartsTable.base(len(SOURCES), len(nodes))
    got = _slices(plan, nodes, rank_nodes, _layout(nodes, 0, table), table)
    for nid in nodes:
        sl = got[nid][2]
        for m in range(2):
            a, b = plan.micro_batch(5, m), sl.micro_batch(5, m)
            for f in ("source", "ordinal", "offset", "length", "row", "last"):
                assert np.array_equal(getattr(a, f), getattr(b, f)), (nid, m, f)
    # once placed, only its node gets it
    got = _slices(plan, nodes, {r: nodes[r // 2] for r in range(dp)}, _layout(nodes, 0, table), table)
    assert 5 not in got["n0"][0]["groups"]
    assert 5 in got["n2"][0]["groups"]


def test_a_node_without_groups_or_pieces_gets_a_slice_that_decodes():
    """A node that builds no group (it only owns data) and whose partitions hold none of the step's pieces: an
    empty slice, with the step's figures and the state, beside the others' in the one buffer."""
    dp, nodes = 4, ["n0", "n1", "n2"]
    plan = _plan(dp)
    rank_nodes = {r: "n0" for r in range(dp)}
    table = PartsTable.base(len(SOURCES), len(nodes))
    cuts = PlanSlicer(lambda r: r, lambda g: (g,)).cuts(
        plan.source, plan.ordinal, plan.group, dp=dp, nodes=nodes, rank_nodes=rank_nodes,
        layout=_layout(nodes, 0, table), table=table,
    )  # fmt: skip
    cuts["n2"] = Cut(cuts["n2"].idx[:0], cuts["n2"].built[:0], [])
    frames = encode_slices(plan, cuts, job="j", digest="d" * 64, token=3, state={"step": 5})
    h, b = frames["n2"]
    sl = decode_plan(orjson.loads(orjson.dumps(h)), b)
    assert len(sl) == 0
    assert sl.stats.micro_cost.shape == (dp, 2)
    assert not sl.stats.micro_cost.any()
    assert sl.stats.imbalance == plan.stats.imbalance
    assert plan_state(h, b) == {"step": 5}
    whole = decode_plan(*frames["n0"])  # the builder of every group: its micro-batches are the plan's
    for g in range(dp):
        for m in range(2):
            assert np.array_equal(whole.micro_batch(g, m).ordinal, plan.micro_batch(g, m).ordinal)


def test_the_planner_state_travels_whole_its_long_integer_lists_as_arrays():
    """A real planner state (its carry's columns: a thousand entries at scale) and the edge cases of the
    compact form: short lists, negatives, values past int32, the int64 limits, bools, nested dicts and lists of
    other things stay as they were; a column whose place or bounds do not fit is a ProtocolError."""
    from msdata_server.errors import ProtocolError

    dp, nodes = 8, ["n0", "n1"]
    planner = Planner(
        PlannerConfig(
            sources=SOURCES, seq_len=512, dp=256, micro_batches=2, mixture=Mixture.constant(dict.fromkeys(SOURCES, 1.0))
        )
    )
    for _ in range(3):
        planner.plan_step(_View())
    real = planner.state_dict()
    odd = {
        "carry": {"a": list(range(-40, 40)), "big": [2**40 + i for i in range(20)], "short": [1, 2, 3]},
        "wide": {"x": [2**63 - 1] * 20, "y": [-(2**63)] * 20, "b": [True] * 20},
        "mixed": {"f": [0.5] * 20, "s": ["x"] * 20, "n": {"deep": list(range(30))}, "none": None},
        "list": list(range(100)),
        "step": 3,
    }
    plan = _plan(dp)
    table = PartsTable.base(len(SOURCES), len(nodes))
    cuts = PlanSlicer(lambda r: r, lambda g: (g,)).cuts(
        plan.source, plan.ordinal, plan.group, dp=dp, nodes=nodes, rank_nodes={r: nodes[r % 2] for r in range(dp)},
        layout=_layout(nodes, 0, table), table=table,
    )  # fmt: skip
    for state in (real, odd):
        frames = encode_slices(plan, cuts, job="j", digest="d" * 64, token=3, state=state)
        for h, b in frames.values():
            h = orjson.loads(orjson.dumps(h))
            got = plan_state(h, memoryview(b))
            assert got == state
            assert list(got) == list(state)
            assert all(list(got[k]) == list(v) for k, v in state.items() if isinstance(v, dict))
    assert len(real["carry"]["ordinal"]) >= 16  # the real carry's columns went as arrays
    h, b = encode_slices(plan, cuts, job="j", digest="d" * 64, token=3, state=real)["n1"]
    assert ["carry", "ordinal"] in [c[0] for c in h["state_cols"]]
    h, b = frames["n0"]
    assert {tuple(c[0]) for c in h["state_cols"]} == {("carry", "a"), ("carry", "big"), ("wide", "x"), ("wide", "y")}
    assert plan_state(h, b) == odd
    for bad in (
        {**h, "state_cols": [[["carry", "nowhere"], "<i8", 0, 8]]},
        {**h, "state_cols": [[["carry", "a"], "<i8", len(b) - 4, 8]]},
        {**h, "state_cols": [[["carry", "a"], "<f8", 0, 8]]},
        {**h, "state_rec": [0, len(b) + 1]},
    ):
        with pytest.raises(ProtocolError):
            plan_state(bad, b)


def test_cuts_name_each_piece_once_per_node_and_follow_the_rank_placement_as_it_changes():
    dp, nodes = 8, ["n0", "n1", "n2", "n3"]
    plan = _plan(dp)
    table = PartsTable.base(len(SOURCES), len(nodes))
    layout = _layout(nodes, 1, table)
    part = partitions_of(table, plan.source, plan.ordinal)
    pl, sh = layout.layout()
    slicer = PlanSlicer(lambda r: r, lambda g: (g,))
    rank_nodes = {r: nodes[r // 2] for r in range(dp)}
    for _ in range(2):  # the second time: the placement changed in place (the cached map must not be reused)
        cuts = slicer.cuts(
            plan.source, plan.ordinal, plan.group, dp=dp, nodes=nodes, rank_nodes=rank_nodes, layout=layout,
            table=table,
        )  # fmt: skip
        for nid, cut in cuts.items():
            builds = {g for g in range(dp) if rank_nodes[g] == nid}
            want = [
                i
                for i, (s, k, g) in enumerate(zip(plan.source, part, plan.group))
                if int(g) in builds or pl[s][k] == nid or nid in sh[s][k]
            ]
            assert cut.idx.tolist() == want  # ascending, each once (a node both builder and owner included)
            assert cut.built.tolist() == [int(plan.group[i]) in builds for i in want]
            assert cut.groups == sorted(builds)
        rank_nodes[0], rank_nodes[7] = rank_nodes[7], rank_nodes[0]
