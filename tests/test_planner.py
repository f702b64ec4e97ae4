"""The step planner: plans, mixture exactness, no loss or repeat, determinism, state round trips."""

import importlib
import json
import subprocess
import sys

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from msdata_server.errors import BadSourceError, CheckpointError, ConfigError, ProtocolError
from msdata_server.planner import Mixture, Planner, StepPlan

from .planner_util import MEDIANS, NAMES, View, config


def run(planner, view, steps):
    return [planner.plan_step(view) for _ in range(steps)]


def plan_arrays(plan):
    return [getattr(plan, f).tobytes() for f in ("source", "ordinal", "offset", "length", "group", "micro", "row")]


def check_plan(plan, cfg):
    """Sorted by (dp, micro, row), rows within seq_len, dtypes, micro_batch slices."""
    assert plan.source.dtype == np.int32
    assert plan.ordinal.dtype == np.int64
    assert plan.offset.dtype == np.int32
    assert plan.length.dtype == np.int32
    assert plan.group.dtype == plan.micro.dtype == plan.row.dtype == np.int32
    key = (plan.group.astype(np.int64) * cfg.micro_batches + plan.micro) * cfg.rows + plan.row
    assert (np.diff(key) >= 0).all()
    used = np.bincount(key, plan.length, minlength=cfg.dp * cfg.micro_batches * cfg.rows)
    assert used.max() <= cfg.seq_len
    assert (plan.length > 0).all()
    total = 0
    for d in range(cfg.dp):
        for m in range(cfg.micro_batches):
            mb = plan.micro_batch(d, m)
            assert isinstance(mb, StepPlan)
            assert (mb.group == d).all()
            assert (mb.micro == m).all()
            total += len(mb)
    assert total == len(plan)
    s = plan.stats
    assert s.docs == len(plan)
    assert s.padding_fraction == pytest.approx(1 - plan.length.sum() / cfg.capacity)
    assert sum(s.tokens.values()) == plan.length.sum()
    assert s.imbalance == pytest.approx(s.cost.max() / s.cost.mean())
    assert s.gap >= 1.0 - 1e-12
    assert s.lower_bound > 0


def all_pieces(plans, planner):
    """(source, ordinal, offset, length) of every piece planned, plus the carry-over."""
    carry = planner.state_dict()["carry"]
    cols = [
        np.concatenate([getattr(p, f).astype(np.int64) for p in plans] + [np.array(carry[c], np.int64)])
        for f, c in (("source", "source"), ("ordinal", "ordinal"), ("offset", "offset"), ("length", "length"))
    ]
    return cols


def check_exactly_once(plans, planner, view, cfg):
    """Every non-empty ordinal below the cursor appears once (as its pieces), nothing else appears."""
    src, ordinal, offset, length = all_pieces(plans, planner)
    cursor = planner.state_dict()["cursor"]
    for s in range(len(cfg.sources)):
        mine = src == s
        o, off, ln = ordinal[mine], offset[mine], length[mine]
        order = np.lexsort((off, o))
        o, off, ln = o[order], off[order], ln[order]
        expect = view.all(s, cursor[s])
        want = np.flatnonzero(expect > 0)
        assert np.array_equal(np.unique(o), want), f"source {s}: lost or extra ordinals"
        used = expect if cfg.long_docs == "split" else np.minimum(expect, cfg.seq_len)
        assert np.array_equal(np.bincount(o, ln, minlength=expect.size).astype(np.int64), used)
        # pieces of one document are contiguous: each offset = the tokens of the earlier pieces
        first = np.r_[True, o[1:] != o[:-1]]
        before = np.cumsum(ln) - ln
        start = np.maximum.accumulate(np.where(first, before, 0))
        assert np.array_equal(off, before - start), "pieces overlap or leave holes"


# --- plans -----------------------------------------------------------------------------------------


@pytest.mark.parametrize("method", ["karmarkar_karp", "greedy", "none"])
def test_plans_are_well_formed_and_lose_nothing(method):
    cfg = config(method=method, micro_batches=3, rows=2)
    view = View(MEDIANS, zero_every=97)
    planner = Planner(cfg)
    plans = run(planner, view, 6)
    assert [p.step for p in plans] == list(range(6))
    assert planner.step == 6
    for p in plans:
        check_plan(p, cfg)
    check_exactly_once(plans, planner, view, cfg)
    if method != "none":
        assert np.mean([p.stats.padding_fraction for p in plans[1:]]) < 0.06


def test_balanced_plans_beat_arrival_order():
    view = View(MEDIANS)
    stats = {}
    for method in ("karmarkar_karp", "greedy", "none"):
        planner = Planner(config(method=method, dp=16, micro_batches=4, seq_len=8192))
        stats[method] = [p.stats for p in run(planner, view, 4)]
    for method in ("karmarkar_karp", "greedy"):
        assert max(s.imbalance for s in stats[method]) < 1.03
        assert max(s.padding_fraction for s in stats[method]) < 0.02
    assert min(s.imbalance for s in stats["none"]) > 1.1
    assert min(s.padding_fraction for s in stats["none"]) > 0.05


def test_long_documents_split_into_pieces():
    cfg = config(seq_len=1024, long_docs="split")
    view = View(MEDIANS, max_len=5000)
    planner = Planner(cfg)
    plans = run(planner, view, 5)
    pieces = np.concatenate([p.offset for p in plans])
    assert (pieces > 0).any()
    assert (pieces % 1024 == 0).all()
    check_exactly_once(plans, planner, view, cfg)


def test_long_documents_truncate():
    cfg = config(seq_len=1024, long_docs="truncate")
    view = View(MEDIANS, max_len=5000)
    planner = Planner(cfg)
    plans = run(planner, view, 5)
    assert all((p.offset == 0).all() for p in plans)
    check_exactly_once(plans, planner, view, cfg)  # a truncated document counts its first seq_len tokens


def test_plans_are_deterministic():
    cfg = config(dp=8)
    a = run(Planner(cfg), View(MEDIANS, seed=3), 4)
    b = run(Planner(cfg), View(MEDIANS, seed=3), 4)
    for x, y in zip(a, b):
        assert plan_arrays(x) == plan_arrays(y)
        assert x.stats.cost.tobytes() == y.stats.cost.tobytes()
    c = run(Planner(cfg), View(MEDIANS, seed=4), 1)
    assert plan_arrays(c[0]) != plan_arrays(a[0])


def test_a_failing_view_leaves_the_planner_unchanged():
    cfg = config(dp=16, micro_batches=4)
    view = View(MEDIANS)

    class Flaky:
        def lengths(self, source, start, count):
            if source == 2:  # after sources 0 and 1 were read
                raise ConnectionError("loader went away")
            return view.lengths(source, start, count)

    planner = Planner(cfg)
    planner.plan_step(view)
    before = planner.state_dict()
    restored = Planner(cfg, before)  # no look-ahead: every source is read
    with pytest.raises(ConnectionError):
        restored.plan_step(Flaky())
    assert restored.step == 1
    assert restored.state_dict() == before
    assert plan_arrays(restored.plan_step(view)) == plan_arrays(planner.plan_step(view))


def test_lengths_are_read_in_chunks():
    view = View(MEDIANS)
    planner = Planner(config(dp=16, seq_len=8192))
    plans = run(planner, view, 3)
    docs = sum(len(p) for p in plans)
    assert view.calls * 20 < docs


def test_empty_samples_are_skipped_and_a_dead_source_is_reported():
    cfg = config(mixture=Mixture.constant({"chat": 1}))
    planner = Planner(cfg)
    plan = planner.plan_step(View(MEDIANS, zero_every=2))
    assert (plan.ordinal % 2 == 1).all()

    class Dead:
        def lengths(self, source, start, count):
            return np.zeros(count, np.int64)

    with pytest.raises(BadSourceError, match=r"'chat' has no good sample among its last \d+ reads"):
        Planner(cfg).plan_step(Dead())


@pytest.mark.parametrize(
    ("answer", "match"),
    [
        (lambda count: np.zeros(count + 1, np.int64), "must return"),
        (lambda count: np.full(count, 1.5), "must return"),
        (lambda count: np.full(count, -3), "negative length"),
    ],
)
def test_a_bad_view_is_a_protocol_error(answer, match):
    class Bad:
        def lengths(self, source, start, count):
            return answer(count)

    with pytest.raises(ProtocolError, match=match):
        Planner(config()).plan_step(Bad())


# --- mixture -----------------------------------------------------------------------------------------


@settings(max_examples=12, deadline=None)
@given(
    weights=st.lists(st.floats(0.0, 1.0), min_size=4, max_size=4).filter(lambda w: sum(w) > 0.05),
    medians=st.lists(st.sampled_from([20, 150, 600, 3000]), min_size=4, max_size=4),
    sigma=st.sampled_from([0.3, 1.0, 1.5]),
    long_docs=st.sampled_from(["split", "truncate"]),
)
def test_mixture_is_followed_exactly(weights, medians, sigma, long_docs):
    mixture = Mixture.constant(dict(zip(NAMES, weights)))
    cfg = config(seq_len=2048, dp=3, long_docs=long_docs, mixture=mixture, method="greedy")
    view = View(medians, sigma=sigma)
    planner = Planner(cfg)
    plans = run(planner, view, 20)
    src, _, _, length = all_pieces(plans, planner)
    taken = np.bincount(src, length, minlength=4)  # planned + carried over
    state = planner.state_dict()
    target = np.array(state["target"])
    longest = max_doc(view, state["cursor"], cfg)
    # each source is ahead of its target by less than one document, never behind
    ahead = taken - target
    assert (ahead > -1e-6).all()
    assert (ahead <= longest).all()
    # the targets follow the weights exactly, so each share is within one document of its weight
    w = mixture.weights_at(0, NAMES)
    total = target.sum()
    assert target / total == pytest.approx(w, abs=1e-12)
    assert (np.abs(taken / total - w) <= longest / total).all()


def max_doc(view, cursor, cfg):
    """Longest document (in tokens it yields) read so far, over all sources."""
    out = 0
    for s, c in enumerate(cursor):
        x = view.all(s, c)
        if x.size:
            out = max(out, int(x.max() if cfg.long_docs == "split" else np.minimum(x, cfg.seq_len).max()))
    return out


def test_schedule_and_set_mixture_move_the_targets():
    mixture = Mixture.schedule([(0, {"chat": 1}), (3, {"books": 1})])
    cfg = config(mixture=mixture)
    view = View(MEDIANS)
    planner = Planner(cfg)
    targets = []
    for _ in range(6):
        planner.plan_step(view)
        targets.append(np.array(planner.state_dict()["target"]))
        if planner.step == 4:
            planner.set_mixture(5, {"web": 1, "code": 1})
    inc = np.diff(np.vstack([np.zeros(4), *targets]), axis=0)
    assert (inc[:3, 1:] == 0).all()
    assert (inc[:3, 0] > 0).all()
    assert (inc[3:5, :3] == 0).all()
    assert (inc[3:5, 3] > 0).all()
    assert inc[5, 0] == 0
    assert inc[5, 3] == 0
    assert inc[5, 1] == pytest.approx(inc[5, 2])
    with pytest.raises(ConfigError, match="planned up to step 5"):
        planner.set_mixture(2, {"web": 1})
    with pytest.raises(ConfigError, match="unknown sources"):
        planner.set_mixture(7, {"wiki": 1})


# --- state ---------------------------------------------------------------------------------------------


def test_state_size_does_not_grow_with_every_set_mixture():
    """A long run calls set_mixture again and again; a state holds only the overrides its steps still use
    (before: every state of the server's window held the whole history, a soak's memory grew per call)."""
    cfg = config(seq_len=2048)
    view = View(MEDIANS)
    planner = Planner(cfg)
    sizes = []
    for i in range(40):
        planner.set_mixture(planner.step, {"chat": 1 + i % 2, "code": 1})
        planner.set_mixture(planner.step + 3, {"web": 1})  # one still ahead
        planner.plan_step(view)
        state = planner.state_dict()
        assert [s for s, _ in state["mixture"]["overrides"]] == [planner.step - 1, planner.step + 2]
        sizes.append(len(json.dumps(state)))
    assert max(sizes[10:]) <= sizes[9] + 64  # flat, not growing per call
    again = Planner(cfg, json.loads(json.dumps(state)))
    for _ in range(5):
        assert plan_arrays(again.plan_step(view)) == plan_arrays(planner.plan_step(view))


@settings(max_examples=10, deadline=None)
@given(
    stop=st.integers(0, 5),
    method=st.sampled_from(["karmarkar_karp", "greedy", "none"]),
    dp=st.sampled_from([1, 3, 8]),
    tolerance=st.sampled_from([None, 0.01]),
    override=st.booleans(),
)
def test_interrupted_and_restored_runs_plan_the_same(stop, method, dp, tolerance, override):
    cfg = config(method=method, dp=dp, balance_tolerance=tolerance, seq_len=2048)
    view = View(MEDIANS, zero_every=31)
    steps = 7

    def drive(planner, first, last):
        out = []
        for step in range(first, last):
            if override and step == 2:
                planner.set_mixture(4, {"chat": 1, "code": 2})
            out.append(planner.plan_step(view))
        return out

    whole = Planner(cfg)
    straight = drive(whole, 0, steps)
    first = Planner(cfg)
    head = drive(first, 0, stop)
    state = json.loads(json.dumps(first.state_dict()))  # what a checkpoint stores
    assert len(json.dumps(state)) < 20_000
    second = Planner(cfg, state)
    assert second.step == stop
    tail = drive(second, stop, steps)
    for a, b in zip(straight, head + tail):
        assert a.step == b.step
        assert plan_arrays(a) == plan_arrays(b)
    assert whole.state_dict() == second.state_dict()


def test_restore_into_another_layout_loses_and_repeats_nothing():
    view = View(MEDIANS)
    cfg = config(dp=8, micro_batches=2)
    first = Planner(cfg)
    head = run(first, view, 3)
    other = config(dp=3, micro_batches=4, rows=2, method="greedy")
    second = Planner.from_state(other, first.state_dict())
    tail = run(second, view, 4)
    for p in tail:
        check_plan(p, other)
    check_exactly_once(head + tail, second, view, cfg)


def corrupt(state, **changes):
    out = json.loads(json.dumps(state))
    for key, value in changes.items():
        out[key] = value
    return out


def test_bad_states_are_refused_with_the_reason():
    cfg = config()
    planner = Planner(cfg)
    run(planner, View(MEDIANS), 2)
    good = planner.state_dict()
    assert good["carry"]["length"], "the test needs some carry-over"
    cases = [
        (corrupt(good, version=99), "version 99"),
        (corrupt(good, sources=["a", "b", "c", "d"]), "is for sources"),
        (corrupt(good, seq_len=8192), "seq_len=8192"),
        (corrupt(good, long_docs="truncate"), "long_docs='truncate'"),
        (corrupt(good, step=-1), "step=-1"),
        (corrupt(good, cursor=[0, 0, 0]), "'cursor' must be 4 ints"),
        (corrupt(good, target=[0.0, float("nan"), 0.0, 0.0]), "'target' must be 4 finite"),
        ({k: v for k, v in good.items() if k != "mixture"}, r"missing \['mixture'\]"),
        ({**good, "bogus": 1}, r"unknown \['bogus'\]"),
        (corrupt(good, carry={**good["carry"], "ordinal": [10**12] * len(good["carry"]["ordinal"])}), "outside"),
        (corrupt(good, carry={**good["carry"], "length": good["carry"]["length"][:-1]}), "different lengths"),
        (corrupt(good, mixture={"interpolate": "step", "points": [[0, {"wiki": 1.0}]], "overrides": []}), "wiki"),
        ("not a dict", "must be a dict"),
    ]
    for state, match in cases:
        with pytest.raises(CheckpointError, match=match):
            Planner(cfg, state)


def test_state_is_small_json():
    planner = Planner(config(dp=64, micro_batches=4, seq_len=8192))
    run(planner, View(MEDIANS), 2)
    text = json.dumps(planner.state_dict())
    assert len(text) < 20_000


# --- configuration ---------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("change", "match"),
    [
        ({"dp": 0}, "dp=0 must be an int >= 1"),
        ({"seq_len": 1.5}, "seq_len=1.5"),
        ({"method": "lpt"}, "method='lpt' is not one of"),
        ({"long_docs": "drop"}, "long_docs='drop' is not one of"),
        ({"alpha": -1.0}, "alpha=-1.0 must be"),
        ({"cost_fn": "nocolon"}, "cost_fn='nocolon'"),
        ({"balance_tolerance": -0.1}, "balance_tolerance=-0.1"),
        ({"sources": ("a", "a")}, "duplicates"),
        ({"sources": ()}, "non-empty"),
        ({"mixture": {"chat": 1}}, "must be a Mixture"),
        ({"mixture": Mixture.constant({"wiki": 1})}, "unknown sources"),
    ],
)
def test_bad_configs_are_refused(change, match):
    with pytest.raises(ConfigError, match=match):
        config(**change)


def test_custom_cost_function(tmp_path, monkeypatch):
    (tmp_path / "mycost.py").write_text(
        "import numpy as np\n"
        "def linear(lengths):\n"
        "    return lengths.astype(np.float64) * 2.0\n"
        "def broken(lengths):\n"
        "    return np.ones(3)\n"
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    importlib.invalidate_caches()
    planner = Planner(config(cost_fn="mycost:linear"))
    plan = planner.plan_step(View(MEDIANS))
    assert plan.stats.cost.sum() == pytest.approx(2.0 * plan.length.sum())
    with pytest.raises(ConfigError, match="returned shape"):
        Planner(config(cost_fn="mycost:broken")).plan_step(View(MEDIANS))
    with pytest.raises(ConfigError, match="cannot import module 'nomodule'"):
        Planner(config(cost_fn="nomodule:f"))
    with pytest.raises(ConfigError, match="has no function 'missing'"):
        Planner(config(cost_fn="mycost:missing"))


def test_micro_batch_outside_the_plan():
    plan = Planner(config()).plan_step(View(MEDIANS))
    with pytest.raises(ConfigError, match="outside this plan"):
        plan.micro_batch(4, 0)


def test_public_names_are_sorted_and_importable():
    for name in ["", ".balance", ".cost", ".mixture", ".pack", ".partition", ".planner"]:
        module = importlib.import_module("msdata_server.planner" + name)
        assert module.__all__ == sorted(module.__all__)
        assert all(hasattr(module, n) for n in module.__all__)


def test_planner_imports_no_torch_and_no_asyncio():
    code = "import sys, msdata_server.planner; print('torch' in sys.modules, 'asyncio' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.split() == ["False", "False"]
