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


def _state(step: int, mixture: str = "m") -> dict:
    return {"step": step, "cursor": [step], "mixture": mixture}


def test_older_states_are_thinned_to_every_nth_and_the_changes_and_bounded():
    h = StateHistory(4, every=8, sparse=3)
    for step in range(40):
        h.record(step, _state(step, "m" if step < 21 else "n"))
    assert list(h.states) == [36, 37, 38, 39]
    assert list(h.sparse) == [21, 24, 32]  # 0, 8 and 16 forgotten beyond sparse=3; 21: the mixture changed there
    base, held = h.window(30, 34)
    assert base == (24, _state(24, "n"))
    assert held == {32: _state(32, "n")}
    assert h.window(37, 39) == ((37, _state(37, "n")), {38: _state(38, "n")})  # the newest: as before
    assert h.window(20, 22) == (None, {21: _state(21, "n")})  # older than every state kept
    h.forget_from(24)
    assert list(h.sparse) == [21]
    assert not h.states


def test_a_history_without_thinned_states_keeps_only_the_newest():
    h = StateHistory(4, sparse=0)
    for step in range(40):
        h.record(step, _state(step))
    assert not h.sparse
    assert h.window(20, 22) == (None, {})
