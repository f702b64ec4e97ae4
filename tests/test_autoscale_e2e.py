"""Autoscaling in a real node server: a schedule shift to an expensive source is met before its first step is
planned, and the batches are the same with autoscaling on and off (test_autoscale_mixture: set_mixture).

The transforms below run in the server's workers (``tests.test_autoscale_e2e:burner(ms=...)``).
"""

from __future__ import annotations

import time

import numpy as np
import pytest

import msdata_client as msd
from msdata_client.wire import request

from .e2e_util import batch_record

SHIFT = 80  # the schedule's shift to the expensive source
STEPS = 110
PACE_S = 0.01  # the simulated trainer's compute per step
AUTOSCALE = """allow_transforms = ["tests"]
[autoscale]
enabled = {enabled}
min_workers = 1
max_workers = 2
interval = 0.1
cooldown = 0.3
"""


def burner(ms: float = 1.0):
    """A transform that spends ``ms`` milliseconds of process CPU per document and returns it unchanged."""

    def fn(record, **_):
        end = time.process_time() + ms / 1e3
        while time.process_time() < end:
            pass
        return np.asarray(record)

    fn.needs_rng = False
    return fn


def burner_graph(
    name: str, *, seed: int, ms: dict[str, float], samples: int, median=100.0, sigma=0.5, min_len=8, max_len=512
) -> msd.DGraph:
    """A DGraph of synthetic sources whose transforms burn ``ms[source]`` milliseconds a document (``burner``)."""
    g = msd.DGraph(name, seed=seed)
    for src, cost in ms.items():
        g.source(
            src,
            "synthetic",
            samples=samples,
            median=median,
            sigma=sigma,
            min_len=min_len,
            max_len=max_len,
            transform=f"{__name__}:burner(ms={cost})",
        )
    return g


def job(name: str, *, schedule: bool):
    g = burner_graph(name, seed=3, ms={"a": 0.02, "b": 2.0}, samples=4000)
    if schedule:
        g.mix(schedule=[(0, {"a": 0.98, "b": 0.02}), (SHIFT, {"a": 0.1, "b": 0.9})])
    else:
        g.mix({"a": 0.98, "b": 0.02})
    g.pack(512, rows=1, micro_batches=2).mesh(dp=1).prefetch(2)
    return g.plan()


def train(
    spec, endpoint: str, steps: int, *, mixture_at: int | None = None, before_close=None
) -> tuple[list[dict], int | None]:
    """One rank, one step per PACE_S of compute; the batch records (and the step a set_mixture took effect).
    ``before_close()`` runs while the rank is still connected (the job, and its sources, still exist)."""
    recs, cut = [], None
    with msd.DataClient(spec, endpoint=endpoint, rank=0, world_size=1, connect_timeout=30) as dc:
        for step in range(steps):
            if step == mixture_at:
                cut = dc.set_mixture({"a": 0.1, "b": 0.9})
            for _ in range(spec.micro_batches):
                b = next(dc)
                recs.append(batch_record(b))
                del b
            time.sleep(PACE_S)
        if before_close is not None:
            before_close()
    return recs, cut


def status(server) -> dict:
    return request(server.socket, {"t": "status"}, timeout=30)["status"]


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
    assert first["planned"]["shift"] <= SHIFT and first["ahead"]["b"] == pytest.approx(0.9), a["decisions"]
    assert "autoscale: pool 1 -> 2 workers" in on.log()  # logged once, with its reason
    assert on.log().count(first["message"]) == 1
    b = a["sources"]["b"]
    assert set(b) >= {"workers", "partitions", "demand_samples_s", "supply_samples_s", "cpu_s_per_sample"}
    assert b["partitions"] == 1 and 0.0015 < b["cpu_s_per_sample"] < 0.02 and b["supply_samples_s"] > 0
    on.stop()

    off = serve(server_factory, False, 2)
    recs_off, _ = train(spec, off.socket, STEPS)
    st_off = status(off)
    assert st_off["autoscale"]["enabled"] is False and st_off["autoscale"]["decisions"] == []
    assert st_off["workers"] == 2
    assert recs_on == recs_off  # every field of every micro-batch, through every decision above
