"""Balancing: place document pieces into the rows of DP ranks so that the costliest rank is as cheap as possible.

Pieces must fit rows of seq_len tokens and every rank has the same rows, so (with the attention cost)
a rank costs `beta*tokens + alpha*sum(len**2)` within a token budget: the balance is two-dimensional.
`place` takes pieces longest first and gives each to the rank with the lowest *projected* cost,
`cost so far + free tokens * rate`, where `rate` is the cost per token of the pieces still to place.
A rank that took an expensive long document projects high and gets nothing more until only the
shortest pieces are left, which fill its rows cheaply: long documents spread out, short ones fill
the gaps of the heavy ranks. Rounds place many pieces on distinct ranks at once (vectorised over
ranks; there is no Python loop per piece).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from msdata_client.choices import Method

from .cost import priced
from .layout import Layout
from .pack import next_fit
from .refine import CARRY_KEEP, CONSOLIDATE_PASSES, consolidate, refine, refine_lowers, trim
from .rows import Rows, order_by
from .stages import place_stages

__all__ = ["Layout", "Method", "Placement", "method_of", "place"]

# Largest (long pieces x ranks) for which "karmarkar_karp" runs largest differencing (see `place`):
# at 16k tokens it covers dp 64 (~150 long pieces), not dp 512 (~1200, some 50 ms more).
KK_BUDGET = 1 << 17
REFINE_ITERS = 32  # bounded refinement: move/swap passes that lower the costliest rank
TRIM_AIM = 0.8  # refine.trim holds the ranks to this share of the tolerance
CONSOLIDATE_CONVERGED = 3  # _settle: a consolidate pass taking under 1/3 of the excess carry-over off it is the last
FIRST_SETTLE = 2  # _settle's consolidate passes before trim (the one after it runs refine.CONSOLIDATE_PASSES)
ONE_STAGE_ROUND_DIV = 3  # greedy rounds of at least dp / 3 pieces (two stages: rows.ROUND_DIV = 4, better there)
STAGE_ITERS = 64  # with two stages: stages.refine_stages passes per step, plus one per DP rank


def method_of(value: str) -> Method:
    """Parse a method name; ConfigError listing the choices."""
    return Method.parse(value, "method", brief=True)


@dataclass(frozen=True, slots=True)
class Placement:
    """Where each piece went: rank and row slot (micro = slot // rows, row = slot % rows); -1 = carried."""

    rank: np.ndarray  # int64 per piece
    slot: np.ndarray  # int64 per piece
    rank_cost: np.ndarray  # float64 [dp]
    micro_cost: np.ndarray  # float64 [dp, micro]


def place(
    lengths: np.ndarray,
    costs: np.ndarray,
    layout: Layout,
    *,
    method: Method | str = Method.KARMARKAR_KARP,
    priority: int = 0,
    tolerance: float | None = 0.01,
    vision: np.ndarray | None = None,
    pad_cost: float = 0.0,
) -> Placement:
    """Place pieces into the rows of `layout`; a piece that does not fit gets rank -1 (the caller carries it).

    The first `priority` pieces (the carry-over) go first, by best fit, so that none waits twice.
    With "karmarkar_karp" the pieces costlier per token than average are then partitioned over the
    ranks by largest differencing of their projected cost (the ranks' loads so far join as one more
    tuple); beyond KK_BUDGET pieces x ranks, where every rank holds many pieces and the greedy rounds
    balance as well, this is skipped, as KK's O(n dp log dp) would pass the time budget. The greedy rounds place the
    rest ("greedy": everything) longest first; a few refinement moves and swaps lower the costliest rank (unless trim
    would cut it lower anyway: refine.refine_lowers); and when more than refine.CARRY_KEEP pieces are left over, short
    ones are traded for fewer long ones (a small state). "none" packs in the given order, rank by rank: the baseline.
    `tolerance`: no rank takes a piece that lifts its cost above (1 + tolerance) x the mean expected when the longest
    pieces fill the step (never below the costliest piece), leaving padding on a rank that a long document would
    otherwise make the straggler; since that padding lowers the mean, refine.trim then holds the ranks to TRIM_AIM of
    the tolerance over the mean the step ends with. None: never pad on purpose.

    `vision` (the "vlm" cost): each piece's vision-encoder cost, while `costs` are the backbone's; both
    stages are balanced at once by stages.place_stages. Placement.rank_cost and micro_cost stay the backbone's.

    `pad_cost`: what a padded token costs (a fixed-shape trainer runs it through the linear layers). A rank
    then costs pad_cost x its tokens plus its pieces' `cost.priced` costs, which every choice above balances,
    so padding is traded against imbalance on one scale; rank_cost and micro_cost include the padding. The cap
    then pads only where that pays: the step is filled uncapped, and under the cap only when the uncapped fill's
    costliest rank passes the tolerance, keeping the fill with more tokens per unit of step time.
    """
    method = method_of(method) if isinstance(method, str) else method
    lengths = np.asarray(lengths, dtype=np.int64)
    costs = priced(np.asarray(costs, dtype=np.float64), lengths, pad_cost)
    if method is Method.NONE:
        return _arrival(lengths, costs, layout, pad_cost)
    if vision is not None:
        budget = KK_BUDGET if method is Method.KARMARKAR_KARP else 0
        st = place_stages(
            lengths,
            costs,
            np.asarray(vision, dtype=np.float64),
            layout,
            priority=priority,
            tolerance=tolerance,
            kk_budget=budget,
            iters=STAGE_ITERS + layout.dp,
            pad_base=pad_cost * layout.slots * layout.seq_len,
        )
        return _result(st, pad_cost)
    base = pad_cost * layout.slots * layout.seq_len
    if base == 0:
        return _result(_fill(lengths, costs, layout, method, priority, tolerance, base), pad_cost)
    # priced padding: padding on purpose (the cap) pays only when it lowers the costliest rank by more than the
    # tokens it leaves out cost, so fill uncapped first, and under the cap only when that fill's costliest rank
    # passes the tolerance; keep the plan with more tokens per unit of step time
    st = _fill(lengths, costs, layout, method, priority, None, base)
    top, mean = float(st.rcost.max()) + base, float(st.rcost.mean()) + base
    if tolerance is not None and layout.dp > 1 and top > mean * (1.0 + tolerance):
        alt = _fill(lengths, costs, layout, method, priority, tolerance, base)
        if _throughput(alt, base) > _throughput(st, base):
            st = alt
    return _result(st, pad_cost)


def _throughput(st: Rows, base: float) -> float:
    """Tokens placed per unit of the costliest rank's cost (priced padding included)."""
    placed = st.lay.capacity - int(st.rtok.sum())
    return placed / (float(st.rcost.max()) + base)


def _fill(
    lengths: np.ndarray,
    costs: np.ndarray,
    layout: Layout,
    method: Method,
    priority: int,
    tolerance: float | None,
    base: float,
) -> Rows:
    """One placement of `place` (one-stage costs) under the cap of `tolerance`: the filled Rows."""
    st = Rows(lengths, costs, layout)
    st.round_div = ONE_STAGE_ROUND_DIV
    n = lengths.size
    desc = order_by(layout.seq_len - lengths, layout.seq_len + 1)  # longest first, ties in order
    desc_len, desc_cost = lengths[desc], costs[desc]
    st.set_cap(desc, tolerance, base, desc_len, desc_cost)
    st.monotone = bool((desc_cost[1:] - desc_cost[:-1] <= 0).all())  # (np.diff)
    st.desc, st.neg_len = desc, -desc_len  # (for refine.consolidate)
    # carry-over first, so that no piece is left over twice; best fit, which keeps whole rows free
    # for the long pieces that follow
    early = desc < priority
    st.spread = False
    st.greedy(desc[early], desc_len[early], desc_cost[early])
    st.spread = True
    late = ~early
    rest, rest_len, rest_cost = desc[late], desc_len[late], desc_cost[late]
    if method is Method.KARMARKAR_KARP and layout.dp > 1 and rest.size and not _over_budget(st, rest):
        rate = st.rate()
        long = costs[rest] - lengths[rest] * rate > 0
        big = rest[long]
        failed = st.partition_long(big, rest[~long], KK_BUDGET)
        if failed is not None:
            keep = np.ones(n, bool)
            keep[big] = False
            keep[failed] = True
            kept = keep[rest]
            rest, rest_len, rest_cost = rest[kept], rest_len[kept], rest_cost[kept]
    st.greedy(rest, rest_len, rest_cost)
    if tolerance is None or layout.dp == 1 or refine_lowers(st, REFINE_ITERS, tolerance * TRIM_AIM, base):
        refine(st, REFINE_ITERS)
    _settle(st, priority, FIRST_SETTLE)
    if tolerance is not None and layout.dp > 1:  # the padding lowered the mean: hold the tolerance to the real one
        # (aiming TRIM_AIM under it: the trades that bound the carry-over afterwards lower the mean a little)
        st.cap = min(st.cap, trim(st, tolerance * TRIM_AIM, base, priority))
        _settle(st, priority)  # (under that cap)
    return st


def _over_budget(st: Rows, rest: np.ndarray) -> bool:
    """More long pieces in `rest` than Rows.partition_long takes (KK_BUDGET pieces x ranks), so it would decline:
    told from the first that many + 1 of them (the pieces are longest first) instead of all."""
    head = rest[: KK_BUDGET // st.lay.dp + 1]
    return bool((st.c[head] - st.L[head] * st.rate() > 0).all()) and head.size * st.lay.dp > KK_BUDGET


def _settle(st: Rows, priority: int, passes: int = CONSOLIDATE_PASSES) -> None:
    """Bound the carry-over (refine.consolidate), then place what fits of it: never carry what fits.

    The passes stop early once one takes less than 1/CONSOLIDATE_CONVERGED of the excess over refine.CARRY_KEEP
    off the carry-over: the next would take less still (its trades are of the pieces the last one could not place).
    """
    left = (st.rank < 0).nonzero()[0]
    for _ in range(passes):
        if not consolidate(st, priority, left=left):
            break  # (nothing traded: `left` holds)
        now = (st.rank < 0).nonzero()[0]
        converged = (left.size - now.size) * CONSOLIDATE_CONVERGED < left.size - CARRY_KEEP
        left = now
        if converged:
            break
    # the moves and trades above can open room that a piece left over fits in
    if left.size:
        st.greedy(left[order_by(st.lay.seq_len - st.L[left], st.lay.seq_len + 1)])


def _result(st: Rows, pad_cost: float) -> Placement:
    rank, slot, rank_cost, micro_cost = st.result()
    lay = st.lay
    if pad_cost:  # every token of a rank costs pad_cost besides its pieces' priced costs
        rank_cost = rank_cost + pad_cost * lay.slots * lay.seq_len
        micro_cost = micro_cost + pad_cost * lay.rows * lay.seq_len
    return Placement(rank=rank, slot=slot, rank_cost=rank_cost, micro_cost=micro_cost)


def _arrival(lengths: np.ndarray, costs: np.ndarray, layout: Layout, pad_cost: float) -> Placement:
    """Method "none": next-fit in the given order over rank 0's rows, then rank 1's, and so on."""
    row = next_fit(lengths, layout.dp * layout.slots, layout.seq_len)
    ok = row >= 0
    rank = np.where(ok, row // layout.slots, -1)
    slot = np.where(ok, row % layout.slots, -1)
    pad = pad_cost * layout.rows * layout.seq_len  # each micro-batch's tokens at pad_cost (the pieces are priced)
    rank_cost = np.bincount(rank[ok], costs[ok], minlength=layout.dp) + pad * layout.micro
    micro = rank[ok] * layout.micro + slot[ok] // layout.rows
    micro_cost = (
        np.bincount(micro, costs[ok], minlength=layout.dp * layout.micro).reshape(layout.dp, layout.micro) + pad
    )
    return Placement(rank=rank, slot=slot, rank_cost=rank_cost, micro_cost=micro_cost)
