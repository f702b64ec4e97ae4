"""Mixture: constant weights, step and linear schedules, run-time overrides, and their dict form."""

import json
import math

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from msdata_server.errors import ConfigError
from msdata_server.planner.mixture import Interpolate, Mixture

SOURCES = ("web", "code", "books")


def test_constant_normalises_and_orders_by_sources():
    m = Mixture.constant({"web": 3, "code": 1})
    w = m.weights_at(0, SOURCES)
    assert w.dtype == np.float64
    assert w.tolist() == [0.75, 0.25, 0.0]  # unnamed sources get 0
    assert m.weights_at(10**9, ("code", "books", "web")).tolist() == [0.25, 0.0, 0.75]


def test_step_schedule_is_piecewise_constant():
    m = Mixture.schedule([(2, {"web": 1}), (5, {"code": 1})])
    assert m.interpolate is Interpolate.STEP
    got = [m.weights_at(s, SOURCES).tolist() for s in range(8)]
    web, code = [1.0, 0.0, 0.0], [0.0, 1.0, 0.0]
    assert got == [web, web, web, web, web, code, code, code]  # before the first point: its weights


def test_linear_schedule_blends_between_points():
    m = Mixture.schedule([(0, {"web": 1}), (10, {"web": 1, "code": 3})], interpolate="linear")
    assert m.weights_at(0, SOURCES).tolist() == [1.0, 0.0, 0.0]
    mid = m.weights_at(5, SOURCES)
    assert mid == pytest.approx([0.625, 0.375, 0.0])
    assert m.weights_at(10, SOURCES).tolist() == [0.25, 0.75, 0.0]
    assert m.weights_at(99, SOURCES).tolist() == [0.25, 0.75, 0.0]


def test_override_applies_from_its_step_and_replaces_later_ones():
    base = Mixture.schedule([(0, {"web": 1}), (20, {"books": 1})])
    m = base.with_override(5, {"code": 1})
    assert m.weights_at(4, SOURCES).tolist() == [1.0, 0.0, 0.0]
    assert m.weights_at(5, SOURCES).tolist() == [0.0, 1.0, 0.0]
    assert m.weights_at(25, SOURCES).tolist() == [0.0, 1.0, 0.0]  # the override beats later points
    m2 = m.with_override(8, {"books": 2, "web": 2})
    assert m2.weights_at(7, SOURCES).tolist() == [0.0, 1.0, 0.0]
    assert m2.weights_at(8, SOURCES).tolist() == [0.5, 0.0, 0.5]
    m3 = m2.with_override(3, {"web": 1})  # an earlier override drops the later ones
    assert [s for s, _ in m3.overrides] == [3]
    assert m3.weights_at(30, SOURCES).tolist() == [1.0, 0.0, 0.0]
    assert base.overrides == ()  # immutable


def test_dict_round_trip_is_exact_through_json():
    m = Mixture.schedule([(0, {"web": 0.1, "code": 0.7}), (7, {"books": 1 / 3, "web": 2 / 3})], "linear")
    m = m.with_override(11, {"code": 0.3, "web": 0.6})
    d = json.loads(json.dumps(m.to_dict()))
    back = Mixture.from_dict(d)
    assert back == m
    for s in range(15):
        assert back.weights_at(s, SOURCES).tobytes() == m.weights_at(s, SOURCES).tobytes()


@pytest.mark.parametrize(
    ("weights", "match"),
    [
        ({"web": -1}, "finite and >= 0"),
        ({"web": math.nan}, "finite and >= 0"),
        ({"web": 0, "code": 0}, "must not all be 0"),
        ({}, "non-empty mapping"),
        ({"web": "1"}, "must be a number"),
        ({"web": True}, "must be a number"),
    ],
)
def test_bad_weights_are_refused(weights, match):
    with pytest.raises(ConfigError, match=match):
        Mixture.constant(weights)


def test_bad_schedules_are_refused():
    with pytest.raises(ConfigError, match="strictly increasing"):
        Mixture.schedule([(5, {"web": 1}), (2, {"code": 1})])
    with pytest.raises(ConfigError, match="interpolate='cubic'"):
        Mixture.schedule([(0, {"web": 1})], interpolate="cubic")
    with pytest.raises(ConfigError, match="step must be an int >= 0"):
        Mixture.schedule([(-1, {"web": 1})])
    with pytest.raises(ConfigError, match="non-empty list"):
        Mixture.schedule([])
    with pytest.raises(ConfigError, match="step must be an int >= 0"):
        Mixture.constant({"web": 1}).with_override(1.5, {"web": 1})


def test_unknown_source_is_named():
    with pytest.raises(ConfigError, match=r"unknown sources \['wiki'\]"):
        Mixture.constant({"wiki": 1, "web": 1}).weights_at(0, SOURCES)


def test_from_dict_is_strict():
    d = Mixture.constant({"web": 1}).to_dict()
    with pytest.raises(ConfigError, match=r"unknown: \['extra'\]"):
        Mixture.from_dict({**d, "extra": 1})
    with pytest.raises(ConfigError, match=r"missing: \['overrides'\]"):
        Mixture.from_dict({k: v for k, v in d.items() if k != "overrides"})
    with pytest.raises(ConfigError, match="must sum to 1"):
        Mixture.from_dict({**d, "points": [[0, {"web": 0.5}]]})


weights_st = st.dictionaries(st.sampled_from(SOURCES), st.floats(0, 100), min_size=1).filter(
    lambda w: sum(w.values()) > 0
)


@settings(max_examples=60, deadline=None)
@given(
    points=st.lists(st.tuples(st.integers(0, 50), weights_st), min_size=1, max_size=4, unique_by=lambda p: p[0]),
    mode=st.sampled_from(["step", "linear"]),
    step=st.integers(0, 60),
)
def test_weights_are_a_distribution_between_the_points(points, mode, step):
    points.sort(key=lambda p: p[0])
    m = Mixture.schedule(points, interpolate=mode)
    w = m.weights_at(step, SOURCES)
    assert (w >= 0).all()
    assert w.sum() == pytest.approx(1.0)
    norm = [m.weights_at(s, SOURCES) for s, _ in points]
    lo, hi = np.min(norm, axis=0), np.max(norm, axis=0)
    assert (w >= lo - 1e-12).all()
    assert (w <= hi + 1e-12).all()


@settings(max_examples=50, deadline=None)
@given(
    overrides=st.lists(st.tuples(st.integers(0, 40), st.sampled_from(SOURCES)), max_size=8),
    since=st.integers(0, 50),
    step=st.integers(0, 60),
)
def test_since_keeps_the_weights_of_every_later_step(overrides, since, step):
    m = Mixture.schedule([(0, {"web": 1}), (20, {"books": 1, "code": 1})], interpolate="linear")
    for s, name in overrides:
        m = m.with_override(s, {name: 1})
    cut = m.since(since)
    assert len([s for s, _ in cut.overrides if s <= since]) <= 1
    if step >= since:
        assert cut.weights_at(step, SOURCES).tolist() == m.weights_at(step, SOURCES).tolist()
    assert Mixture.from_dict(json.loads(json.dumps(cut.to_dict()))) == cut
