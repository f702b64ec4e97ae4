"""``planner.history.StateHistory``: the newest ``keep`` states by step, in step order, forgotten from the oldest."""

from __future__ import annotations

from msdata_server.planner.history import StateHistory


def test_record_keeps_the_newest_steps_in_order_and_forgets_from_the_oldest():
    h = StateHistory(4)
    for step in range(10):
        h.record(step, {"step": step})
    assert list(h.states) == [6, 7, 8, 9]
    assert len(h) == 4
    assert h[9] == {"step": 9}
    assert h.newest() == {"step": 9}
    assert h.oldest() == 6
    assert h.span() == "6..9"
    assert h.window(7, 9) == ((7, {"step": 7}), {8: {"step": 8}})


def test_a_step_recorded_out_of_order_keeps_the_order_and_the_bound():
    """Ranks that rejoin behind the steps a node holds record an older step: the states stay in step order, so
    the oldest are still the ones forgotten."""
    h = StateHistory(4)
    for step in (5, 6, 7):
        h.record(step, {"step": step})
    h.record(4, {"step": 4})
    assert list(h.states) == [4, 5, 6, 7]
    h.record(8, {"step": 8})
    assert list(h.states) == [5, 6, 7, 8]


def test_forget_from_drops_the_cut_steps_and_later_records_stay_in_order():
    h = StateHistory(8)
    for step in range(6):
        h.record(step, {"step": step})
    h.forget_from(3)
    assert list(h.states) == [0, 1, 2]
    assert 3 not in h
    h.record(3, {"step": "3 again"})
    assert list(h.states) == [0, 1, 2, 3]
    assert h.get(3) == {"step": "3 again"}
