"""The pure replay core: plans replayed from a saved state equal the ones planned, across a run-time mixture
change and a deferral; rows sit where the batch builder puts them; the accounting of a state."""

from __future__ import annotations

import numpy as np
import pytest

from msdata_server.errors import CheckpointError
from msdata_server.lineage.replay import replay
from msdata_server.lineage.rows import plan_columns
from msdata_server.planner import Mixture, Planner, PlannerConfig
from msdata_server.planner.accounting import accounting
from msdata_server.planner.deferred import Deferred, Insert
from msdata_server.planner.history import StateHistory, held_window


class Lengths:
    """Lengths as a pure function of (source, ordinal); every 37th sample of source 1 is bad (0)."""

    def lengths(self, source: int, start: int, count: int) -> np.ndarray:
        o = np.arange(start, start + count, dtype=np.int64)
        out = (o * 7919 + source * 104729) % (300 + 400 * source) + 1
        if source == 1:
            out[o % 37 == 5] = 0
        return out


class Flat:
    """``rows.Locate`` of one file per source, ordinal = row."""

    def locate(self, source, ordinals):
        o = np.asarray(ordinals, np.int64)
        return np.zeros_like(o), np.zeros_like(o), o

    def files(self, source):
        return [f"s{source}"]


CFG = PlannerConfig(
    sources=("a", "b"), seq_len=512, dp=3, micro_batches=2, rows=2, mixture=Mixture.constant({"a": 0.5, "b": 0.5})
)


def same(p, q) -> bool:
    return p.step == q.step and all(
        np.array_equal(getattr(p, k), getattr(q, k))
        for k in ("source", "ordinal", "offset", "length", "group", "micro", "row", "last")
    )


def test_replay_from_any_saved_state_follows_a_mixture_cut():
    view, history = Lengths(), StateHistory(64)
    planner, plans = Planner(CFG), []
    for _ in range(12):
        history.record(planner.step, planner.state_dict())
        if planner.step == 6:  # set_mixture cut at step 6: the states from there carry the new weights
            planner = history.rebase(planner, 6, {"a": 0.9, "b": 0.1})
        plans.append(planner.plan_step(view))
    for start in (0, 3, 6, 9):
        base, held = held_window(history.states, start, 12)
        assert base is not None
        assert base[0] == start
        got = list(replay(CFG, base[1], view, start, 12, held))
        assert [p.step for p in got] == list(range(start, 12))
        assert all(same(p, q) for p, q in zip(got, plans[start:]))
    # from the beginning, without the held states, the cut is unknown: the later plans differ
    assert not all(same(p, q) for p, q in zip(replay(CFG, None, view, 0, 12), plans))
    with pytest.raises(CheckpointError, match="at or before"):
        list(replay(CFG, history.states[9], view, 3, 12))


def test_rows_are_placed_back_to_back_in_their_rows():
    plan = Planner(CFG).plan_step(Lengths())
    cols = plan_columns(plan, Flat(), seq_len=CFG.seq_len, micro_batches=CFG.micro_batches, rows=CFG.rows)
    key = list(zip(cols["dp_rank"].tolist(), cols["micro"].tolist(), cols["row"].tolist()))
    fill: dict = {}
    for k, off, n in zip(key, cols["offset"].tolist(), cols["length"].tolist()):
        assert off == fill.get(k, 0)  # each piece starts where the one before it in the row ended
        fill[k] = off + n
    assert max(fill.values()) <= CFG.seq_len
    assert np.array_equal(cols["piece"], cols["doc_offset"] // CFG.seq_len)
    one = plan_columns(plan, Flat(), seq_len=CFG.seq_len, micro_batches=CFG.micro_batches, rows=CFG.rows, group=1)
    assert set(one["dp_rank"].tolist()) == {1}
    assert np.array_equal(one["offset"], cols["offset"][cols["dp_rank"] == 1])


def test_a_deferred_insert_is_read_at_its_place_in_real_ordinals():
    d = Deferred(
        (Insert(source=0, at=10, ordinal=np.array([3, 4]), offset=np.array([0, 512]), length=np.array([7, 9])),)
    )
    ords, base, lens = d.real(0, np.arange(8, 14))
    assert ords.tolist() == [8, 9, 3, 4, 10, 11]
    assert base.tolist() == [0, 0, 0, 512, 0, 0]
    assert lens.tolist() == [-1, -1, 7, 9, -1, -1]
    assert d.view(Lengths()).lengths(0, 8, 6).tolist() == [
        *Lengths().lengths(0, 8, 2),
        7,
        9,
        *Lengths().lengths(0, 10, 2),
    ]
    assert d.virtual(0, 10) == 12
    assert d.real_cursor(0, 11) == 10
    assert d.real_cursor(0, 9) == 9
    assert d.real(1, np.arange(8, 12)).__getitem__(0).tolist() == [8, 9, 10, 11]  # another source: unchanged
    assert Deferred.from_list(d.to_list(), 2).to_list() == d.to_list()
    with pytest.raises(CheckpointError, match="malformed insert"):
        Deferred.from_list([{"source": 5, "at": 0, "ordinal": [], "offset": [], "length": []}], 2)


def test_accounting_of_a_state_counts_tokens_documents_and_bad_samples():
    view, planner = Lengths(), Planner(CFG)
    plans = [planner.plan_step(view) for _ in range(6)]
    state = planner.state_dict()
    acc = accounting(state, CFG.sources, {"a": 1000, "b": 1000})
    for s, name in enumerate(CFG.sources):
        tokens = sum(int(p.length[p.source == s].sum()) for p in plans)
        assert acc[name]["tokens_delivered"] == tokens > 0
        carried = {int(o) for o, src in zip(state["carry"]["ordinal"], state["carry"]["source"]) if src == s}
        docs = {int(o) for p in plans for o in p.ordinal[p.source == s]} - carried
        assert acc[name]["docs_delivered"] == len(docs)
        bad = sum(1 for o in range(state["cursor"][s]) if s == 1 and o % 37 == 5)
        assert acc[name]["bad_samples"] == bad
        assert acc[name]["epochs_completed"] == 0
    assert acc["b"]["bad_samples"] > 0


def test_replay_from_the_thinned_states_of_a_history_follows_a_mixture_cut():
    """Beyond its newest ``keep`` steps a history keeps every ``every``-th state and every state where more than the
    per-step counters changed (here the mixture cut at 7, not a multiple of 4): a replay of any older step from the
    state it finds there plans what the job planned, across the cut."""
    view, history = Lengths(), StateHistory(2, every=4, sparse=16)
    planner, plans = Planner(CFG), []
    for _ in range(20):
        history.record(planner.step, planner.state_dict())
        if planner.step == 7:
            planner = history.rebase(planner, 7, {"a": 0.9, "b": 0.1})
        plans.append(planner.plan_step(view))
    assert list(history.states) == [18, 19]
    assert list(history.sparse) == [0, 4, 7, 8, 12, 16]  # 7: the cut
    for start in range(0, 16):
        base, held = history.window(start, 18)
        assert base is not None
        assert base[0] == max(s for s in (0, 4, 7, 8, 12, 16) if s <= start)
        assert 7 in held or start >= 7
        got = list(replay(CFG, base[1], view, start, 18, held))
        assert [p.step for p in got] == list(range(start, 18))
        assert all(same(p, q) for p, q in zip(got, plans[start:18]))
