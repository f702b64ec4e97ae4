"""Paired exchange: many heavy ranks each trade one piece with a light partner at once, in vectorised rounds.

A rank's load is a vector (one entry per stage, each over its bound); what a step costs is its worst rank's
largest entry. A round pairs the ranks heaviest-first with the ranks lightest-first (by the worst entry, or by
one stage: the rounds cycle through the keys; from the second cycle on, the light ranks are rotated by ROTATE
per cycle, so a heavy rank meets other partners) and, for every pair at once, tries each piece of the heavy rank
moved to the light one and each pair of pieces swapped (among the WIDTH pieces of each rank with the largest
loads), keeping the choice that leaves the pair's largest entry lowest, if it is lower than now; pieces must
fit the rows they go to. Pairs are disjoint, so the round applies all their choices. A piece's row tables are
kept as pieces move (no regrouping per round). Pure numpy over [pairs, WIDTH, WIDTH]; no loop per piece.
"""

from __future__ import annotations

import numpy as np

from .rows import Rows

__all__ = ["WIDTH", "pair_exchange"]

WIDTH = 16  # pieces of each rank considered in a round: its largest, by its largest normalised entry
ROTATE = 37  # from the second cycle of keys on, the light partners are rotated by this much per cycle
_GAIN = 1e-9  # a choice must lower the pair's largest entry by this share (no churn on ties)


def _tables(rank: np.ndarray, weight: np.ndarray, dp: int, width: int) -> np.ndarray:
    """int64 [dp, width]: each rank's `width` placed pieces of largest weight (ties: lower index), -1 padded."""
    idx = np.flatnonzero(rank >= 0)
    o = np.lexsort((idx, -weight[idx], rank[idx]))
    idx = idx[o]
    r = rank[idx]
    nth = np.arange(idx.size) - np.searchsorted(r, np.arange(dp))[r]
    keep = nth < width
    table = np.full((dp, width), -1, np.int64)
    table[r[keep], nth[keep]] = idx[keep]
    return table


def pair_exchange(st: Rows, parts: np.ndarray, scale: np.ndarray, rounds: int, done: float = 0.0) -> int:
    """Lower the worst rank's largest normalised load by rounds of paired moves and swaps; the changes made.

    `parts` float64 [stages, n]: each piece's cost per stage (row 0 must be the Rows' own cost, st.c, whose
    rank sums st.rcost keeps; the others are summed here); `scale` [stages]: 1 / each stage's bound. Stops
    early when two cycles of rounds change nothing or every rank is within 1 + `done`.
    """
    dp = st.lay.dp
    if dp < 2 or rounds <= 0:
        return 0
    norm = parts * scale[:, None]  # [stages, n]
    placed = st.rank >= 0
    extra = np.zeros((norm.shape[0] - 1, dp))  # the loads of the stages after the first
    for s in range(extra.shape[0]):
        extra[s] = np.bincount(st.rank[placed], norm[s + 1, placed], minlength=dp)
    table = _tables(st.rank, norm.max(axis=0), dp, WIDTH)
    half = dp // 2
    changed, idle = 0, 0
    n_keys = norm.shape[0] + 1
    for t in range(rounds):
        load = np.concatenate([(st.rcost * scale[0])[None, :], extra])  # [stages, dp]
        worst = load.max(axis=0)
        if float(worst.max()) <= 1.0 + done:
            break
        key = worst if t % n_keys == 0 else load[t % n_keys - 1]
        order = np.argsort(-key, kind="stable")
        heavy, light = order[:half], order[::-1][:half]
        if ROTATE and t >= n_keys:  # later rounds: each heavy rank meets other light partners
            light = np.roll(light, (t // n_keys) * ROTATE % half)
        ok = (worst[heavy] > 1.0 + done) & (key[heavy] > key[light])
        heavy, light = heavy[ok], light[ok]
        if heavy.size == 0:
            break
        got = _round(st, norm, extra, load, worst, table, heavy, light)
        changed += got
        idle = 0 if got else idle + 1
        if idle >= 2 * n_keys:  # two cycles of keys and partners without a change
            break
    return changed


def _round(
    st: Rows, norm: np.ndarray, extra: np.ndarray, load: np.ndarray, worst: np.ndarray, table: np.ndarray,
    heavy: np.ndarray, light: np.ndarray,
) -> int:  # fmt: skip
    """One round of `pair_exchange` over the pairs (heavy[i], light[i]); applies the choices, returns how many."""
    L = st.L
    A, B = table[heavy], table[light]  # [k, W] pieces (-1: none)
    va, vb = A >= 0, B >= 0
    a, b = np.where(va, A, 0), np.where(vb, B, 0)
    lh, ll = load[:, heavy][:, :, None], load[:, light][:, :, None]  # [S, k, 1]
    na, nb = norm[:, a], norm[:, b]  # [S, k, W]
    top = np.maximum(worst[heavy], worst[light])  # [k]
    # move: a piece of h to l (a row of l it fits)
    mv = np.maximum((lh - na).max(axis=0), (ll + na).max(axis=0))  # [k, W]
    mv = np.where(va & (L[a] <= st.maxrem[light][:, None]), mv, np.inf)
    # swap: a of h with b of l, each fitting the other's row once it has left
    d = na[:, :, :, None] - nb[:, :, None, :]  # [S, k, W, W]
    sw = np.maximum((lh[..., None] - d).max(axis=0), (ll[..., None] + d).max(axis=0))
    room_h = st.rem[heavy[:, None], np.maximum(st.slot[a], 0)] + L[a]  # [k, W]
    room_l = st.rem[light[:, None], np.maximum(st.slot[b], 0)] + L[b]
    fit = (L[b][:, None, :] <= room_h[:, :, None]) & (L[a][:, :, None] <= room_l[:, None, :])
    sw = np.where(fit & va[:, :, None] & vb[:, None, :], sw, np.inf)
    W = A.shape[1]
    rows = np.arange(heavy.size)
    jm = np.argmin(mv, axis=1)
    best_mv = mv[rows, jm]
    flat = sw.reshape(heavy.size, -1)
    js = np.argmin(flat, axis=1)
    best_sw = flat[rows, js]
    bar = top * (1.0 - _GAIN)
    do_swap = (best_sw < bar) & (best_sw <= best_mv)
    do_move = ~do_swap & (best_mv < bar)
    # swaps: a to b's row on l, b to a's row on h
    i = np.flatnonzero(do_swap)
    ia, ib = js[i] // W, js[i] % W
    pa, pb = A[i, ia], B[i, ib]
    # moves: a to l's tightest row that fits it
    m = np.flatnonzero(do_move)
    ma = A[m, jm[m]]
    free = st.rem[light[m]]
    mw = np.argmin(np.where(free >= L[ma][:, None], free, np.iinfo(np.int64).max), axis=1)
    pieces = np.concatenate([pa, pb, ma])
    to_rank = np.concatenate([light[i], heavy[i], light[m]])
    to_slot = np.concatenate([st.slot[pb], st.slot[pa], mw])
    _relocate(st, extra, norm, pieces, to_rank, to_slot)
    table[heavy[i], ia], table[light[i], ib] = pb, pa
    table[heavy[m], jm[m]] = -1
    return int(i.size + m.size)


def _relocate(st: Rows, extra: np.ndarray, norm: np.ndarray, p: np.ndarray, r2: np.ndarray, w2: np.ndarray) -> None:
    """Put placed pieces p into rows (r2, w2) (each already free enough once the pieces leaving it have left),
    keeping every total of the Rows and the other stages' loads `extra` [stages - 1, dp] in step."""
    lay = st.lay
    dp, k = lay.dp, lay.slots
    r1, w1 = st.rank[p], st.slot[p]
    toks, cost = st.L[p], st.c[p]

    def diff(key1: np.ndarray, key2: np.ndarray, w: np.ndarray, size: int) -> np.ndarray:
        return np.bincount(key2, w, minlength=size) - np.bincount(key1, w, minlength=size)

    st.rem.reshape(-1)[:] -= diff(r1 * k + w1, r2 * k + w2, toks, dp * k).astype(np.int64)
    st.rtok -= diff(r1, r2, toks, dp).astype(np.int64)
    st.rcost += diff(r1, r2, cost, dp)
    m1, m2 = r1 * lay.micro + st.micro_of[w1], r2 * lay.micro + st.micro_of[w2]
    st.mcost += diff(m1, m2, cost, dp * lay.micro).reshape(dp, lay.micro)
    st.mtok -= diff(m1, m2, toks, dp * lay.micro).astype(np.int64).reshape(dp, lay.micro)
    for s in range(extra.shape[0]):
        extra[s] += diff(r1, r2, norm[s + 1, p], dp)
    touched = np.unique(np.concatenate([r1, r2]))
    st.maxrem[touched] = st.rem[touched].max(axis=1)
    st.rank[p], st.slot[p] = r2, w2
