"""WaitStats: data-wait figures per rank against known waits, on an injected clock."""

from __future__ import annotations

import orjson
import pytest

from msdata_server.errors import ProtocolError
from msdata_server.ops.waits import WaitStats


class Clock:
    def __init__(self) -> None:
        self.t = 100.0

    def __call__(self) -> float:
        return self.t


def test_totals_and_percentiles_of_known_waits():
    ws = WaitStats(clock=Clock())
    ws.record(0, [i / 1000 for i in range(1, 51)])
    ws.record(0, [i / 1000 for i in range(51, 101)], step=7)  # 1..100 ms in two reports
    d = ws.snapshot()["0"]
    assert d["delivered"] == 100
    assert d["wait_s"] == pytest.approx(5.05)
    assert d["wait_p50_s"] == 0.050
    assert d["wait_p99_s"] == 0.099
    assert d["step"] == 7


def test_percentiles_cover_only_the_newest_window():
    ws = WaitStats(window=10, clock=Clock())
    ws.record(3, [10.0] * 90 + [0.001 * i for i in range(1, 11)])
    d = ws.snapshot()["3"]
    assert d["wait_p99_s"] == 0.010
    assert d["wait_p50_s"] == 0.005
    assert d["delivered"] == 100
    assert d["wait_s"] == pytest.approx(900.055)


def test_wait_fraction_is_waited_over_wall_time_since_the_first_report():
    clock = Clock()
    ws = WaitStats(clock=clock)
    ws.record(1, [0.5])  # covers time before the first report: not part of the fraction
    assert ws.snapshot()["1"]["wait_frac"] is None  # no wall time yet
    clock.t += 10
    ws.record(1, [1.0, 1.0])
    clock.t += 10
    ws.record(1, [0.5, 0.5])
    d = ws.snapshot()["1"]
    assert d["wait_frac"] == pytest.approx(3.0 / 20)
    assert d["wait_s"] == pytest.approx(3.5)
    assert d["delivered"] == 5
    assert "step" not in d


def test_snapshot_is_json_ready_sorted_by_rank_and_forgets():
    ws = WaitStats(clock=Clock())
    for r in (10, 2, 0):
        ws.record(r, [])
    snap = ws.snapshot()
    assert list(snap) == ["0", "2", "10"]
    assert snap["2"] == {
        "delivered": 0,
        "micro_batches_delivered": 0,
        "wait_s": 0.0,
        "wait_p50_s": None,
        "wait_p99_s": None,
        "wait_frac": None,
    }
    assert orjson.loads(orjson.dumps(snap)) == snap
    ws.forget(2)
    ws.forget(99)
    assert list(ws.snapshot()) == ["0", "10"]


@pytest.mark.parametrize(
    ("waits", "match"), [([0.1, -1.0], r"\[-1\.0\].*>= 0"), ([float("nan")], "finite"), (["soon"], "not numbers")]
)
def test_a_bad_report_is_a_protocol_error_and_changes_nothing(waits, match):
    ws = WaitStats(clock=Clock())
    with pytest.raises(ProtocolError, match=match):
        ws.record(0, waits)
    assert ws.snapshot() == {}


def test_window_must_be_positive():
    with pytest.raises(ValueError, match="window=0"):
        WaitStats(window=0)
