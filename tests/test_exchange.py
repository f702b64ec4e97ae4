"""Paired exchange (planner/exchange.py): rounds of moves and swaps between heavy and light ranks lower the worst
rank's largest normalised stage load, never raise it, keep every running total of the Rows exact, keep pieces
within their rows, and are a pure function of their input; so do the text trades (one long text piece for a row's
short ones), which also leave every rank's other stages as they were."""

from __future__ import annotations

import numpy as np
import pytest

from msdata_server.planner.exchange import pair_exchange, text_trades
from msdata_server.planner.layout import Layout
from msdata_server.planner.rows import Rows
from msdata_server.planner.stages import encoder_load, exchange_stages


def _random_rows(seed: int, dp: int, micro: int = 2, rows: int = 2, seq_len: int = 2048) -> tuple[Rows, np.ndarray]:
    """Pieces dealt to ranks and rows next-fit in a random order (unbalanced on purpose), with encoder costs on
    about half of them."""
    rng = np.random.default_rng(seed)
    lay = Layout(dp=dp, micro=micro, rows=rows, seq_len=seq_len)
    n = dp * lay.slots * 12
    lengths = np.clip(rng.lognormal(np.log(seq_len / 16), 1.0, n).astype(np.int64), 1, seq_len)
    costs = lengths.astype(np.float64) ** 2 + 4096.0 * lengths
    vision = np.where(rng.random(n) < 0.5, rng.lognormal(np.log(4e5), 1.2, n), 0.0)
    st = Rows(lengths, costs, lay)
    for p in rng.permutation(n).tolist():  # each to a random rank, if a row of it has room (else left over)
        st.put(np.array([p]), np.array([int(rng.integers(dp))]), 0.0)
    return st, vision


def _check_totals(st: Rows) -> None:
    lay, placed = st.lay, st.rank >= 0
    r, w = st.rank[placed], st.slot[placed]
    used = np.bincount(r * lay.slots + w, st.L[placed], minlength=lay.dp * lay.slots).reshape(lay.dp, lay.slots)
    assert (used <= lay.seq_len).all()  # every row within seq_len
    np.testing.assert_array_equal(st.rem, lay.seq_len - used)
    np.testing.assert_array_equal(st.maxrem, st.rem.max(axis=1))
    np.testing.assert_array_equal(st.rtok, lay.slots * lay.seq_len - used.sum(axis=1))
    np.testing.assert_allclose(st.rcost, np.bincount(r, st.c[placed], minlength=lay.dp), rtol=1e-9)
    mi = r * lay.micro + st.micro_of[w]
    np.testing.assert_allclose(
        st.mcost.reshape(-1), np.bincount(mi, st.c[placed], minlength=lay.dp * lay.micro), rtol=1e-9
    )


def _worst(st: Rows, vision: np.ndarray, scale: np.ndarray) -> float:
    return float(np.maximum(st.rcost * scale[0], encoder_load(st, vision) * scale[1]).max())


@pytest.mark.parametrize(("seed", "dp"), [(0, 2), (1, 8), (2, 33), (3, 64)])
def test_rounds_lower_the_worst_rank_and_keep_the_rows_exact(seed, dp):
    st, vision = _random_rows(seed, dp)
    placed = st.rank >= 0
    scale = 1.0 / np.array([st.rcost.mean(), encoder_load(st, vision).mean()])
    before = _worst(st, vision, scale)
    n_placed = int(placed.sum())
    changed = pair_exchange(st, np.stack([st.c, vision]), scale, rounds=24)
    _check_totals(st)
    assert int((st.rank >= 0).sum()) == n_placed  # pieces move, none is dropped
    after = _worst(st, vision, scale)
    assert after <= before * (1 + 1e-12)
    assert changed > 0
    assert after < before * 0.97
    assert pair_exchange(st, np.stack([st.c, vision]), scale, rounds=0) == 0


def test_a_one_stage_load_balances_too():
    st, _ = _random_rows(5, 16)
    scale = np.array([1.0 / st.rcost.mean()])
    top = float(st.rcost.max())
    pair_exchange(st, st.c[None, :], scale, rounds=16)
    _check_totals(st)
    assert float(st.rcost.max()) < top


def test_the_exchange_is_a_pure_function_of_its_input():
    runs = []
    for _ in range(2):
        st, vision = _random_rows(7, 24)
        exchange_stages(st, vision, 16)
        runs.append((st.rank.copy(), st.slot.copy(), st.rcost.copy()))
    for a, b in zip(*runs):
        np.testing.assert_array_equal(a, b)


def test_one_rank_or_nothing_placed_changes_nothing():
    st, vision = _random_rows(9, 1)
    rank = st.rank.copy()
    assert pair_exchange(st, np.stack([st.c, vision]), np.ones(2), rounds=8) == 0
    np.testing.assert_array_equal(st.rank, rank)
    lay = Layout(dp=4, micro=1, rows=1, seq_len=64)
    empty = Rows(np.array([8], np.int64), np.array([1.0]), lay)
    assert exchange_stages(empty, np.array([0.0]), 8) == 0


def _full_of_short_text(seed: int) -> tuple[Rows, np.ndarray]:
    """Ranks 0-3 hold a long text piece and an image in each row, with room left; ranks 4-7 rows full of short text
    pieces (no token free), far lighter in the backbone: no move fits a light rank, and a one-for-one swap cannot
    move the backbone cost that differs (a long piece costs more per token than the short ones it displaces)."""
    rng = np.random.default_rng(seed)
    lay = Layout(dp=8, micro=2, rows=1, seq_len=8192)
    lengths, rank, slot = [], [], []
    for r in range(4):
        for w in range(2):
            lengths += [int(rng.integers(5000, 7000)), 600]
            rank += [r, r]
            slot += [w, w]
    for r in range(4, 8):  # every row filled exactly with short pieces
        for w in range(2):
            parts = rng.integers(50, 200, 120)
            parts = parts[np.cumsum(parts) < lay.seq_len]
            parts = np.append(parts, lay.seq_len - parts.sum())
            lengths += parts.tolist()
            rank += [r] * parts.size
            slot += [w] * parts.size
    lengths = np.array(lengths, np.int64)
    costs = lengths.astype(np.float64) ** 2 + 4096.0 * lengths
    vision = np.zeros(lengths.size)
    vision[1:16:2] = 1e5  # the image pieces of ranks 0-3
    last = np.flatnonzero(np.diff(np.append(rank, lay.dp)) != 0)  # each rank's last piece
    vision[last[4:]] = 2e5  # and one piece of each light rank: every rank at the mean encoder load
    st = Rows(lengths, costs, lay)
    for p, (r, w) in enumerate(zip(rank, slot)):
        st.rem[r, w] -= lengths[p]
        st.rank[p], st.slot[p] = r, w
    st.rtok = st.rem.sum(axis=1)
    st.maxrem = st.rem.max(axis=1)
    st.rcost = np.bincount(st.rank, costs, minlength=lay.dp)
    mi = st.rank * lay.micro + st.micro_of[st.slot]
    st.mcost = np.bincount(mi, costs, minlength=lay.dp * lay.micro).reshape(lay.dp, lay.micro)
    st.mtok = lay.rows * lay.seq_len - np.bincount(mi, lengths, minlength=lay.dp * lay.micro).reshape(lay.dp, lay.micro)
    return st, vision


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_text_trades_move_backbone_cost_where_no_swap_can(seed):
    st, vision = _full_of_short_text(seed)
    _check_totals(st)
    assert (st.rtok[4:] == 0).all()
    scale = 1.0 / np.array([st.rcost.mean(), encoder_load(st, vision).mean()])
    parts = np.stack([st.c, vision])
    enc = encoder_load(st, vision)
    before = _worst(st, vision, scale)
    top = float(st.rcost.max())
    changed = text_trades(st, parts, scale, rounds=8)
    _check_totals(st)
    assert changed > 0
    assert float(st.rcost.max()) < top * 0.9  # the heavy ranks gave long text for short
    assert pair_exchange(st, parts, scale, rounds=8) >= 0
    assert _worst(st, vision, scale) <= before * (1 + 1e-12)
    np.testing.assert_array_equal(encoder_load(st, vision), enc)  # images stay where they were
    assert int((st.rank >= 0).sum()) == st.L.size  # nothing dropped
    assert text_trades(st, parts, scale, rounds=0) == 0


def test_text_trades_keep_random_rows_exact_and_never_raise_the_worst():
    for seed, dp in [(11, 2), (12, 16), (13, 64)]:
        st, vision = _random_rows(seed, dp)
        scale = 1.0 / np.array([st.rcost.mean(), encoder_load(st, vision).mean()])
        enc = encoder_load(st, vision)
        before = _worst(st, vision, scale)
        text_trades(st, np.stack([st.c, vision]), scale, rounds=8)
        _check_totals(st)
        np.testing.assert_allclose(encoder_load(st, vision), enc)
        assert _worst(st, vision, scale) <= before * (1 + 1e-12)
