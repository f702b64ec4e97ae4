"""The autoscaler's pure core: look-ahead over the mixture, demand, the decision rule's hysteresis and
cooldown, apportionment, the consumption meter, and the [autoscale] configuration."""

from __future__ import annotations

import itertools
import math

import numpy as np
import pytest

import msdata_server.autoscale as autoscale
from msdata_server.autoscale import (
    ConsumptionMeter,
    Counters,
    Policy,
    PolicyConfig,
    SourceDemand,
    SourceProfile,
    apportion,
    lookahead_shares,
)
from msdata_server.autoscale.demand import horizon_steps, source_demand
from msdata_server.config import parse_config
from msdata_server.errors import ConfigError
from msdata_server.planner.mixture import Mixture

from .autoscale_util import demand


def test_all_is_sorted_and_importable():
    assert autoscale.__all__ == sorted(autoscale.__all__)
    assert all(hasattr(autoscale, n) for n in autoscale.__all__)


def test_noisy_demand_around_a_threshold_does_not_flap():
    """need x 1.25 wobbles +-10% around 2.0 workers for 500 intervals: the pool goes to 3 once and stays."""
    pol = Policy(PolicyConfig(min_workers=1, max_workers=8, headroom=0.25, cooldown_s=1.0), 2)
    rng = np.random.default_rng(0)
    sizes = []
    for i in range(500):
        need = 1.6 * (1 + rng.uniform(-0.1, 0.1))
        pol.decide(i * 0.1, {"img": demand("img", need)})
        sizes.append(pol.size)
    changes = sum(a != b for a, b in itertools.pairwise(sizes))
    assert changes <= 1, sizes[:40]
    assert sizes[-1] == 3, sizes[:40]


def test_scale_down_waits_for_the_cooldown_and_idle_gives_everything_back():
    pol = Policy(PolicyConfig(min_workers=1, max_workers=8, headroom=0.0, cooldown_s=2.0), 1)
    dec = pol.decide(0.0, {"img": demand("img", 3.5)})
    assert dec is not None
    assert (dec.size_from, dec.size_to) == (1, 4)
    assert pol.workers == {"img": 4}
    assert "3.50 workers" in dec.reason
    # demand falls at t=1: nothing for 2 s (and not within 2 s of the last change), then down in one step
    got = [(t, pol.decide(t, {"img": demand("img", 1.0)})) for t in np.arange(1.0, 4.0, 0.25)]
    changed = [(t, d.size_to) for t, d in got if d is not None]
    assert changed == [(3.0, 2)]  # 1.0 / (1 - band) needs 2 with the hysteresis band
    # no job at all: idle, back to min_workers after the cooldown
    dec = pol.decide(3.5, {})
    assert dec is not None
    assert dec.size_to == 2
    assert dec.changes() == {"img": (2, 0)}
    assert dec.reason == "source img has none (its job left)"
    dec = pol.decide(5.5, {})
    assert dec is not None
    assert dec.size_to == 1
    assert "no demand" in dec.reason
    assert pol.workers == {}


def test_an_unmeasured_demand_holds_the_workers():
    pol = Policy(PolicyConfig(min_workers=1, max_workers=4, cooldown_s=0.5), 3)
    for t in range(10):
        assert pol.decide(float(t), {}, hold=True) is None
    assert pol.size == 3


def test_a_source_drawn_before_its_cost_was_measured_is_drawn_again_once_it_is():
    """Two sources arrive; a cheap one's cost is not measured yet (its need counts as 0), so the costly one gets
    the whole pool. When the cheap one's cost comes in it is drawn again, however small its need (less than the
    drift band: before, it stayed at 0 workers for good, and a mixture change later found the costly source
    already holding everything, as a loaded CI machine showed). Only the first measurement redraws."""
    pol = Policy(PolicyConfig(min_workers=1, max_workers=2, cooldown_s=600.0), 2)
    unknown = SourceDemand(name="a", samples_s=600.0, worker_s_per_sample=None, share_now=0.98, share_ahead=0.98)
    dec = pol.decide(0.0, {"a": unknown, "b": demand("b", 0.05, 0.02)})
    assert dec is not None
    assert pol.workers == {"a": 0, "b": 2}
    cheap = demand("a", 0.03, 0.98)  # well inside the band (0.15 of a worker) of its need of 0 so far
    dec = pol.decide(0.1, {"a": cheap, "b": demand("b", 0.05, 0.02)})
    assert dec is not None
    assert pol.workers == {"a": 1, "b": 1}
    assert dec.changes() == {"a": (0, 1), "b": (2, 1)}
    assert dec.reason == "source a's cost is measured"
    assert pol.decide(0.2, {"a": demand("a", 0.031, 0.98), "b": demand("b", 0.05, 0.02)}) is None


def test_apportion_is_largest_remainder_and_sums_to_the_total():
    assert apportion(3, {"a": 1.6, "b": 0.9, "c": 0.5}) == {"a": 2, "b": 1, "c": 0}
    assert apportion(4, {"a": 0.0, "b": 0.0}) == {"a": 2, "b": 2}
    assert apportion(0, {"a": 1.0}) == {"a": 0}
    for total in range(1, 9):
        assert sum(apportion(total, {"x": 0.3, "y": 2.2, "z": 1.1}).values()) == total


def test_the_look_ahead_sees_a_schedule_shift_before_its_first_step_is_planned():
    """The planner's cursor walks towards a shift at step 60; with a horizon of h steps the decision rule sees the
    new share and scales up when the cursor is at 60 - h, i.e. before step 60 is planned."""
    mix = Mixture.schedule(
        [(0, {"text": 0.9, "image": 0.1}), (60, {"text": 0.3, "image": 0.7}), (120, {"text": 0.9, "image": 0.1})]
    )
    sources = ("image", "text")
    pol = Policy(PolicyConfig(min_workers=1, max_workers=8, headroom=0.25, cooldown_s=5.0), 1)
    rate = 10.0  # steps/s; a decision every 0.5 s: horizon covers two intervals and the spin-up
    h = horizon_steps(rate, 2 * 0.5 + 0.2)
    assert h == 12
    up_at = down_at = None
    for step in range(0, 140, 5):  # the planner's cursor at each decision
        shares = lookahead_shares(mix, sources, step, h)
        now = lookahead_shares(mix, sources, step, 0)
        d = {
            n: source_demand(
                n,
                steps_per_s=rate,
                tokens_per_step=16384,
                share_now=now[n],
                share_ahead=shares[n],
                tokens_per_sample=630.0 if n == "image" else 600.0,
                worker_s_per_sample=0.008 if n == "image" else 0.0001,
            )
            for n in sources
        }
        dec = pol.decide(step / rate, d)
        if dec is not None and dec.size_to > dec.size_from and up_at is None:
            up_at = step
            # 0.7 x 16384 / 630 images a step x 10 steps/s x 8 ms = 1.46 workers; x 1.25 headroom -> 2
            assert dec.size_to == 2
            assert pol.workers == {"image": 2, "text": 0}
        if dec is not None and dec.size_to < dec.size_from and down_at is None:
            down_at = step
            assert "from the mixture ahead" in dec.reason  # a scheduled fall needs no cooldown of low demand
    assert up_at is not None
    assert 60 - h <= up_at < 60
    assert down_at == 120
    assert pol.size == 1


def test_a_set_mixture_override_moves_the_look_ahead():
    mix = Mixture.constant({"a": 0.9, "b": 0.1})
    assert lookahead_shares(mix, ("a", "b"), 10, 5) == pytest.approx({"a": 0.9, "b": 0.1})
    over = mix.with_override(20, {"a": 0.2, "b": 0.8})
    assert lookahead_shares(over, ("a", "b"), 10, 5)["b"] == pytest.approx(0.1)  # not yet within the horizon
    assert lookahead_shares(over, ("a", "b"), 16, 5) == pytest.approx({"a": 0.9, "b": 0.8})  # both, at most


def test_consumption_meter_counts_compute_not_waiting():
    m = ConsumptionMeter(tau=1.0)
    assert m.observe(0.0, 0, 0.0) is None
    # 10 steps per second of wall time, half of it waiting for data: the trainer computes 20 steps/s
    for i in range(1, 20):
        rate = m.observe(i * 1.0, 10 * i, 0.5 * i)
    assert rate == pytest.approx(20.0)
    # a report that was nearly all waiting cannot claim more than 10x the wall rate
    m2 = ConsumptionMeter(tau=1.0)
    m2.observe(0.0, 0, 0.0)
    assert m2.observe(1.0, 5, 1.0) == pytest.approx(50.0)


def test_profile_smooths_ratios_and_survives_a_counter_reset():
    p = SourceProfile(tau=2.0)
    p.observe(0.0, Counters())
    p.observe(1.0, Counters(samples_transformed=100, cpu_s=1.0, worker_s=1.2, samples_read=100, tokens_read=5000))
    f = p.figures()
    assert f.cpu_s_per_sample == pytest.approx(0.01)
    assert f.tokens_per_sample == pytest.approx(50.0)
    assert f.supply_samples_s == pytest.approx(100.0)
    assert f.worker_s_per_sample == pytest.approx(0.012)
    p.observe(2.0, Counters())  # the loaders are new (a job restarted): a new baseline, no sample
    p.observe(3.0, Counters(samples_transformed=100, cpu_s=3.0, worker_s=3.0, samples_read=100, tokens_read=5000))
    f = p.figures()
    assert 0.01 < f.cpu_s_per_sample < 0.03  # moved towards 0.03, smoothed
    idle = SourceProfile(tau=2.0)
    idle.observe(0.0, Counters())
    idle.observe(1.0, Counters())
    assert idle.figures().cpu_s_per_sample is None  # nothing measured: no figure, not 0


def test_config_defaults_and_validation():
    cfg = parse_config({"node": {"workers": 2}})
    a = cfg.autoscale
    assert a.enabled is True
    assert a.min_workers == 1
    assert a.max_size >= 1
    assert a.cooldown_s == 3 * a.interval
    cfg = parse_config({"autoscale": {"enabled": False, "min_workers": 2, "max_workers": 4, "interval": 0.5}})
    assert cfg.autoscale.enabled is False
    assert cfg.autoscale.max_size == 4
    bad = [
        ({"enabled": "yes"}, r"\[autoscale\] enabled = 'yes' must be true or false"),
        ({"min_workers": 0}, r"\[autoscale\] min_workers = 0 must be an integer in \[1, 1024\]"),
        ({"min_workers": 4, "max_workers": 2}, r"max_workers = 2 is below min_workers = 4; raise max_workers"),
        ({"interval": 0}, r"\[autoscale\] interval = 0 must be a number in \[0.01, 3600\]"),
        ({"workers": 2}, r"unknown key\(s\) \['workers'\] in \[autoscale\]"),
    ]
    for table, match in bad:
        with pytest.raises(ConfigError, match=match):
            parse_config({"autoscale": table})
    with pytest.raises(ConfigError, match=r"\[autoscale\] must be a table"):
        parse_config({"autoscale": 3})


def test_policy_config_bounds():
    with pytest.raises(ValueError, match="min_workers"):
        PolicyConfig(min_workers=3, max_workers=2)
    assert PolicyConfig(min_workers=1, max_workers=4).clamp(9) == 4
    assert math.isclose(demand("x", 1.5).workers, 1.5)


def test_status_table_shows_every_source():
    from msdata_server.ops.scaletable import autoscale_table

    a = {
        "enabled": True,
        "size": 3,
        "min_workers": 1,
        "max_workers": 8,
        "worker_s": 42.0,
        "sources": {
            "image": {
                "workers": 2,
                "partitions": 1,
                "demand_samples_s": 180.5,
                "supply_samples_s": 190.0,
                "cpu_s_per_sample": 0.0086,
                "share": 0.1,
                "share_ahead": 0.7,
            },
            "text": {
                "workers": 1,
                "partitions": 2,
                "demand_samples_s": 900.0,
                "supply_samples_s": 950.0,
                "cpu_s_per_sample": None,
                "share": 0.9,
                "share_ahead": 0.9,
            },
        },
        "decisions": [{"message": "pool 1 -> 3 workers: demand needs 2.40 workers (with headroom) > 1"}],
    }
    lines = autoscale_table(a)
    assert lines[0] == "autoscale on: pool 3 workers (min 1, max 8), 42 worker-s"
    assert lines[1].split() == ["source", "workers", "parts", "demand/s", "supply/s", "cpu", "ms/sample", "share",
                                "ahead"]  # fmt: skip
    assert lines[2].split() == ["image", "2", "1", "180.5", "190.0", "8.600", "0.10", "0.70"]
    assert lines[3].split() == ["text", "1", "2", "900.0", "950.0", "-", "0.90", "0.90"]
    assert lines[4].endswith("demand needs 2.40 workers (with headroom) > 1")
    assert autoscale_table({"enabled": False, "sources": {}}) == ["autoscale off (fixed pool)"]
    assert autoscale_table(None) == []


def test_the_pace_counts_from_the_jobs_start_when_ranks_ran_before_the_first_look():
    """Ranks that pulled all they will (a pause, an eval phase) before the autoscaler first looked at the job
    still give a pace: the job's start is the meter's first point (without it: None forever, no demand)."""
    m = ConsumptionMeter()
    m.observe(10.0, 0, 0.0)  # the job started at t=10, step 0 (JobSignals.started)
    assert m.observe(12.0, 5, 0.0) == pytest.approx(2.5)
    blind = ConsumptionMeter()
    assert blind.observe(12.0, 5, 0.0) is None
    assert blind.observe(12.5, 5, 0.0) is None
