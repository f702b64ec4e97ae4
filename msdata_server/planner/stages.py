"""Two-stage balancing (the "vlm" cost): each rank's vision-encoder and backbone cost near their own bounds.

A vision-language step runs the encoder on every rank, then the backbone, and each stage waits for its
slowest rank: the step takes max_r V_r + max_r B_r, so both stages must balance, not only their sum.
`place_stages` fills the rows (`rows.Rows`, whose cost is the backbone's) in an order that leaves each
stage something to balance with: the carry-over and the long text first (no encoder cost; they need
whole rows), then `place_images` by both stages, then the short text, which evens out the backbone;
then rounds of paired exchange (`exchange_stages`: every heavy rank trades with a light one at once) and a
short `refine_stages` lower the larger of the two normalised loads.

A rank holding a long text document has a backbone cost far above what its tokens suggest, so it can
take only part of an average rank's images before its backbone passes the others': it ends light in
the encoder and padded, and the other ranks share its images. The backbone cap (balance_tolerance)
makes that padding; since padding lowers the mean, the cap is set again from the first fill's full
ranks and the step filled once more (two fills; see `place_stages`).

In the second fill the ranks holding a text piece above HEAVY of the mean backbone take the images densest in
the encoder first (`reserve_dense`), up to the first fill's means: after the exchange those ranks ended at the
backbone bound and 0.6-0.9 of the mean encoder, holding average images.

Paired exchange alone could not lower what that left (1.029 at 16k, dp 512 on seeds 0-2): in a bad step half
the ranks sat at the backbone's max and a quarter, full of short text pieces (every token used, so no move or
one-for-one swap fits them), 0.82-0.95 of the mean backbone at the encoder's max. A full rank's linear backbone
cost is every full rank's; what differs is the quadratic, which long pieces bring, so `exchange_stages` ends each
spell of paired rounds with rounds of `exchange.text_trades`: a long text piece of a backbone-heavy rank goes
into a row of a light one for that row's shortest text pieces (as few as make room), which lowers the heavy
rank's backbone while no encoder load moves, and the next spell has backbone room to move images into.

Where vlm4 at 16k, dp 512 stands (the bench's loop, 10 steps, encoder / backbone): 1.0199 / 1.0206 on seed 0,
1.0213 / 1.0216 on seed 1, 1.0207 / 1.0210 on seed 2, from 1.0285 / 1.0289, 1.0291 / 1.0296, 1.0293 / 1.0295
(--quick, its first three steps: 1.0182 / 1.0191 on seed 0, from 1.0297 / 1.0299); vlm_video at 16k 1.0077 at dp
512 (from 1.0165) and 1.0053 at dp 64 (from 1.021); planning CPU 1.1-1.2x. The bad steps stay (1.033 on seed 0):
there 58 ranks hold a full-row text piece of 0.81 of the mean backbone, and their images are already near the
densest there are (14 of the largest, 0.78 of the mean encoder at 1.03 of the backbone). A lower bound from the
step's own placed pieces (each text piece above 0.5 of a mean backbone alone on its rank with no other text, its
rank's images at most the step's densest per backbone cost, fractional, the densest shared out densest first, and
the other ranks taking the rest of the encoder evenly; rows and tokens ignored) is 1.022 in that step and 1.0077
over the --quick steps, 1.0095 over the ten. HEAVY 0.65 (from 0.75) because the full-row piece is 0.74-0.81 of the
first fill's mean from step to step: at 0.75 the densest images went to those ranks only in some steps (0.7: vlm4
seed 0 --quick 1.0207, and vlm_video dp 512 1.0070 with padding 0.093, where 0.65 pads 0.101).

Before the text trades (10-step means 1.029-1.056; differences under 0.002 are noise): the exchange and refine
at 8x the CPU (200 rounds, 300 passes, tables 32 wide, pairs among 12) reached 1.0255 from the fill without
reserve_dense. Tried and not kept: reserving in the first fill too, or up to the projected means, or for ranks
with text above 0.3-0.65 of a mean (1.029-1.043), or closing their rows to the short text as well (padding
10-16%); letting ranks heavy with text take only the densest 30-50% of images (1.030-1.042); capping the
backbone projection `cost + free tokens * rate` of `place_images` at its mean (1.033); carrying text pieces
above 0.7 of a mean rank beyond 7-9% of dp to the next step (smoother steps, same mean); the second fill's cap
at 0.5, 2 or -1 times the tolerance, or no second fill (1.031-1.056). With the text trades: one spell of 32
paired rounds then 16 trade rounds then 32 more reaches 1.0217 in the replayed steps at twice the exchange's
CPU (4 spells of 8: 1.0207); swaps of one image for one of about the same length and more encoder between a
backbone-heavy and an encoder-heavy rank (300 a step) changed nothing.
"""

from __future__ import annotations

import numpy as np

from .exchange import pair_exchange, text_trades
from .layout import Layout
from .refine import CONSOLIDATE_PASSES, RankMembers, consolidate
from .rows import ROUND_DIV, Rows, order_by

__all__ = [
    "BACKBONE_WEIGHT",
    "KAPPA",
    "STAGE_PARTNERS",
    "encoder_load",
    "place_images",
    "place_stages",
    "refine_stages",
    "reserve_dense",
]

KAPPA = 32.0  # sharpness of place_images' potential: a 1% higher load weighs exp(0.32) = 1.4 times more
# place_images' weight of the backbone beside the encoder: the short text placed after these pieces evens out
# the backbone, while the encoder has only these pieces, so the encoder weighs more
BACKBONE_WEIGHT = 0.3
MAX_EXP = 600.0  # exp() arguments are clipped here (float64 overflows past 709)
STAGE_PARTNERS = 4  # lightest ranks by each measure (backbone, encoder, their max) tried in a refine pass
DONE = 1e-3  # refine_stages stops once the worst rank is within this of both bounds
FULL = 0.01  # a rank is full when less than this share of its rows is free...
EXCHANGE_ROUNDS = 32  # exchange_stages rounds (each pairs every heavy rank with a light one) before refine_stages
EXCHANGE_SPELLS = 4  # ...in this many spells, each followed by TRADE_ROUNDS rounds of text trades
TRADE_ROUNDS = 8  # (each round pairs the backbone's heavy ranks with its light ones)
POLISH_ITERS = 32  # refine_stages passes after them at most (it works on the worst rank alone)
# reserve_dense: a rank holding a text piece above this share of the mean backbone gets the densest images first
HEAVY = 0.65
RESERVE_STOP = 0.02  # ...until it is within this share of either stage's mean
FULL_RANKS = 4  # ...and the second fill's cap is (1 + tolerance) x the full ranks' mean when dp / this are full


def place_stages(
    lengths: np.ndarray,
    costs: np.ndarray,
    vision: np.ndarray,
    layout: Layout,
    *,
    priority: int,
    tolerance: float | None,
    kk_budget: int,
    iters: int,
    pad_base: float = 0.0,
) -> Rows:
    """Place pieces (backbone `costs`, encoder `vision`) into the rows of `layout`; the filled Rows.

    Each fill: the carried text pieces by best fit, the long text (cost per token above the average of
    what is left) by largest differencing when pieces x ranks is within `kk_budget` (else by the greedy
    rounds), the pieces with images (`place_images`), the short text, then trades of left-over text
    pieces for fewer placed ones (refine.consolidate; the encoder load stays). With a `tolerance`, when
    the first fill's costliest backbone passes (1 + tolerance) x the mean of its full ranks (the long
    documents' ranks are padded, so the mean fell below what the cap assumed), the step is filled again
    under that cap, where the ranks holding long text take the densest images first (`reserve_dense`).
    Then `refine_stages`, at most `iters` passes. `pad_base`: what every rank's backbone costs
    besides its pieces (priced padding, Rows.set_cap), which the tolerance applies to as well.
    """
    desc = order_by(layout.seq_len - lengths, layout.seq_len + 1)  # longest first, ties in order
    st = _fill(lengths, costs, vision, layout, desc, priority, tolerance, kk_budget, None, pad_base)
    if tolerance is not None and layout.dp > 1:
        full = st.rtok <= FULL * layout.slots * layout.seq_len
        base = st.rcost[full] if full.sum() * FULL_RANKS >= layout.dp else st.rcost
        cap = max((float(base.mean()) + pad_base) * (1.0 + tolerance) - pad_base, float(costs.max(initial=0.0)))
        if float(st.rcost.max()) > cap:
            means = (float(st.rcost.mean()), float(encoder_load(st, vision).mean()))
            st = _fill(lengths, costs, vision, layout, desc, priority, tolerance, kk_budget, cap, pad_base, means)
    exchange_stages(st, vision, EXCHANGE_ROUNDS)
    refine_stages(st, vision, min(iters, POLISH_ITERS))
    return st


def _scales(st: Rows, vision: np.ndarray) -> np.ndarray | None:
    """1 / each stage's bound (backbone, encoder): max(its mean over ranks, its costliest placed piece)."""
    placed = st.rank >= 0
    if not placed.any():
        return None
    enc = encoder_load(st, vision)
    wb = _inv(max(float(st.rcost.mean()), float(st.c[placed].max())))
    wv = _inv(max(float(enc.mean()), float(vision[placed].max())))
    return np.array([wb, wv])


def exchange_stages(st: Rows, vision: np.ndarray, rounds: int) -> int:
    """`exchange.pair_exchange` on both stages' normalised loads, `rounds` rounds of paired moves and swaps in
    EXCHANGE_SPELLS spells, each followed by TRADE_ROUNDS rounds of `exchange.text_trades` (a long text piece of
    a rank heavy in the backbone for a row's short ones of a light rank full of them: the heavy ranks' backbone
    falls, no encoder load moves, and the next spell has room to move images); the changes made."""
    scale = _scales(st, vision)
    if scale is None:
        return 0
    parts = np.stack([st.c, vision])
    spells = max(1, min(EXCHANGE_SPELLS, rounds))
    changed = 0
    for k in range(spells):
        changed += pair_exchange(st, parts, scale, rounds // spells + (k < rounds % spells), DONE)
        changed += text_trades(st, parts, scale, TRADE_ROUNDS, DONE)
    return changed


def _fill(
    lengths: np.ndarray,
    costs: np.ndarray,
    vision: np.ndarray,
    layout: Layout,
    desc: np.ndarray,
    priority: int,
    tolerance: float | None,
    kk_budget: int,
    cap: float | None,
    pad_base: float,
    means: tuple[float, float] | None = None,
) -> Rows:
    """One fill (see `place_stages`); `means`: the first fill's mean backbone and encoder loads, with which the
    second fill gives the ranks holding a long text piece their images first (`reserve_dense`)."""
    st = Rows(lengths, costs, layout)
    st.set_cap(desc, tolerance, pad_base)
    if cap is not None:
        st.cap = cap
    st.monotone = bool(np.all(np.diff(costs[desc]) <= 0))
    text = vision[desc] == 0
    early = (desc < priority) & text  # carried pieces with images go with the others
    st.spread = False  # best fit, which keeps whole rows free for the long pieces
    st.greedy(desc[early])
    st.spread = True
    rest = desc[~early & text]
    long = costs[rest] - lengths[rest] * st.rate() > 0
    big, short = rest[long], rest[~long]
    if layout.dp > 1:
        failed = st.partition_long(big, short, kk_budget)
        if failed is not None:
            big = big[np.isin(big, failed)]  # (in their longest-first order)
    st.greedy(big)  # before the pieces with images, which spread over the rows: long ones need whole rows
    images, closed = desc[~text], None
    if means is not None:
        images, closed = reserve_dense(st, images, vision, means)
    place_images(st, images, vision, closed)
    st.greedy(short)
    for _ in range(CONSOLIDATE_PASSES):
        if not consolidate(st, priority, movable=vision == 0):
            break
    return st


def encoder_load(st: Rows, vision: np.ndarray) -> np.ndarray:
    """float64 [dp]: the encoder cost each rank holds now (pieces not placed count nowhere)."""
    placed = st.rank >= 0
    return np.bincount(st.rank[placed], weights=vision[placed], minlength=st.lay.dp).astype(np.float64)


def _inv(x: float) -> float:
    return 1.0 / x if x > 0 else 0.0


def place_images(st: Rows, idx: np.ndarray, vision: np.ndarray, closed: np.ndarray | None = None) -> None:
    """Place the pieces with images, costliest encoder first (those longer than half a row before all others),
    where they raise a potential of both stages least.

    A rank's backbone projects to `cost + free tokens * rate` (the cost per token of what is left to
    place, which will fill its rows) and its encoder is what it holds (only these pieces bring any),
    each over its mean. A piece goes where it raises the potential sum(exp(KAPPA * load)) least (the
    backbone's terms weighted by BACKBONE_WEIGHT): to a light encoder, and among those to a rank whose
    backbone projection it lowers most (a piece with images costs the backbone less per token than the
    average, so it relieves a rank heavy with long text). In rounds: the next
    dp / ROUND_DIV pieces go to distinct ranks, in the head piece's order of preference. A piece its
    rank cannot take (no row it fits, or the backbone cap) goes back to the head of the queue; a head
    piece that no rank can take is given up (carried over). `closed` (bool [dp]): ranks that take none.
    """
    if idx.size == 0:
        return
    dp = st.lay.dp
    enc = encoder_load(st, vision)
    nv = dp * _inv(float(vision[idx].sum()) + float(enc.sum()))  # 1 / the mean encoder load once all are placed
    # pieces longer than half a row first (two never share a row: placed late, they may find no row free
    # enough), then costliest encoder first
    half = 2 * st.L[idx] > st.lay.seq_len
    queue = idx[np.lexsort((-vision[idx], ~half))]
    floor = max(1, dp // ROUND_DIV)
    while queue.size:
        head = int(queue[0])
        elig = st.eligible(head)
        if closed is not None:
            elig = elig[~closed[elig]]
        if elig.size == 0:
            st.give_up(queue[:1])
            queue = queue[1:]
            continue
        rate = st.rate()
        pb = st.rcost + st.rtok * rate
        nb = _inv(float(pb.mean()))
        top = max(float(pb.max()) * nb, float(enc.max()) * nv)
        db = (st.c[head] - st.L[head] * rate) * nb
        dv = vision[head] * nv
        # (loads over `top` are <= 0, so the exps are at most 1; a lump many times a mean load saturates)
        rise = BACKBONE_WEIGHT * np.exp(KAPPA * (pb[elig] * nb - top)) * np.expm1(min(KAPPA * db, MAX_EXP)) + np.exp(
            KAPPA * (enc[elig] * nv - top)
        ) * np.expm1(min(KAPPA * dv, MAX_EXP))
        take = queue[: min(floor, elig.size)]
        ranks = elig[np.argsort(rise, kind="stable")[: take.size]]
        bad = st.put(take, ranks, rate)  # the head always fits: its ranks were chosen for it
        ok = ~bad
        enc += np.bincount(ranks[ok], weights=vision[take[ok]], minlength=dp)
        queue = np.concatenate([take[bad], queue[take.size :]])


def reserve_dense(
    st: Rows, idx: np.ndarray, vision: np.ndarray, means: tuple[float, float]
) -> tuple[np.ndarray, np.ndarray | None]:
    """Give the ranks holding a long text piece the pieces with images densest in the encoder first; the pieces
    left, and those ranks (bool [dp], closed to the other pieces with images), or None when there are none.

    A rank holding a text piece above HEAVY x the mean backbone (`means`: a first fill's mean backbone and
    encoder loads) has little backbone left, and ends light in the encoder when average images fill it: it
    wants those with the most encoder cost per backbone cost. Densest first, in rounds: every such rank
    still open takes the next one (the lightest encoder first) unless it would pass either mean, or no
    row fits it; a rank within RESERVE_STOP of a mean is done. The short text placed after still tops
    their backbone up (the tokens must go somewhere: the other ranks are full).
    """
    dp = st.lay.dp
    bm, vm = means
    placed = st.rank >= 0
    big = np.zeros(dp)
    np.maximum.at(big, st.rank[placed], st.c[placed])
    heavy = np.flatnonzero(big > HEAVY * bm)
    if heavy.size == 0 or idx.size == 0 or bm <= 0 or vm <= 0:
        return idx, None
    enc = encoder_load(st, vision)
    rate = st.rate()
    queue = idx[np.argsort(-vision[idx] / np.maximum(st.c[idx], np.finfo(float).tiny), kind="stable")]
    taken = np.zeros(queue.size, bool)
    ranks_open, start = heavy, 0
    while ranks_open.size and start < queue.size:
        ranks_open = ranks_open[np.argsort(enc[ranks_open], kind="stable")]
        take = queue[start : start + ranks_open.size]
        ranks = ranks_open[: take.size]
        ok = (st.rcost[ranks] + st.c[take] <= bm) & (enc[ranks] + vision[take] <= vm) & (st.maxrem[ranks] >= st.L[take])
        if ok.any():
            bad = st.put(take[ok], ranks[ok], rate)
            taken[start + np.flatnonzero(ok)[~bad]] = True
            enc += np.bincount(ranks[ok][~bad], weights=vision[take[ok][~bad]], minlength=dp)
        start += take.size
        done = (st.rcost[ranks_open] > bm * (1.0 - RESERVE_STOP)) | (enc[ranks_open] > vm * (1.0 - RESERVE_STOP))
        ranks_open = ranks_open[~done]
    closed = np.zeros(dp, bool)
    closed[heavy] = True
    return idx[np.isin(idx, queue[~taken])], closed


def refine_stages(st: Rows, vision: np.ndarray, iters: int) -> None:
    """Lower the worst normalised stage load, max(B_r / bound_B, V_r / bound_V), by moving or swapping pieces.

    A stage's bound is max(its mean over ranks, its costliest placed piece): no plan of these pieces
    beats it. Each pass takes the worst rank not yet found stuck and tries the STAGE_PARTNERS lightest
    ranks by each measure: the move or swap (pieces fitting the rows they go to) that leaves the pair's
    largest normalised load lowest, when that is below the rank's. A rank with no such move is stuck
    and skipped from then on, so the passes go on to lower the other stage's costliest rank too.
    At most `iters` passes; vectorised over the pieces of the two ranks.
    """
    L, b, dp = st.L, st.c, st.lay.dp
    placed = st.rank >= 0
    if not placed.any() or dp < 2:
        return
    enc = encoder_load(st, vision)
    wb = _inv(max(float(st.rcost.mean()), float(b[placed].max())))
    wv = _inv(max(float(enc.mean()), float(vision[placed].max())))
    members = RankMembers(st.rank, dp)

    stuck = np.zeros(dp, bool)
    for _ in range(iters):
        fb, fv = st.rcost * wb, enc * wv
        f = np.maximum(fb, fv)
        r = int(np.argmax(np.where(stuck, -np.inf, f)))
        top = float(f[r])
        if stuck[r] or top <= 1.0 + DONE:
            return
        mine = members(r)
        partners = np.unique(np.concatenate([np.argsort(x, kind="stable")[:STAGE_PARTNERS] for x in (f, fb, fv)]))
        partners = partners[f[partners] < top]
        if not (mine.size and partners.size):
            stuck[r] = True
            continue
        mb, mv = (b[mine] * wb)[:, None], (vision[mine] * wv)[:, None]
        keep_r = np.maximum(fb[r] - mb, fv[r] - mv)  # r's load once a piece of it leaves
        # move: a piece of r (row) to a partner (column) with a row that fits it
        val = np.maximum(keep_r, np.maximum(fb[partners] + mb, fv[partners] + mv))
        val = np.where(L[mine][:, None] <= st.maxrem[partners], val, np.inf)
        # swap: a piece of r (row) with one of a partner (column), each fitting the other's row once it has left
        groups = [members(q) for q in partners.tolist()]
        theirs = np.concatenate(groups)
        owner = np.repeat(partners, [g.size for g in groups])
        db = mb - b[theirs] * wb
        dv = mv - vision[theirs] * wv
        val2 = np.maximum(np.maximum(fb[r] - db, fv[r] - dv), np.maximum(fb[owner] + db, fv[owner] + dv))
        room_r = st.rem[r, st.slot[mine]] + L[mine]
        room_q = st.rem[owner, st.slot[theirs]] + L[theirs]
        ok = (L[theirs] <= room_r[:, None]) & (L[mine][:, None] <= room_q)
        val2 = np.where(ok, val2, np.inf)
        j, k = int(np.argmin(val)), int(np.argmin(val2)) if theirs.size else -1
        best = top * (1.0 - 1e-9)
        if k >= 0 and val2.flat[k] < min(best, val.flat[j]):
            ia, ib = divmod(k, theirs.size)
            a, x, q = int(mine[ia]), int(theirs[ib]), int(owner[ib])
            st.swap(a, x)
            enc[r] += vision[x] - vision[a]
            enc[q] += vision[a] - vision[x]
            members.arrived(q, a)
            members.arrived(r, x)
        elif val.flat[j] < best:
            ia, iq = divmod(j, partners.size)
            a, q = int(mine[ia]), int(partners[iq])
            st.move(a, q)
            enc[r] -= vision[a]
            enc[q] += vision[a]
            members.arrived(q, a)
        else:
            stuck[r] = True
