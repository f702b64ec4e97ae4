"""ClientPlaceTree: rank <-> coordinate layout, data streams, readers and per-stage fields."""

import itertools

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import msdata_client.mesh as mesh_mod
from msdata_client.errors import ConfigError
from msdata_client.mesh import AXES, ClientPlaceTree, Coord

ALL_FIELDS = (
    "tokens",
    "labels",
    "loss_mask",
    "position_ids",
    "cu_seqlens",
    "sample_ids",
    "source_ids",
    "doc_counts",
    "step",
    "micro",
)


def test_all_is_sorted_and_importable():
    assert list(mesh_mod.__all__) == sorted(mesh_mod.__all__)
    for name in mesh_mod.__all__:
        assert hasattr(mesh_mod, name), name


# -- validation ---------------------------------------------------------------------------------------


@pytest.mark.parametrize("axis", AXES)
@pytest.mark.parametrize("bad", [0, -1, 1.5, True, "2", None])
def test_bad_axis_size(axis, bad):
    with pytest.raises(ConfigError, match=rf"mesh {axis}={bad!r} must be an integer >= 1"):
        ClientPlaceTree(**{axis: bad})


@pytest.mark.parametrize(
    "order",
    [
        ("pp", "dp", "cp"),
        ("pp", "dp", "cp", "tp", "tp"),
        ("pp", "dp", "dp", "tp"),
        ("pp", "dp", "cp", "ep"),
        (1, 2, 3, 4),
    ],
)
def test_bad_order(order):
    with pytest.raises(ConfigError, match=r"must name each of \['pp', 'dp', 'cp', 'tp'\] exactly once"):
        ClientPlaceTree(order=order)


def test_order_must_be_a_sequence():
    with pytest.raises(ConfigError, match=r"mesh order='pp,dp,cp,tp' must be a list of axis names"):
        ClientPlaceTree(order="pp,dp,cp,tp")


def test_order_list_becomes_tuple_and_mesh_is_hashable():
    m = ClientPlaceTree(dp=2, order=["tp", "cp", "dp", "pp"])
    assert m.order == ("tp", "cp", "dp", "pp")
    assert hash(m) == hash(ClientPlaceTree(dp=2, order=("tp", "cp", "dp", "pp")))


@pytest.mark.parametrize("rank", [-1, 8, 100, 1.0, True])
def test_rank_out_of_range(rank):
    m = ClientPlaceTree(dp=2, tp=4)
    with pytest.raises(ConfigError, match=rf"rank={rank!r} is outside the mesh of world_size=8"):
        m.coord(rank)


def test_coord_out_of_range():
    m = ClientPlaceTree(dp=2, tp=2)
    with pytest.raises(ConfigError, match=r"coord tp=2 is outside the mesh \(tp=2\); use 0..1"):
        m.rank(Coord(pp=0, dp=0, cp=0, tp=2))
    with pytest.raises(ConfigError, match=r"must be a Coord"):
        m.rank((0, 0, 0, 0))


# -- layout -------------------------------------------------------------------------------------------


def test_megatron_layout_tp_fastest():
    m = ClientPlaceTree(dp=2, tp=2, order=("pp", "dp", "cp", "tp"))
    assert m.world_size == 4
    assert m.coord(0) == Coord(pp=0, dp=0, cp=0, tp=0)
    assert m.coord(1) == Coord(pp=0, dp=0, cp=0, tp=1)
    assert m.coord(2) == Coord(pp=0, dp=1, cp=0, tp=0)
    # ranks 0 and 1 are TP peers of DP rank 0
    assert m.group(0) == m.group(1) == 0
    assert m.group(2) == m.group(3) == 1


def test_other_orders():
    m = ClientPlaceTree(dp=2, pp=3, tp=2, order=("tp", "cp", "dp", "pp"))
    assert m.coord(1) == Coord(pp=1, dp=0, cp=0, tp=0)  # pp varies fastest
    assert m.coord(3) == Coord(pp=0, dp=1, cp=0, tp=0)
    assert m.coord(6) == Coord(pp=0, dp=0, cp=0, tp=1)
    m = ClientPlaceTree(dp=4, pp=2, cp=2, tp=2, order=("dp", "pp", "cp", "tp"))
    assert m.coord(8) == Coord(pp=0, dp=1, cp=0, tp=0)
    assert m.coord(31) == Coord(pp=1, dp=3, cp=1, tp=1)


@pytest.mark.parametrize("order", list(itertools.permutations(AXES)))
def test_bijection_every_order(order):
    m = ClientPlaceTree(dp=3, pp=2, cp=2, tp=2, order=order)
    coords = [m.coord(r) for r in range(m.world_size)]
    assert len(set(coords)) == m.world_size == 24
    assert [m.rank(c) for c in coords] == list(range(m.world_size))
    # the last axis of `order` varies fastest
    last = order[-1]
    assert getattr(m.coord(1), last) == 1


@settings(max_examples=60, deadline=None)
@given(sizes=st.tuples(*(st.integers(1, 4) for _ in AXES)), order=st.permutations(AXES))
def test_bijection_property(sizes, order):
    m = ClientPlaceTree(**dict(zip(AXES, sizes, strict=True)), order=tuple(order))
    seen = set()
    for r in range(m.world_size):
        c = m.coord(r)
        assert m.rank(c) == r
        seen.add(c)
    assert len(seen) == m.world_size
    # readers of the dp streams partition the ranks
    groups = [m.readers(g) for g in range(m.data_groups())]
    assert sorted(r for g in groups for r in g) == list(range(m.world_size))
    for g, readers in enumerate(groups):
        assert all(m.group_of(r) == g for r in readers)
        assert list(readers) == sorted(readers)


# -- data streams -------------------------------------------------------------------------------------


def test_data_groups():
    m = ClientPlaceTree(dp=4, pp=2, cp=2, tp=2)
    assert m.data_groups() == m.data_groups("dp") == 4
    assert m.data_groups("cp") == 4
    assert m.data_groups("world") == 32


def test_readers_dp():
    m = ClientPlaceTree(dp=2, tp=2)
    assert m.readers(0) == (0, 1)
    assert m.readers(1) == (2, 3)
    # dp fastest: TP peers are far apart
    m = ClientPlaceTree(dp=2, tp=2, order=("pp", "tp", "cp", "dp"))
    assert m.readers(0) == (0, 2)
    assert m.group_of(1) == 1


def test_readers_cp_share_one_stream():
    m = ClientPlaceTree(dp=2, cp=2, tp=2)
    assert m.readers(0, "cp") == (0, 1, 2, 3)
    assert m.group_of(3, "cp") == 0
    assert m.group_of(4, "cp") == 1


def test_readers_world():
    m = ClientPlaceTree(dp=2, tp=2)
    assert [m.group_of(r, "world") for r in range(4)] == [0, 1, 2, 3]
    assert [m.readers(g, "world") for g in range(4)] == [(0,), (1,), (2,), (3,)]


def test_readers_bad_group_and_distribute():
    m = ClientPlaceTree(dp=2)
    with pytest.raises(ConfigError, match=r"group=2 is outside 0..1"):
        m.readers(2)
    with pytest.raises(ConfigError, match=r"distribute='tp' is not one of \('dp', 'cp', 'world'\)"):
        m.group_of(0, "tp")
    with pytest.raises(ConfigError, match=r"distribute='pp' is not one of"):
        m.data_groups("pp")


# -- fields -------------------------------------------------------------------------------------------


def test_fields_pp1_all():
    m = ClientPlaceTree(dp=2, tp=2)
    assert all(m.fields(r, ALL_FIELDS) == ALL_FIELDS for r in range(4))


def test_fields_pp2():
    m = ClientPlaceTree(pp=2, dp=2)  # order pp, dp, ...: ranks 0-1 first stage, 2-3 last stage
    assert m.stage(0) == "first"
    assert m.stage(3) == "last"
    assert m.fields(0, ALL_FIELDS) == (
        "tokens",
        "position_ids",
        "cu_seqlens",
        "sample_ids",
        "source_ids",
        "doc_counts",
        "step",
        "micro",
    )
    assert m.fields(2, ALL_FIELDS) == (
        "labels",
        "loss_mask",
        "position_ids",
        "cu_seqlens",
        "sample_ids",
        "source_ids",
        "doc_counts",
        "step",
        "micro",
    )


def test_fields_pp3_middle():
    m = ClientPlaceTree(pp=3)
    assert [m.stage(r) for r in range(3)] == ["first", "middle", "last"]
    assert m.fields(1, ALL_FIELDS) == ("position_ids", "cu_seqlens", "doc_counts", "step", "micro")
    assert "tokens" in m.fields(0, ALL_FIELDS)
    assert "labels" not in m.fields(0, ALL_FIELDS)
    assert "labels" in m.fields(2, ALL_FIELDS)
    assert "tokens" not in m.fields(2, ALL_FIELDS)


def test_fields_other_modality_goes_to_first_stage():
    m = ClientPlaceTree(pp=3)
    fields = (*ALL_FIELDS, "patches")
    assert "patches" in m.fields(0, fields)
    assert "patches" not in m.fields(1, fields)
    assert "patches" not in m.fields(2, fields)


def test_fields_override():
    m = ClientPlaceTree(pp=3)
    over = {"middle": ["cu_seqlens", "tokens"], "last": ["labels"]}
    assert m.fields(1, ALL_FIELDS, over) == ("tokens", "cu_seqlens")  # order of all_fields
    assert m.fields(2, ALL_FIELDS, over) == ("labels",)
    assert m.fields(0, ALL_FIELDS, over) == m.fields(0, ALL_FIELDS)  # first stage keeps its default


def test_fields_rejects_a_string():
    with pytest.raises(ConfigError, match=r"all_fields='tokens' must be a sequence"):
        ClientPlaceTree().fields(0, "tokens")


# -- serialisation ------------------------------------------------------------------------------------


def test_dict_round_trip():
    m = ClientPlaceTree(dp=4, pp=2, cp=2, tp=2, order=("dp", "pp", "cp", "tp"))
    d = m.to_dict()
    assert d == {"dp": 4, "pp": 2, "cp": 2, "tp": 2, "order": ["dp", "pp", "cp", "tp"]}
    assert ClientPlaceTree.from_dict(d) == m
    assert ClientPlaceTree.from_dict({}) == ClientPlaceTree()


def test_from_dict_strict():
    with pytest.raises(ConfigError, match=r"unknown key 'ep' in table \[mesh\]; allowed keys: pp, dp, cp, tp, order"):
        ClientPlaceTree.from_dict({"dp": 2, "ep": 2})
    with pytest.raises(ConfigError, match=r"\[mesh\] must be a table"):
        ClientPlaceTree.from_dict([("dp", 2)])
