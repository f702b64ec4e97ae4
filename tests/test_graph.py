"""DGraph / JobSpec: TOML <-> builder round trips, path resolution, digests and every validation error."""

import ast
import copy
import dataclasses
import pathlib
import tomllib

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import msdata_client.graph as graph_mod
from msdata_client.errors import ConfigError
from msdata_client.graph import BalanceSpec, DGraph, JobSpec, MixSpec, SourceSpec
from msdata_client.mesh import ClientPlaceTree, Coord

ROOT = pathlib.Path(__file__).resolve().parent.parent
EXAMPLES = ROOT / "examples"
BYTE_TOKENS = "msdata_server.transforms:byte_tokens"


def base_dict() -> dict:
    """A valid job in the TOML's shape, with absolute paths."""
    return {
        "job": {"name": "pretrain", "seed": 1234, "seq_len": 8192, "micro_batches": 4, "rows": 1},
        "mesh": {"dp": 4, "pp": 1, "cp": 1, "tp": 2, "order": ["pp", "dp", "cp", "tp"]},
        "source": [
            {"name": "web", "format": "parquet", "paths": ["/data/web/*.parquet"], "column": "text"},
            {"name": "code", "format": "jsonl", "paths": ["/data/code/"], "column": "content"},
            {"name": "syn", "format": "synthetic", "samples": 100, "median": 64.0},
        ],
        "mix": {"weights": {"web": 0.6, "code": 0.3, "syn": 0.1}},
        "balance": {"cost": "attention", "alpha": 1.0, "beta": 4096.0, "method": "karmarkar_karp"},
    }


def base_graph() -> DGraph:
    return (
        DGraph("pretrain", seed=1234)
        .source("web", "parquet", ["/data/web/*.parquet"])
        .source("code", "jsonl", "/data/code/", column="content")
        .source("syn", "synthetic", samples=100, median=64)
        .mix({"web": 0.6, "code": 0.3, "syn": 0.1})
        .pack(8192, micro_batches=4)
        .mesh(dp=4, tp=2)
    )


def test_all_is_sorted_and_importable():
    assert list(graph_mod.__all__) == sorted(graph_mod.__all__)
    for name in graph_mod.__all__:
        assert hasattr(graph_mod, name), name


@pytest.mark.parametrize("module", ["graph.py", "mesh.py"])
def test_imports_only_stdlib_numpy_orjson_and_client(module):
    tree = ast.parse((ROOT / "msdata_client" / module).read_text())
    names = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names.update(a.name.split(".")[0] for a in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module:
            names.add(node.module.split(".")[0])
    assert "torch" not in names
    assert "msdata_server" not in names
    assert names <= {"__future__", "msdata_client", "numpy", "orjson"} | set(__import__("sys").stdlib_module_names)


# -- builder and TOML ---------------------------------------------------------------------------------


def test_builder_equals_dict():
    assert base_graph().plan() == JobSpec.from_dict(base_dict())
    assert base_graph().spec == base_graph().plan()


def test_builder_defaults():
    spec = base_graph().plan()
    assert spec.source_names() == ("web", "code", "syn")
    assert spec.sources[0].transform == BYTE_TOKENS
    assert spec.sources[2].transform is None  # synthetic records are token ids already
    assert spec.balance == BalanceSpec()
    assert spec.broadcast_at == ("tp",)
    assert spec.mesh == ClientPlaceTree(dp=4, tp=2)
    assert spec.data_groups() == 4
    assert spec.readers(1) == (2, 3)
    assert spec.group_of(5) == 2


def test_spec_is_frozen_and_hashable():
    spec = base_graph().plan()
    with pytest.raises(dataclasses.FrozenInstanceError):
        spec.seq_len = 1  # type: ignore[misc]
    with pytest.raises(TypeError):
        spec.mix.weights["web"] = 1.0  # type: ignore[index]
    assert hash(spec) == hash(base_graph().plan())


def full_graph() -> DGraph:
    """Uses every option: schedule, pp_fields, broadcast, custom cost, odd names and strings."""
    return (
        DGraph("full-job.v2", seed=7)
        .source("web.en", "parquet", ["/d/we b/*.parquet", '/d/quo"te\\'], column='te"xt\n')
        .source("code", "arrow", "/d/code.arrow", transform="my.mod:tok_fn", max_sample_bytes=1024)
        .source("raw", "jsonl", "/d/raw.jsonl", transform=None)
        .source("syn", "synthetic", samples=5, median=3.5, sigma=0, min_len=2, max_len=2, transform="m:f")
        .mix(
            schedule=[
                (0, {"web.en": 1, "code": 0, "raw": 2, "syn": 1}),
                {"step": 50, "weights": {"web.en": 0.5, "code": 1.5, "raw": 0, "syn": 1e-5}},
            ],
            interpolate="linear",
        )
        .cost("pkg.costs:quadratic", alpha=0.5, beta=0)
        .balance("greedy")
        .pack(4096, rows=2, micro_batches=3, pad_id=0, long_docs="truncate")
        .distribute("cp")
        .broadcast_at("pp", "tp")
        .prefetch(4)
        .pp_fields(middle=["cu_seqlens"], last=["labels", "loss_mask"])
        .mesh(dp=2, pp=3, cp=2, tp=2, order=("dp", "pp", "cp", "tp"))
    )


@pytest.mark.parametrize("make", [base_graph, full_graph], ids=["base", "full"])
def test_toml_round_trip(tmp_path, make):
    g = make()
    text = g.to_toml()
    assert tomllib.loads(text) == g.to_dict()
    p = tmp_path / "job.toml"
    p.write_text(text, encoding="utf-8")
    back = DGraph.from_toml(p)
    assert back.spec == g.spec
    assert back.digest() == g.digest()
    assert back.to_toml() == text
    assert DGraph.from_dict(g.to_dict()).spec == g.spec


def test_full_graph_values():
    spec = full_graph().plan()
    assert spec.broadcast_at == ("tp", "pp")  # canonical order
    assert spec.sources[2].transform is None
    assert spec.sources[3].transform == "m:f"
    assert spec.sources[3].median == 3.5
    assert isinstance(spec.sources[3].sigma, float)
    assert spec.pp_fields == {"middle": ("cu_seqlens",), "last": ("labels", "loss_mask")}
    assert spec.data_groups() == 2
    # pp_fields overrides reach JobSpec.fields
    middle_rank = spec.mesh.rank(Coord(pp=1, dp=0, cp=0, tp=0))
    assert spec.fields(middle_rank, ("tokens", "cu_seqlens", "labels")) == ("cu_seqlens",)
    assert spec.fields(0, ("tokens", "cu_seqlens", "labels")) == ("tokens", "cu_seqlens")


def test_examples_parse():
    job = DGraph.from_toml(EXAMPLES / "job.toml").spec
    assert job.source_names() == ("web", "code")
    assert {s.format for s in job.sources} == {"parquet", "jsonl"}
    assert job.sources[0].paths == (str(EXAMPLES / "data" / "web" / "*.parquet"),)
    assert job.sources[1].paths == (str(EXAMPLES / "data" / "code"),)
    assert job.mesh == ClientPlaceTree(dp=4, tp=2)
    assert job.mix.weights_at(0) == pytest.approx({"web": 0.7, "code": 0.3})
    demo = DGraph.from_toml(EXAMPLES / "demo_job.toml").spec
    assert {s.format for s in demo.sources} == {"synthetic"}
    assert 2 <= len(demo.sources) <= 3
    assert (demo.mesh.dp, demo.mesh.tp, demo.seq_len, demo.micro_batches) == (2, 1, 2048, 2)


@settings(max_examples=40, deadline=None)
@given(
    names=st.lists(st.from_regex(r"[A-Za-z0-9_.-]{1,12}", fullmatch=True), min_size=1, max_size=4, unique=True),
    weights=st.lists(st.floats(0.001, 1e6, allow_nan=False), min_size=4, max_size=4),
    path=st.text(st.characters(blacklist_categories=("Cs",)), min_size=1, max_size=20),
    column=st.text(st.characters(blacklist_categories=("Cs",)), min_size=1, max_size=10),
    seed=st.integers(0, (1 << 63) - 1),
    dp=st.integers(1, 8),
)
def test_toml_round_trip_property(names, weights, path, column, seed, dp):
    g = DGraph("prop", seed=seed)
    for n in names:
        g.source(n, "jsonl", ["/base/" + path], column=column)
    g.mix(dict(zip(names, weights, strict=False))).mesh(dp=dp)
    text = g.to_toml()
    assert tomllib.loads(text) == g.to_dict()
    assert JobSpec.from_dict(tomllib.loads(text)) == g.spec


# -- paths --------------------------------------------------------------------------------------------


RELATIVE_TOML = """
[job]
name = "rel"

[[source]]
name = "web"
format = "parquet"
paths = ["data/*.parquet", "../other/x.parquet", "/abs/y.parquet", "./d/../e/"]

[[source]]
name = "code"
format = "jsonl"
paths = "code/"

[mix]
weights = { web = 1, code = 1 }
"""


def test_relative_paths_resolve_against_toml_dir(tmp_path, monkeypatch):
    sub = tmp_path / "conf"
    sub.mkdir()
    p = sub / "job.toml"
    p.write_text(RELATIVE_TOML, encoding="utf-8")
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    monkeypatch.chdir(elsewhere)
    spec = DGraph.from_toml(p).spec
    assert spec.sources[0].paths == (
        str(sub / "data" / "*.parquet"),
        str(tmp_path / "other" / "x.parquet"),
        "/abs/y.parquet",
        str(sub / "e"),
    )
    assert spec.sources[1].paths == (str(sub / "code"),)
    # the spec holds absolute paths, so it survives a round trip from anywhere
    monkeypatch.chdir(tmp_path)
    assert DGraph.from_toml("conf/job.toml").spec == spec
    out = tmp_path / "out" / "job.toml"
    out.parent.mkdir()
    out.write_text(spec.to_toml(), encoding="utf-8")
    assert DGraph.from_toml(out).spec == spec


def test_relative_paths_without_base_dir_use_cwd(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    d = base_dict()
    d["source"][0]["paths"] = ["rel/a.parquet"]
    assert JobSpec.from_dict(d).sources[0].paths == (str(tmp_path / "rel" / "a.parquet"),)
    g = DGraph("j").source("s", "jsonl", "x/*.jsonl").mix({"s": 1})
    assert g.spec.sources[0].paths == (str(tmp_path / "x" / "*.jsonl"),)


# -- digests ------------------------------------------------------------------------------------------


def test_digest_stable():
    a, b = base_graph().plan(), JobSpec.from_dict(base_dict())
    assert a.digest() == b.digest()
    assert len(a.digest()) == 64
    assert int(a.digest(), 16) >= 0
    d = base_dict()
    d["mix"]["weights"] = dict(reversed(list(d["mix"]["weights"].items())))  # key order is not identity
    assert JobSpec.from_dict(d).digest() == a.digest()
    assert base_graph().digest() == a.digest()


def _mutations():
    s = base_graph().plan()
    src = s.sources
    return {
        "name": dataclasses.replace(s, name="other"),
        "seed": dataclasses.replace(s, seed=1),
        "seq_len": dataclasses.replace(s, seq_len=4096),
        "micro_batches": dataclasses.replace(s, micro_batches=2),
        "rows": dataclasses.replace(s, rows=2),
        "pad_id": dataclasses.replace(s, pad_id=0),
        "long_docs": dataclasses.replace(s, long_docs="truncate"),
        "distribute": dataclasses.replace(s, distribute="world"),
        "broadcast_at": dataclasses.replace(s, broadcast_at=("tp", "pp")),
        "prefetch_steps": dataclasses.replace(s, prefetch_steps=3),
        "pp_fields": dataclasses.replace(s, pp_fields={"last": ["labels"]}),
        "source_order": dataclasses.replace(s, sources=(src[1], src[0], src[2])),
        "source_path": dataclasses.replace(s, sources=(dataclasses.replace(src[0], paths=("/x",)), *src[1:])),
        "source_column": dataclasses.replace(s, sources=(dataclasses.replace(src[0], column="t"), *src[1:])),
        "transform": dataclasses.replace(s, sources=(dataclasses.replace(src[0], transform="a:b"), *src[1:])),
        "max_sample_bytes": dataclasses.replace(
            s, sources=(dataclasses.replace(src[0], max_sample_bytes=10), *src[1:])
        ),
        "synthetic_sigma": dataclasses.replace(s, sources=(*src[:2], dataclasses.replace(src[2], sigma=0.5))),
        "mix": dataclasses.replace(s, mix=MixSpec(weights={"web": 0.5, "code": 0.4, "syn": 0.1})),
        "cost": dataclasses.replace(s, balance=BalanceSpec(cost="a:b")),
        "alpha": dataclasses.replace(s, balance=BalanceSpec(alpha=2.0)),
        "beta": dataclasses.replace(s, balance=BalanceSpec(beta=0.0)),
        "method": dataclasses.replace(s, balance=BalanceSpec(method="greedy")),
        "mesh_dp": dataclasses.replace(s, mesh=ClientPlaceTree(dp=8, tp=2)),
        "mesh_order": dataclasses.replace(s, mesh=ClientPlaceTree(dp=4, tp=2, order=("pp", "tp", "cp", "dp"))),
    }


LAYOUT = {"micro_batches", "rows", "prefetch_steps", "method", "mesh_dp", "mesh_order"}
# The data identity per ARCHITECTURE §4.2: name, seed, sources, transforms, mixture and cost.
IDENTITY = {
    "name",
    "seed",
    "source_order",
    "source_path",
    "source_column",
    "transform",
    "max_sample_bytes",
    "synthetic_sigma",
    "mix",
    "cost",
    "alpha",
    "beta",
}


@pytest.mark.parametrize("what", sorted(_mutations()))
def test_digest_changes_with_every_field(what):
    base = base_graph().plan()
    changed = _mutations()[what]
    assert changed != base
    assert changed.digest() != base.digest()


@pytest.mark.parametrize("what", sorted(LAYOUT | IDENTITY))
def test_data_digest(what):
    base = base_graph().plan()
    changed = _mutations()[what]
    if what in LAYOUT:
        assert changed.data_digest() == base.data_digest()
    else:
        assert changed.data_digest() != base.data_digest()


def test_data_digest_differs_from_digest():
    s = base_graph().plan()
    assert s.data_digest() != s.digest()
    assert len(s.data_digest()) == 64


# -- mixture ------------------------------------------------------------------------------------------


def test_weights_at_constant_normalised():
    m = MixSpec(weights={"a": 3, "b": 1, "c": 0})
    assert m.weights_at(0) == {"a": 0.75, "b": 0.25, "c": 0.0}
    assert m.weights_at(10**9) == m.weights_at(0)


def test_weights_at_schedule_step_and_linear():
    points = ((0, {"a": 1.0, "b": 0.0}), (100, {"a": 1.0, "b": 1.0}), (200, {"a": 0.0, "b": 2.0}))
    step = MixSpec(schedule=points)
    assert step.weights_at(0) == {"a": 1.0, "b": 0.0}
    assert step.weights_at(99) == {"a": 1.0, "b": 0.0}
    assert step.weights_at(100) == {"a": 0.5, "b": 0.5}
    assert step.weights_at(10_000) == {"a": 0.0, "b": 1.0}
    lin = MixSpec(schedule=points, interpolate="linear")
    assert lin.weights_at(50) == pytest.approx({"a": 0.75, "b": 0.25})
    assert lin.weights_at(150) == pytest.approx({"a": 0.25, "b": 0.75})
    assert lin.weights_at(100) == pytest.approx({"a": 0.5, "b": 0.5})
    assert lin.weights_at(500) == {"a": 0.0, "b": 1.0}
    for s in (0, 13, 77, 150, 199):
        assert sum(lin.weights_at(s).values()) == pytest.approx(1.0)
    with pytest.raises(ConfigError, match=r"step=-1 must be an integer >= 0"):
        lin.weights_at(-1)


def test_mix_dict_round_trip():
    m = MixSpec(schedule=((0, {"a": 1.0}), (5, {"a": 2.0})), interpolate="linear")
    assert MixSpec.from_dict(m.to_dict()) == m
    assert m.to_dict() == {
        "schedule": [{"step": 0, "weights": {"a": 1.0}}, {"step": 5, "weights": {"a": 2.0}}],
        "interpolate": "linear",
    }


# -- validation: every error matches its message -------------------------------------------------------


def _set(path, value):
    def mutate(d):
        node = d
        for key in path[:-1]:
            node = node[key]
        if value is _DELETE:
            del node[path[-1]]
        else:
            node[path[-1]] = value

    return mutate


_DELETE = object()

DICT_ERRORS = [
    # mixture
    (
        "unknown_source_in_weights",
        _set(("mix", "weights", "books"), 0.1),
        r"\[mix\] weights name unknown source 'books'; known sources: web, code, syn",
    ),
    (
        "source_without_weight",
        _set(("mix", "weights", "code"), _DELETE),
        r"source 'code' has no weight in \[mix\]; give every source a weight",
    ),
    ("negative_weight", _set(("mix", "weights", "web"), -0.5), r"mix weights\['web'\]=-0.5 is a negative weight"),
    ("nan_weight", _set(("mix", "weights", "web"), float("nan")), r"mix weights\['web'\]=nan must be a finite number"),
    ("all_zero", _set(("mix", "weights"), {"web": 0, "code": 0.0, "syn": 0}), r"sums to 0 \(all weights are zero\)"),
    (
        "unknown_in_schedule",
        _set(("mix",), {"schedule": [{"step": 0, "weights": {"web": 1, "code": 1, "syn": 1, "x": 1}}]}),
        r"unknown source 'x'",
    ),
    (
        "schedule_missing_source",
        _set(("mix",), {"schedule": [{"step": 0, "weights": {"web": 1, "code": 1}}]}),
        r"source 'syn' has no weight in \[mix\]",
    ),
    (
        "schedule_not_sorted",
        _set(
            ("mix",),
            {
                "schedule": [
                    {"step": 0, "weights": {"web": 1, "code": 1, "syn": 1}},
                    {"step": 20, "weights": {"web": 1, "code": 1, "syn": 1}},
                    {"step": 10, "weights": {"web": 1, "code": 1, "syn": 1}},
                ]
            },
        ),
        r"schedule steps \[0, 20, 10\] are not strictly increasing; sort the points",
    ),
    (
        "schedule_not_at_0",
        _set(("mix",), {"schedule": [{"step": 5, "weights": {"web": 1, "code": 1, "syn": 1}}]}),
        r"must start at step 0, but its first step is 5",
    ),
    (
        "schedule_point_keys",
        _set(
            ("mix",),
            {"schedule": [{"step": 0, "weights": {"web": 1, "code": 1, "syn": 1}}, {"step": 5, "weights": {"web": 1}}]},
        ),
        r"point at step 5 names \['web'\] but step 0 names",
    ),
    (
        "schedule_entry_key",
        _set(("mix",), {"schedule": [{"step": 0, "weight": {}}]}),
        r"unknown key 'weight' in \[mix\] schedule\[0\]; allowed keys: step, weights",
    ),
    (
        "schedule_entry_missing",
        _set(("mix",), {"schedule": [{"step": 0}]}),
        r"schedule\[0\]=\{'step': 0\} needs both step and weights",
    ),
    (
        "weights_and_schedule",
        _set(("mix", "schedule"), [{"step": 0, "weights": {"web": 1}}]),
        r"\[mix\] needs exactly one of weights",
    ),
    ("no_weights", _set(("mix",), {}), r"\[mix\] needs exactly one of weights"),
    (
        "interpolate_bad",
        _set(("mix",), {"schedule": [{"step": 0, "weights": {"web": 1, "code": 1, "syn": 1}}], "interpolate": "cubic"}),
        r"mix interpolate='cubic' is not one of \('step', 'linear'\)",
    ),
    (
        "interpolate_with_weights",
        _set(("mix", "interpolate"), "linear"),
        r"interpolate='linear' applies to a schedule only",
    ),
    # sources
    ("duplicate_source", _set(("source", 1, "name"), "web"), r"duplicate source names \['web'\]"),
    (
        "bad_name_chars",
        _set(("source", 0, "name"), "web en"),
        r"source name='web en' is not a valid name; use 1 to 128 characters from \[A-Za-z0-9_.-\]",
    ),
    (
        "unknown_format",
        _set(("source", 0, "format"), "csv"),
        r"source 'web' format='csv' is not one of \('parquet', 'arrow', 'jsonl', 'webdataset', 'synthetic'\)",
    ),
    (
        "paths_missing",
        _set(("source", 0, "paths"), _DELETE),
        r"source 'web' has format 'parquet' but no paths; set paths",
    ),
    ("paths_empty", _set(("source", 1, "paths"), []), r"source 'code' has format 'jsonl' but no paths"),
    (
        "paths_not_strings",
        _set(("source", 1, "paths"), [1]),
        r"source 'code' paths=\[1\] must be a list of non-empty strings",
    ),
    ("synthetic_paths", _set(("source", 2, "paths"), ["/x"]), r"source 'syn' is synthetic and reads no files"),
    ("synthetic_column", _set(("source", 2, "column"), "c"), r"source 'syn' is synthetic and has no columns"),
    (
        "synthetic_opt_on_file",
        _set(("source", 0, "samples"), 10),
        r"has format 'parquet' but sets samples, options of synthetic sources only",
    ),
    ("samples", _set(("source", 2, "samples"), 0), r"source 'syn' samples=0 must be an integer >= 1"),
    ("median", _set(("source", 2, "median"), 0.0), r"source 'syn' median=0.0 must be a finite number > 0"),
    ("median_inf", _set(("source", 2, "median"), float("inf")), r"source 'syn' median=inf must be a finite number > 0"),
    ("sigma", _set(("source", 2, "sigma"), -0.1), r"source 'syn' sigma=-0.1 must be a finite number >= 0"),
    ("min_len", _set(("source", 2, "min_len"), 0), r"source 'syn' min_len=0 must be an integer >= 1"),
    (
        "max_len",
        _set(("source", 2, "max_len"), 8),
        r"source 'syn' max_len=8 must be an integer >= 16; keep min_len=16 <= max_len",
    ),
    (
        "transform_form",
        _set(("source", 0, "transform"), "msdata_server.transforms.byte_tokens"),
        r"source 'web' transform='msdata_server.transforms.byte_tokens' must have the form 'module:function'",
    ),
    (
        "max_sample_bytes",
        _set(("source", 0, "max_sample_bytes"), 0),
        r"source 'web' max_sample_bytes=0 must be an integer >= 1",
    ),
    ("column_empty", _set(("source", 0, "column"), ""), r"source 'web' column='' must be a non-empty column"),
    ("source_needs_name", _set(("source", 0, "name"), _DELETE), r"\[\[source\]\] #1 needs both name and format"),
    ("source_not_array", _set(("source",), {"name": "web"}), r"source must be an array of tables"),
    # job
    ("seq_len", _set(("job", "seq_len"), 0), r"job seq_len=0 must be an integer >= 1"),
    ("seq_len_float", _set(("job", "seq_len"), 8192.0), r"job seq_len=8192.0 must be an integer >= 1"),
    (
        "seq_len_cp",
        lambda d: (d["mesh"].update(cp=3), d["job"].update(seq_len=8192)),
        r"job seq_len=8192 must be divisible by 2\*cp=6 .* such as 8196",
    ),
    ("micro_batches", _set(("job", "micro_batches"), 0), r"job micro_batches=0 must be an integer >= 1"),
    ("rows", _set(("job", "rows"), -2), r"job rows=-2 must be an integer >= 1"),
    ("pad_id", _set(("job", "pad_id"), -1), r"job pad_id=-1 must be an integer >= 0"),
    ("seed", _set(("job", "seed"), -1), r"job seed=-1 must be an integer >= 0"),
    ("long_docs", _set(("job", "long_docs"), "drop"), r"job long_docs='drop' is not one of \('split', 'truncate'\)"),
    ("distribute", _set(("job", "distribute"), "tp"), r"job distribute='tp' is not one of \('dp', 'cp', 'world'\)"),
    (
        "broadcast_axis",
        _set(("job", "broadcast_at"), ["tp", "dp"]),
        r"job broadcast_at axis='dp' is not one of \('tp', 'pp', 'cp'\)",
    ),
    ("broadcast_dup", _set(("job", "broadcast_at"), ["tp", "tp"]), r"broadcast_at=\['tp', 'tp'\] names an axis twice"),
    ("prefetch", _set(("job", "prefetch_steps"), 0), r"job prefetch_steps=0 must be an integer >= 1"),
    ("job_name", _set(("job", "name"), "a/b"), r"job name='a/b' is not a valid name"),
    ("job_no_name", _set(("job", "name"), _DELETE), r"\[job\] has no name"),
    (
        "pp_fields_stage",
        _set(("job", "pp_fields"), {"second": ["tokens"]}),
        r"unknown key 'second' in \[job\] pp_fields; allowed keys: first, middle, last",
    ),
    (
        "pp_fields_dup",
        _set(("job", "pp_fields"), {"last": ["labels", "labels"]}),
        r"pp_fields.last=\['labels', 'labels'\] names a field twice",
    ),
    (
        "pp_fields_type",
        _set(("job", "pp_fields"), {"last": [3]}),
        r"pp_fields.last=\[3\] must be a list of non-empty strings",
    ),
    # balance
    (
        "method",
        _set(("balance", "method"), "lpt"),
        r"balance method='lpt' is not one of \('karmarkar_karp', 'greedy', 'none'\)",
    ),
    (
        "cost",
        _set(("balance", "cost"), "quadratic"),
        r"balance cost='quadratic' must be 'attention' .* or a function path 'module:function'",
    ),
    ("alpha", _set(("balance", "alpha"), -1.0), r"balance alpha=-1.0 must be a finite number >= 0"),
    ("beta", _set(("balance", "beta"), -4096), r"balance beta=-4096 must be a finite number >= 0"),
    # mesh
    ("mesh_size", _set(("mesh", "tp"), 0), r"mesh tp=0 must be an integer >= 1"),
    ("mesh_order", _set(("mesh", "order"), ["pp", "dp"]), r"mesh order=\['pp', 'dp'\] must name each of"),
    # strict keys, every table
    (
        "top_key",
        _set(("jobs",), {}),
        r"unknown key 'jobs' in the job file \(top level\); allowed keys: job, mesh, source, mix, balance",
    ),
    (
        "job_key",
        _set(("job", "seqlen"), 1),
        r"unknown key 'seqlen' in \[job\]; allowed keys: name, seed, seq_len, micro_batches",
    ),
    ("mesh_key", _set(("mesh", "ep"), 2), r"unknown key 'ep' in table \[mesh\]; allowed keys: pp, dp, cp, tp, order"),
    (
        "source_key",
        _set(("source", 1, "colum"), "x"),
        r"unknown key 'colum' in \[\[source\]\] #2; allowed keys: name, format, paths, column, transform",
    ),
    (
        "mix_key",
        _set(("mix", "weight"), {}),
        r"unknown key 'weight' in \[mix\]; allowed keys: weights, schedule, interpolate",
    ),
    (
        "balance_key",
        _set(("balance", "methods"), "greedy"),
        r"unknown key 'methods' in \[balance\]; allowed keys: cost, alpha, beta, method",
    ),
    ("no_job", _set(("job",), _DELETE), r"the job has no \[job\] table"),
    ("no_source", _set(("source",), _DELETE), r"the job has no \[source\] table; add \[\[source\]\]"),
    ("no_mix", _set(("mix",), _DELETE), r"the job has no \[mix\] table"),
]


@pytest.mark.parametrize(("mutate", "message"), [c[1:] for c in DICT_ERRORS], ids=[c[0] for c in DICT_ERRORS])
def test_dict_validation(mutate, message):
    d = copy.deepcopy(base_dict())
    JobSpec.from_dict(d)  # the base is valid
    mutate(d)
    with pytest.raises(ConfigError, match=message):
        JobSpec.from_dict(d)


BUILDER_ERRORS = [
    ("unknown_weight", lambda g: g.mix({"web": 1, "code": 1, "syn": 1, "zz": 1}).plan(), r"unknown source 'zz'"),
    ("missing_weight", lambda g: g.mix({"web": 1, "code": 1}).plan(), r"source 'syn' has no weight in \[mix\]"),
    ("negative", lambda g: g.mix({"web": -1, "code": 1, "syn": 1}), r"negative weight"),
    ("zero_sum", lambda g: g.mix({"web": 0, "code": 0, "syn": 0}), r"sums to 0"),
    ("schedule_unsorted", lambda g: g.mix(schedule=[(0, {"web": 1}), (0, {"web": 2})]), r"not strictly increasing"),
    ("schedule_start", lambda g: g.mix(schedule=[(1, {"web": 1})]), r"must start at step 0"),
    (
        "schedule_dict_key",
        lambda g: g.mix(schedule=[{"step": 0, "weight": {}}]),
        r"unknown key 'weight' in mix schedule\[0\]",
    ),
    (
        "schedule_type",
        lambda g: g.mix(schedule={"step": 0}),
        r"mix schedule=\{'step': 0\} must be a list of \(step, weights\) points",
    ),
    ("duplicate", lambda g: g.source("web", "jsonl", "/x"), r"duplicate source names \['web'\]"),
    ("name_chars", lambda g: g.source("we:b", "jsonl", "/x"), r"source name='we:b' is not a valid name"),
    ("format", lambda g: g.source("t", "tsv", "/x"), r"format='tsv' is not one of"),
    ("paths", lambda g: g.source("t", "arrow"), r"source 't' has format 'arrow' but no paths"),
    (
        "synthetic_opts_on_file",
        lambda g: g.source("t", "jsonl", "/x", median=3),
        r"sets median, options of synthetic sources only",
    ),
    ("unknown_opt", lambda g: g.source("t", "synthetic", medain=3), r"unknown option\(s\) medain"),
    ("samples", lambda g: g.source("t", "synthetic", samples=0), r"samples=0 must be an integer >= 1"),
    ("median", lambda g: g.source("t", "synthetic", median=-1), r"median=-1 must be a finite number > 0"),
    ("sigma", lambda g: g.source("t", "synthetic", sigma=-1), r"sigma=-1 must be a finite number >= 0"),
    ("min_max", lambda g: g.source("t", "synthetic", min_len=10, max_len=9), r"max_len=9 must be an integer >= 10"),
    (
        "transform",
        lambda g: g.source("t", "jsonl", "/x", transform="mod"),
        r"transform='mod' must have the form 'module:function'",
    ),
    ("seq_len", lambda g: g.pack(0).plan(), r"job seq_len=0 must be an integer >= 1"),
    ("seq_len_cp", lambda g: g.pack(102).mesh(cp=2).plan(), r"job seq_len=102 must be divisible by 2\*cp=4"),
    ("micro_batches", lambda g: g.pack(64, micro_batches=0).plan(), r"job micro_batches=0 must be"),
    ("rows", lambda g: g.pack(64, rows=0).plan(), r"job rows=0 must be"),
    ("pad_id", lambda g: g.pack(64, pad_id=-5).plan(), r"job pad_id=-5 must be an integer >= 0"),
    (
        "long_docs",
        lambda g: g.pack(64, long_docs="wrap").plan(),
        r"long_docs='wrap' is not one of \('split', 'truncate'\)",
    ),
    ("distribute", lambda g: g.distribute("node"), r"distribute='node' is not one of \('dp', 'cp', 'world'\)"),
    ("method", lambda g: g.balance("best"), r"method='best' is not one of \('karmarkar_karp', 'greedy', 'none'\)"),
    ("broadcast", lambda g: g.broadcast_at("dp").plan(), r"broadcast_at axis='dp' is not one of \('tp', 'pp', 'cp'\)"),
    ("cost", lambda g: g.cost("flops"), r"balance cost='flops' must be 'attention'"),
    ("alpha", lambda g: g.cost(alpha=-1), r"balance alpha=-1 must be a finite number >= 0"),
    ("beta", lambda g: g.cost(beta=float("nan")), r"balance beta=nan must be a finite number >= 0"),
    ("prefetch", lambda g: g.prefetch(0).plan(), r"job prefetch_steps=0 must be an integer >= 1"),
    ("mesh", lambda g: g.mesh(dp=0), r"mesh dp=0 must be an integer >= 1"),
    ("pp_fields", lambda g: g.pp_fields(last=["labels", "labels"]).plan(), r"names a field twice"),
]


@pytest.mark.parametrize(("action", "message"), [c[1:] for c in BUILDER_ERRORS], ids=[c[0] for c in BUILDER_ERRORS])
def test_builder_validation(action, message):
    with pytest.raises(ConfigError, match=message):
        action(base_graph())


def test_builder_needs_sources_and_mix():
    with pytest.raises(ConfigError, match=r"job 'j' has no sources; call .source"):
        DGraph("j").plan()
    with pytest.raises(ConfigError, match=r"job 'j' has no mixture; call .mix"):
        DGraph("j").source("a", "synthetic").plan()
    with pytest.raises(ConfigError, match=r"job name='' is not a valid name"):
        DGraph("")


def test_enum_messages_come_from_the_tables():
    with pytest.raises(ConfigError) as e:
        base_graph().balance("x")
    assert str(graph_mod.METHODS) in str(e.value)
    with pytest.raises(ConfigError) as e:
        SourceSpec(name="s", format="x", paths=("/a",))
    assert str(graph_mod.FORMATS) in str(e.value)


def test_from_toml_errors(tmp_path):
    missing = tmp_path / "nope.toml"
    with pytest.raises(ConfigError, match=r"cannot read job file .*nope.toml"):
        DGraph.from_toml(missing)
    bad = tmp_path / "bad.toml"
    bad.write_text("[job\nname = 1\n", encoding="utf-8")
    with pytest.raises(ConfigError, match=r"bad.toml' is not valid TOML"):
        DGraph.from_toml(bad)


def test_toml_numbers_are_normalised(tmp_path):
    """TOML integers for float fields are accepted and read back equal."""
    d = base_dict()
    d["balance"].update(alpha=2, beta=0)
    d["mix"]["weights"] = {"web": 6, "code": 3, "syn": 1}
    spec = JobSpec.from_dict(d)
    assert spec.balance.alpha == 2.0
    assert isinstance(spec.balance.alpha, float)
    assert spec.mix.weights == {"web": 6.0, "code": 3.0, "syn": 1.0}
    p = tmp_path / "j.toml"
    p.write_text(spec.to_toml(), encoding="utf-8")
    assert DGraph.from_toml(p).spec == spec


def test_empty_broadcast_and_pp_fields_round_trip():
    g = DGraph("x").source("a", "synthetic").mix({"a": 1}).broadcast_at().pp_fields(first=["tokens"])
    spec = g.plan()
    assert spec.broadcast_at == ()
    assert spec.pp_fields == {"first": ("tokens",)}
    assert JobSpec.from_dict(tomllib.loads(g.to_toml())) == spec
    assert DGraph.from_spec(spec).pp_fields().plan().pp_fields is None


@pytest.mark.parametrize("make", [base_graph, full_graph], ids=["base", "full"])
def test_json_wire_round_trip_keeps_digest(make):
    """Clients send to_dict() as JSON; the server rebuilds the spec and must compute the same digest."""
    import orjson

    spec = make().plan()
    back = JobSpec.from_dict(orjson.loads(orjson.dumps(spec.to_dict())))
    assert back == spec
    assert back.digest() == spec.digest()
    assert back.data_digest() == spec.data_digest()
