"""Autoscaling in a real node server: a schedule shift to an expensive source is met before its first step is
planned, and the batches are the same with autoscaling on and off (test_autoscale_mixture: set_mixture).

The transforms run in the server's workers (``tests.autoscale_util:burner(ms=...)``).
"""

from __future__ import annotations

import pytest

from .autoscale_util import AUTOSCALE, SHIFT, job, status, train

STEPS = 110


def serve(server_factory, enabled: bool, workers: int):
    return server_factory(workers=workers, extra=AUTOSCALE.format(enabled=str(enabled).lower())).start()


def test_shift_is_met_ahead_and_batches_match_autoscaling_off(server_factory):
    spec = job("shift", schedule=True)
    on = serve(server_factory, True, 1)
    seen: list[dict] = []
    recs_on, _ = train(spec, on.socket, STEPS, before_close=lambda: seen.append(status(on)))
    st = seen[0]  # read while the rank is connected: once it leaves, the job and its sources close
    a = st["autoscale"]
    ups = [d for d in a["decisions"] if d["size_to"] > d["size_from"]]
    assert ups, f"no scale-up; decisions: {a['decisions']}"
    first = ups[0]
    # decided on the look-ahead: the new share was seen before the shift's first step was planned
    assert first["planned"]["shift"] <= SHIFT, a["decisions"]
    assert first["ahead"]["b"] == pytest.approx(0.9), a["decisions"]
    assert "autoscale: pool 1 -> 2 workers" in on.log()  # logged once, with its reason
    assert on.log().count(first["message"]) == 1
    b = a["sources"]["b"]
    assert set(b) >= {"workers", "partitions", "demand_samples_s", "supply_samples_s", "cpu_s_per_sample"}
    assert b["partitions"] == 1
    assert 0.0015 < b["cpu_s_per_sample"] < 0.02
    assert b["supply_samples_s"] > 0
    on.stop()

    off = serve(server_factory, False, 2)
    recs_off, _ = train(spec, off.socket, STEPS)
    st_off = status(off)
    assert st_off["autoscale"]["enabled"] is False
    assert st_off["autoscale"]["decisions"] == []
    assert st_off["workers"] == 2
    assert recs_on == recs_off  # every field of every micro-batch, through every decision above
