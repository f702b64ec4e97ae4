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
"""

from __future__ import annotations

import numpy as np

from .rows import Rows

__all__ = ["WIDTH", "pair_exchange"]

WIDTH = 16  # pieces of each rank considered in a round: its largest, by its largest normalised entry
DOUBLE_WIDTH = 8  # the largest pieces of a heavy rank whose pairs are tried against one of the light rank
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
