"""Piece reference counts and the planner's ``last`` flag: a payload is freed once, when its last piece is built."""

from __future__ import annotations

import numpy as np

from msdata_server.job.pieces import PieceRefs
from msdata_server.planner import Mixture, Planner, PlannerConfig


def arr(*xs):
    return np.asarray(xs, dtype=np.int64)


def test_a_document_spanning_steps_is_freed_after_its_last_piece():
    refs = PieceRefs()
    # step s: two pieces of doc (0, 7), more carried over; one whole doc (1, 3)
    assert refs.plan(arr(0, 0, 1), arr(7, 7, 3), np.array([False, False, True])) == []
    assert refs.done(arr(0, 1), arr(7, 3)) == [(1, 3)]
    assert refs.done(arr(0), arr(7)) == []  # its carried pieces are still to come
    assert refs.pinned(0) == 0
    assert len(refs) == 0
    # step s+1: the last piece
    refs.plan(arr(0), arr(7), np.array([True]))
    assert refs.pinned(0) == 1
    assert refs.done(arr(0), arr(7)) == [(0, 7)]
    assert len(refs) == 0


def test_served_before_counted_and_plans_taken_back():
    refs = PieceRefs()
    # a remote builder fetched it before the plan reached the owner: freed when the plan is counted
    assert refs.done(arr(2), arr(5)) == []
    assert refs.plan(arr(2), arr(5), np.array([True])) == [(2, 5)]
    # weights: two building nodes each fetch once
    refs.plan(arr(2), arr(6), np.array([True]), [2])
    assert refs.done(arr(2), arr(6)) == []
    assert refs.done(arr(2), arr(6)) == [(2, 6)]
    # a plan cut by a mixture change is taken back: nothing freed, nothing pinned
    refs.plan(arr(3, 3), arr(1, 2), np.array([True, False]))
    refs.unplan(arr(3, 3), arr(1, 2), np.array([True, False]))
    assert len(refs) == 0
    # a piece nobody builds (weight 0) frees its document once it is the last
    assert refs.plan(arr(4), arr(9), np.array([True]), [0]) == [(4, 9)]


def test_planner_marks_the_last_piece_of_every_document():
    """Over many steps of long documents, each document's pieces appear once each, and the flag is set exactly
    on the pieces of the step after which none of it is carried."""
    seq_len = 64

    class View:
        def lengths(self, source, start, count):
            rng = np.random.default_rng(source * 1000003 + start)
            return rng.integers(1, 8 * seq_len, size=count).astype(np.int64)

    cfg = PlannerConfig(
        sources=("a", "b"),
        seq_len=seq_len,
        dp=2,
        micro_batches=2,
        rows=1,
        mixture=Mixture.constant({"a": 0.5, "b": 0.5}),
    )
    planner = Planner(cfg)
    seen: dict[tuple[int, int], list[tuple[int, bool]]] = {}
    spanning = 0
    for _ in range(60):
        plan = planner.plan_step(View())
        for s, o, f in zip(plan.source.tolist(), plan.ordinal.tolist(), plan.last.tolist()):
            seen.setdefault((s, o), []).append((plan.step, f))
    carry = planner.state_dict()["carry"]
    carried = {(s, o) for s, o in zip(carry["source"], carry["ordinal"])}
    for key, occ in seen.items():
        steps = sorted({st for st, _ in occ})
        spanning += len(steps) > 1
        last_step = max(steps)
        for st, f in occ:
            assert f == (st == last_step and key not in carried), (key, occ)
    assert spanning > 10  # the workload does spread documents over steps
