"""Paired exchange: many heavy ranks each trade one piece with a light partner at once, in vectorised rounds.

A rank's load is a vector (one entry per stage, each over its bound); what a step costs is its worst rank's
largest entry. A round pairs the ranks heaviest-first with the ranks lightest-first (by the worst entry, or by
one stage: the rounds cycle through the keys; from the second cycle on, the light ranks are rotated by ROTATE
per cycle, so a heavy rank meets other partners) and, for every pair at once, tries each piece of the heavy rank
moved to the light one, each pair of pieces swapped, and each two pieces of the heavy rank (among its
DOUBLE_WIDTH largest) swapped for one of the light (moved too: among the WIDTH pieces of each rank with the
largest loads), keeping the choice that leaves the pair's largest entry lowest, if it is lower than now; pieces
must fit the rows they go to. The double swap is what a rank heavy in one stage and light in the other needs:
two pieces cheap in its light stage out for one dense in it (a rank holding a long text document, its backbone
full, trades two small images for one large). Pairs are disjoint, so the round applies all their choices at
once. The rank tables of pieces are kept as pieces move (no regrouping per round). Pure numpy over
[pairs, candidates, WIDTH]; no loop per piece or pair.

`text_trades` is the many-for-one trade none of those can make: a rank full of short text pieces has no token
free and is light in the first stage (a full rank's linear cost is every full rank's, the quadratic differs),
so a long text piece of a heavy rank goes into one of its rows for as many of that row's shortest text pieces as
make room, which go into the long piece's old row. Vectorised the same way over [pairs, TEXT_WIDTH, rows].
"""

from __future__ import annotations

import numpy as np

from .rows import Rows

__all__ = ["TEXT_WIDTH", "WIDTH", "pair_exchange", "text_trades"]

WIDTH = 16  # pieces of each rank considered in a round: its largest, by its largest normalised entry
DOUBLE_WIDTH = 8  # the largest pieces of a heavy rank whose pairs are tried against one of the light rank
ROTATE = 37  # from the second cycle of keys on, the light partners are rotated by this much per cycle
TEXT_WIDTH = 4  # text_trades: a heavy rank's costliest text pieces tried in a round
TRADE_STOP = 0.01  # ...which stop after a round trading at most this share of dp
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
    """One round of `pair_exchange` over the pairs (heavy[i], light[i]): for each pair the best of a move, a swap
    and a double swap (two pieces of the heavy rank for one of the light: what a rank heavy in one stage and
    light in the other needs to trade two cheap pieces for one dense one); applies them, returns how many."""
    L, k = st.L, heavy.size
    A, B = table[heavy], table[light]  # [k, W] pieces (-1: none)
    va, vb = A >= 0, B >= 0
    a, b = np.where(va, A, 0), np.where(vb, B, 0)
    lh, ll = load[:, heavy][:, :, None, None], load[:, light][:, :, None, None]  # [S, k, 1, 1]
    na, nb = norm[:, a], norm[:, b]  # [S, k, W]
    sa, sb = np.maximum(st.slot[a], 0), np.maximum(st.slot[b], 0)
    room_h = st.rem[heavy[:, None], sa] + L[a]  # [k, W]: free in a's row once a has left
    room_l = st.rem[light[:, None], sb] + L[b]
    # candidates [k, X, W]: X pieces (or pairs of pieces) of h against W of l; a move is a swap with nothing
    iu, ju = np.triu_indices(min(DOUBLE_WIDTH, A.shape[1]), 1)
    give = np.concatenate([na, na[:, :, iu] + na[:, :, ju]], axis=2)  # [S, k, X]
    take = np.concatenate([np.zeros((*nb.shape[:2], 1)), nb], axis=2)  # [S, k, 1 + W]
    d = give[:, :, :, None] - take[:, :, None, :]
    val = np.maximum((lh - d).max(axis=0), (ll + d).max(axis=0))  # [k, X, 1 + W]
    # what fits: one piece a into b's row (or, moved, l's roomiest), b into a's row; a pair both into b's row
    same = sa[:, iu] == sa[:, ju]
    tok_in = np.concatenate([L[a], L[a][:, iu] + L[a][:, ju]], axis=1)  # [k, X]
    room_in = np.concatenate([room_h, room_h[:, iu] + np.where(same, L[a][:, ju], 0)], axis=1)
    ok_out = np.concatenate([va, va[:, iu] & va[:, ju]], axis=1)
    fit = np.concatenate([st.maxrem[light][:, None, None], room_l[:, None, :]], axis=2) >= tok_in[:, :, None]
    got = np.concatenate([np.zeros((k, 1), np.int64), L[b]], axis=1)  # tokens h takes
    fit &= got[:, None, :] <= room_in[:, :, None]
    fit &= ok_out[:, :, None] & np.concatenate([np.ones((k, 1), bool), vb], axis=1)[:, None, :]
    val = np.where(fit, val, np.inf).reshape(k, -1)
    j = np.argmin(val, axis=1)
    best = val[np.arange(k), j]
    i = np.flatnonzero(best < np.maximum(worst[heavy], worst[light]) * (1.0 - _GAIN))
    if i.size == 0:
        return 0
    x, y = np.divmod(j[i], 1 + A.shape[1])  # x: a piece (< W) or a pair; y: 0 a move, else 1 + b's column
    W = A.shape[1]
    c1 = np.where(x < W, x, iu[np.maximum(x - W, 0)])
    c2 = np.where(x < W, -1, ju[np.maximum(x - W, 0)])
    p1, p2 = A[i, c1], np.where(c2 >= 0, A[i, np.maximum(c2, 0)], -1)
    cb = y - 1
    pb = np.where(cb >= 0, B[i, np.maximum(cb, 0)], -1)
    h, q = heavy[i], light[i]
    two, swapped = p2 >= 0, pb >= 0
    free = st.rem[q]  # a move: l's tightest row that fits what moves
    need = L[p1] + np.where(two, L[np.maximum(p2, 0)], 0)
    tight = np.argmin(np.where(free >= need[:, None], free, np.iinfo(np.int64).max), axis=1)
    dest = np.where(cb >= 0, st.slot[np.maximum(pb, 0)], tight)
    pieces = np.concatenate([p1, p2[two], pb[swapped]])
    to_rank = np.concatenate([q, q[two], h[swapped]])
    to_slot = np.concatenate([dest, dest[two], st.slot[p1][swapped]])
    _relocate(st, extra, norm, pieces, to_rank, to_slot)
    table[h, c1] = pb  # (-1 after a move)
    table[h[two], c2[two]] = -1
    table[q[swapped], cb[swapped]] = p1[swapped]
    return int(i.size)


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


def text_trades(st: Rows, parts: np.ndarray, scale: np.ndarray, rounds: int, done: float = 0.0) -> int:
    """Lower the worst rank's largest normalised load by many-for-one trades of pieces with no cost but the first
    stage's (text); the changes made.

    A rank full of short text is light in the first stage (a full rank's linear cost is every full rank's; what
    differs is the quadratic, which long pieces bring), while a rank holding long pieces is heavy there, and a
    one-for-one or two-for-one swap cannot move the difference: the light rank has no tokens free. So a round
    pairs the ranks heaviest-first in the first stage with the lightest-first (rotated by ROTATE from the second
    round on) and, for every pair at once, tries each of the heavy rank's TEXT_WIDTH costliest text pieces against
    each row of the light rank: the piece goes into that row and the row's shortest text pieces, as few as make it
    room, go into the piece's old row (they must fit there), keeping the choice that leaves the pair's largest
    normalised entry lowest, if it is lower than now. The other stages' loads do not change (text costs nothing
    there). `parts`, `scale`, `done` as for `pair_exchange`; stops after a round that trades for at most
    TRADE_STOP x dp pairs (the later rounds trade a few each).
    """
    dp = st.lay.dp
    if dp < 2 or rounds <= 0:
        return 0
    text = ~np.any(parts[1:] != 0, axis=0)
    placed = st.rank >= 0
    other = np.zeros(dp)  # each rank's largest normalised load in the other stages (fixed here)
    for s in range(1, parts.shape[0]):
        other = np.maximum(other, np.bincount(st.rank[placed], parts[s, placed] * scale[s], minlength=dp))
    half, changed = dp // 2, 0
    for t in range(rounds):
        fb = st.rcost * scale[0]
        worst = np.maximum(fb, other)
        if float(worst.max()) <= 1.0 + done:
            break
        order = np.argsort(-fb, kind="stable")
        heavy, light = order[:half], order[::-1][:half]
        if t:
            light = np.roll(light, t * ROTATE % half)
        ok = (worst[heavy] > 1.0 + done) & (fb[heavy] > fb[light])
        got = _trade_round(st, text, scale[0], fb, other, heavy[ok], light[ok])
        changed += got
        if got <= TRADE_STOP * dp:
            break
    return changed


def _trade_round(
    st: Rows, text: np.ndarray, wb: float, fb: np.ndarray, other: np.ndarray, heavy: np.ndarray, light: np.ndarray
) -> int:
    """One round of `text_trades` over the pairs (heavy[i], light[i]); applies the trades, returns how many."""
    k, slots = heavy.size, st.lay.slots
    if k == 0:
        return 0
    dp = st.lay.dp
    role = np.zeros(dp + 1, np.int8)  # (index -1: not placed)
    role[heavy], role[light] = 1, 2
    on = np.where(text, role[st.rank], 0)
    # the heavy ranks' costliest text pieces: [k, TEXT_WIDTH], -1 padded
    table = _tables(np.where(on == 1, st.rank, -1), st.c, dp, TEXT_WIDTH)[heavy]
    valid = table >= 0
    x = np.where(valid, table, 0)
    # every row of a light rank: its text pieces shortest first, with running sums of their lengths and costs
    idx = np.flatnonzero(on == 2)
    g = st.rank[idx] * slots + st.slot[idx]
    o = np.lexsort((idx, st.L[idx], g))
    idx, g = idx[o], g[o]
    start = np.searchsorted(g, np.arange(dp * slots + 1))
    cum_l = np.cumsum(st.L[idx])
    cum_c = np.cumsum(st.c[idx])
    base_l = np.concatenate([[0], cum_l])[start[:-1]]  # sums before each group
    base_c = np.concatenate([[0.0], cum_c])[start[:-1]]
    span = st.lay.seq_len + 1
    key = g * span + (cum_l - base_l[g])  # increasing: by group, then by running length
    # queries [k, W, slots]: piece x of h into row w of l
    rows = light[:, None, None] * slots + np.arange(slots)[None, None, :]
    lx = st.L[x][:, :, None]
    need = lx - st.rem.reshape(-1)[rows]
    pos = np.searchsorted(key, rows * span + np.maximum(need, 1))
    end = start[rows + 1]
    some = need > 0
    feasible = ~some | (pos < end)
    posc = np.minimum(pos, idx.size)  # (one past the end: infeasible, read from the sentinel)
    out_l = np.where(some, np.append(cum_l, 0)[posc] - base_l[rows], 0)
    out_c = np.where(some, np.append(cum_c, 0.0)[posc] - base_c[rows], 0.0)
    room_h = st.rem[heavy[:, None], np.maximum(st.slot[x], 0)] + st.L[x]  # x's old row once x has left
    feasible &= valid[:, :, None] & (out_l <= room_h[:, :, None])
    d = (st.c[x][:, :, None] - out_c) * wb  # what h sheds
    h3, l3 = heavy[:, None, None], light[:, None, None]
    val = np.maximum(np.maximum(fb[h3] - d, other[h3]), np.maximum(fb[l3] + d, other[l3]))
    val = np.where(feasible, val, np.inf).reshape(k, -1)
    j = np.argmin(val, axis=1)
    best = val[np.arange(k), j]
    now = np.maximum(np.maximum(fb[heavy], other[heavy]), np.maximum(fb[light], other[light]))
    i = np.flatnonzero(best < now * (1.0 - _GAIN))
    if i.size == 0:
        return 0
    c_x, w = np.divmod(j[i], slots)
    h, q = heavy[i], light[i]
    p = x[i, c_x]
    r = q * slots + w
    n_out = np.where(some[i, c_x, w], pos[i, c_x, w] - start[r] + 1, 0)
    first = start[r]
    out = idx[np.repeat(first, n_out) + np.arange(int(n_out.sum())) - np.repeat(np.cumsum(n_out) - n_out, n_out)]
    pieces = np.concatenate([p, out])
    to_rank = np.concatenate([q, np.repeat(h, n_out)])
    to_slot = np.concatenate([w, np.repeat(st.slot[p], n_out)])
    _relocate(st, np.zeros((0, dp)), np.zeros((1, st.L.size)), pieces, to_rank, to_slot)
    return int(i.size)
