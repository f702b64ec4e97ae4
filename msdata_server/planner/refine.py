"""Passes that improve a placement of `rows.Rows`: moves and swaps that lower the costliest rank, and
trades that bound the carry-over (short left-over pieces for fewer long placed ones)."""

from __future__ import annotations

import math
from collections.abc import Iterator

import numpy as np

from .fit import least, run_lengths, run_starts
from .rows import Rows, order_by

__all__ = ["CARRY_KEEP", "CONSOLIDATE_PASSES", "consolidate", "refine", "refine_lowers", "trim"]

REFINE_PARTNERS = 4  # cheapest ranks tried as partners in each refinement pass
CARRY_KEEP = 1024  # left-over pieces kept as they are; beyond, `consolidate` trades them (state size)
CONSOLIDATE_RATIO = 8  # a traded placed piece is at least this many times the mean left-over
CONSOLIDATE_PASSES = 4  # rounds of trading left-over pieces a placement runs (balance.place, stages.place_stages)


class RankMembers:
    """The pieces on each rank while refinement moves them: grouped once by rank, plus the pieces that moved
    onto a rank since (a piece that moved away is filtered out by its current rank). ``rank`` is live."""

    def __init__(self, rank: np.ndarray, dp: int):
        self.rank = rank
        self.order = order_by(rank + 1, dp + 1)
        self.bounds = np.bincount(rank + 1, minlength=dp + 1).cumsum()  # pieces below each rank (-1 first)
        self.moved: dict[int, list[int]] = {}

    def __call__(self, r: int) -> np.ndarray:
        own = self.order[self.bounds[r] : self.bounds[r + 1]]
        if r in self.moved:
            own = np.concatenate([own, np.array(self.moved[r], np.int64)])
        return own[self.rank[own] == r]

    def arrived(self, r: int, piece: int) -> None:
        """``piece`` now lies on rank r."""
        self.moved.setdefault(r, []).append(piece)


def refine(st: Rows, iters: int) -> None:
    """Lower the costliest rank by moving or swapping one piece with a cheap rank, while it helps.

    Each pass tries the REFINE_PARTNERS cheapest ranks: the move or swap whose cost difference
    is closest to half the gap, among those whose pieces fit the rows they go to.
    """
    L, c = st.L, st.c
    members = RankMembers(st.rank, st.lay.dp)

    for _ in range(iters):
        r = int(st.rcost.argmax())
        top = st.rcost[r]
        mine = members(r)
        if mine.size == 0:
            return
        done = False
        cm, lm = c[mine], L[mine]
        room_r = st.rem[r, st.slot[mine]] + lm  # free in a's row once a leaves
        for q in _partners(st.rcost):
            gap = top - st.rcost[q]
            if q == r or gap <= 0:
                break
            # move: a piece of r that fits a row of q, cost closest to gap/2
            gain_move = np.where((lm <= st.maxrem[q]) & (cm < gap), np.minimum(cm, gap - cm), -1.0)
            theirs = members(q)
            best_swap = -1.0
            if theirs.size:
                lt = L[theirs]
                d = cm[:, None] - c[theirs][None, :]
                room_q = st.rem[q, st.slot[theirs]] + lt
                gain = np.minimum(d, gap - d)  # > 0 exactly where 0 < d < gap (x - y > 0 iff x > y, in floats)
                ok = (gain > 0) & (lt[None, :] <= room_r[:, None]) & (lm[:, None] <= room_q[None, :])
                gain = np.where(ok, gain, -1.0)
                flat = int(gain.argmax())
                best_swap = float(gain.flat[flat])
            a = int(gain_move.argmax())
            if max(gain_move[a], best_swap) <= 0:
                continue
            if gain_move[a] >= best_swap:
                st.move(int(mine[a]), q)
                members.arrived(q, int(mine[a]))
            else:
                ia, ib = divmod(flat, theirs.size)
                st.swap(int(mine[ia]), int(theirs[ib]))
                members.arrived(q, int(mine[ia]))
                members.arrived(r, int(theirs[ib]))
            done = True
            break
        if not done:
            return


def refine_lowers(st: Rows, iters: int, tolerance: float, base: float) -> bool:
    """Whether `refine` (`iters` passes) can lower the step's costliest rank below the cap `trim` (at `tolerance`,
    `base`: see there) cuts the ranks down to afterwards. A pass lowers only the costliest rank, to no less than
    its partner then costs, so after `iters` passes the costliest costs at least the (iters + 1)-th costliest now;
    when that one is above trim's cap (many ranks at the cost cap, as at dp 512 and 16k tokens), trim sets the
    step's length either way, and refine is skipped."""
    dp = st.rcost.size
    if dp <= iters:
        return True
    j = dp - 1 - iters
    return float(np.partition(st.rcost, j)[j]) <= _trim_cap(st.rcost, tolerance, base)


def _partners(rcost: np.ndarray) -> Iterator[int]:
    """The REFINE_PARTNERS cheapest ranks, cheapest first (ties by rank): the first by one argmin, the others
    only when it is passed over (most passes take the cheapest)."""
    yield int(rcost.argmin())
    yield from least(rcost, REFINE_PARTNERS)[1:].tolist()


def consolidate(st: Rows, priority: int, movable: np.ndarray | None = None, left: np.ndarray | None = None) -> bool:
    """Bound the carry-over: trade short left-over pieces for fewer long placed ones; False: none traded.

    With the cost cap, the pieces left over are the shortest of the step, and there can be many
    (the state would grow with dp). Beyond CARRY_KEEP of them, the shortest are cut into
    consecutive chunks, each covering the tokens of one placed piece X (at least
    CONSOLIDATE_RATIO times their mean length, at most half a row, not itself carried over, one
    per row, the costliest ranks first); a chunk takes X's place when it fits X's row and costs no more than
    X (no rank gets costlier), and X is carried instead. A chunk may fall short of X by less than
    one short piece, which adds that much padding. Vectorised; no loop over pieces.
    `movable` (bool per piece, None: all): only these are traded, either way (two stages: the text pieces).
    `left`: the pieces left over now ((st.rank < 0).nonzero()[0]), when the caller has them.
    """
    left = (st.rank < 0).nonzero()[0] if left is None else left
    excess = left.size - CARRY_KEEP
    if excess <= 0:
        return False
    L, c, k = st.L, st.c, st.lay.slots
    if movable is not None:
        left = left[movable[left]]
    left = left[order_by(L[left], st.lay.seq_len + 1)][:excess]  # the shortest go first
    if left.size == 0:
        return False
    lo = CONSOLIDATE_RATIO * float(L[left].mean())
    cand = _candidates(st, lo, priority, movable)
    if cand.size == 0:
        return False
    # one per row, its first (least index): the least candidate of each row, by one scatter over the rows (no sort)
    first = np.full(st.lay.dp * k, L.size, np.int64)
    np.minimum.at(first, st.rank[cand] * k + st.slot[cand], cand)  # (in any order of cand)
    # costliest ranks first (ties by rank), each rank's in index order: the rows' firsts only, not every candidate
    # (a few per rank), sorted within their rank, and the ranks in that order (no sort of the rows' firsts)
    by_rank = np.sort(first.reshape(st.lay.dp, k), axis=1) if k > 1 else first.reshape(st.lay.dp, 1)
    cand = by_rank.take((-st.rcost).argsort(kind="stable"), axis=0).reshape(-1)
    cand = cand[cand < L.size]
    ends = L[left].cumsum()
    cost_ends = np.concatenate([[0.0], c[left].cumsum()])
    stop = ends.searchsorted(L[cand].cumsum(), side="left") + 1  # chunk j: left[start_j:stop_j]
    keep = stop <= left.size
    cand, stop = cand[keep], stop[keep]
    start = np.concatenate([[0], stop[:-1]])
    tok = ends[stop - 1] - np.where(start > 0, ends[start - 1], 0)
    r, w = st.rank[cand], st.slot[cand]
    ok = (stop > start) & (tok <= L[cand] + st.rem[r, w]) & (cost_ends[stop] - cost_ends[start] <= c[cand])
    ok &= tok >= L[cand] - int(L[left].max())
    if not ok.any():
        return False
    cand, start, stop, tok = cand[ok], start[ok], stop[ok], tok[ok]
    dtok = L[cand] - tok
    dcost = cost_ends[stop] - cost_ends[start] - c[cand]
    counts = stop - start
    within = np.arange(int(counts.sum())) - (counts.cumsum() - counts).repeat(counts)
    st.trade(cand, left[start.repeat(counts) + within], counts, dtok, dcost)
    return True


def _candidates(st: Rows, lo: float, priority: int, movable: np.ndarray | None) -> np.ndarray:
    """The pieces `consolidate` may carry instead: placed, from `priority` on, lo <= length <= seq_len / 2 (and
    movable), in no particular order (consolidate takes each row's least). From the pieces by length (Rows.desc),
    a slice of them, when known; else one pass over all."""
    L, half = st.L, st.lay.seq_len // 2
    if st.desc is not None and movable is None:
        if st.neg_len is None:
            st.neg_len = -L[st.desc]  # ascending
        a = int(st.neg_len.searchsorted(-half, side="left"))
        b = int(st.neg_len.searchsorted(-math.ceil(lo), side="right"))  # (L >= lo iff L >= ceil(lo): an int key,
        # as a float key would convert all of neg_len to floats first)
        cand = st.desc[a:b]
        return cand[(cand >= priority) & (st.rank[cand] >= 0)]
    ok = (st.rank >= 0) & (lo <= L) & (half >= L)  # (one pass over the pieces, no gathers)
    if movable is not None:
        ok &= movable
    return ok[priority:].nonzero()[0] + priority


COSTLIER = 0.9  # trim's _costlier: the pieces of a rank costing at least this share of its costliest
TRIM_PASSES = 1  # rounds of `trim` (the cap already anticipates the mean it leads to)


def _trim_cap(rcost: np.ndarray, tolerance: float, base: float) -> float:
    """(1 + tolerance) x the mean the ranks will have once those above it are cut down to it: a fixed point,
    found by iterating on the dp rank costs (each step shrinks the error by the share of ranks above)."""
    total, dp = float(rcost.sum()), rcost.size
    cap = (total / dp + base) * (1.0 + tolerance) - base
    for _ in range(8):
        cap = ((total - float(np.maximum(rcost - cap, 0.0).sum())) / dp + base) * (1.0 + tolerance) - base
    return cap


def trim(st: Rows, tolerance: float, base: float, priority: int) -> float:
    """Hold the tolerance to the mean the step ends with: carry pieces off the ranks above (1 + tolerance) x it.

    The cap (Rows.set_cap) is set from the mean expected before placing; the padding it makes lowers the mean, so
    the capped ranks end above (1 + tolerance) x the real one. Each pass takes from every rank above that the
    cheapest piece that covers its excess (else its costliest pieces until covered), never one that would take
    the rank below the mean nor one carried over already (none waits twice); when a rank cannot come down that far,
    the others come down only to it (cutting them deeper would pad them and leave the step as long). `base`: every
    rank's cost besides its pieces (priced padding). Vectorised over the ranks; TRIM_PASSES passes at most.
    Returns the cap it held the ranks to (the placements after it keep to it).
    """
    for _ in range(TRIM_PASSES):
        cap = _trim_cap(st.rcost, tolerance, base)
        over = st.rcost > cap * (1.0 + 1e-12)
        if not over.any():
            break
        # the pieces on the ranks above, grouped by rank (ascending), each rank's in index order: one pass over
        # the pieces and a sort of those (no grouping of every rank; pieces only leave ranks here)
        cand = np.concatenate(([False], over))[st.rank + 1].nonzero()[0]
        cand = cand[order_by(st.rank[cand], st.lay.dp)]
        out = _cuts(st, cand, cap, priority)
        rest = st.rcost - np.bincount(st.rank[out], st.c[out], minlength=st.lay.dp)
        if float(rest.max()) > cap * (1.0 + 1e-12):  # a rank stays above: the others need not go below it
            cap = float(rest.max())
            out = _cuts(st, cand, cap, priority)
        if out.size == 0:
            break
        st.carry(out)
    return max(_trim_cap(st.rcost, tolerance, base), float(st.rcost.max()))


def _cuts(st: Rows, cand: np.ndarray, cap: float, priority: int) -> np.ndarray:
    """The pieces `trim` carries off the ranks above `cap` (see there); `cand`: the pieces on ranks above a cap
    at most `cap`, grouped by rank, each rank's in index order."""
    mean = float(st.rcost.mean())
    r, c = st.rank[cand], st.c[cand]
    rc = st.rcost[r]
    ok = (rc > cap * (1.0 + 1e-12)) & (cand >= priority) & (c <= rc - mean)
    cand, r, c = cand[ok], r[ok], c[ok]
    if cand.size == 0:
        return cand
    starts = run_starts(r)
    group = np.arange(starts.size).repeat(run_lengths(starts, r.size))
    excess = st.rcost[r[starts]] - cap  # per rank here
    over = excess[group]
    cover = np.where(c >= over, c, np.inf)
    least = np.minimum.reduceat(cover, starts)  # the cheapest piece that covers its rank's excess
    at = np.minimum.reduceat(np.where(cover == least[group], np.arange(r.size), r.size), starts)
    covered = np.isfinite(least)
    out = [cand[at[covered]]]
    if not covered.all():  # no piece covers: the costliest pieces, until they do
        keep = _costlier(c, group, starts, excess, ~covered)
        cs, rs, cc, xs = cand[keep], r[keep], c[keep], over[keep]
        # by rank, costliest first: one stable sort of a float key (rank apart by more than any cost; 3x a lexsort)
        o = (rs * (2.0 * float(cc.max()) + 1.0) - cc).argsort(kind="stable")
        cs, rs, cc, xs = cs[o], rs[o], cc[o], xs[o]
        before = cc.cumsum() - cc  # costs taken before each piece, within its rank
        first = run_starts(rs)
        before -= before[first].repeat(run_lengths(first, rs.size))
        out.append(cs[before < xs])
    return np.concatenate(out)


def _costlier(
    c: np.ndarray, group: np.ndarray, starts: np.ndarray, excess: np.ndarray, short: np.ndarray
) -> np.ndarray:
    """Of the pieces (costs `c`, grouped by rank: `group` of each, `starts` of each group, `excess` per group), those
    of the `short` groups that `_cuts` can take when it takes each rank's costliest until they cover the excess: the
    pieces costing at least COSTLIER x their rank's costliest where those cover it (a few per rank), else all of the
    rank's. (The sort that follows then orders a few pieces per rank, not all.) Indices, ascending. A group's sums
    run over its own pieces, as over the short groups alone (np.add.reduceat of a segment: the same in any array)."""
    high = c >= COSTLIER * np.maximum.reduceat(c, starts)[group]
    enough = np.add.reduceat(np.where(high, c, 0.0), starts) >= excess * (1.0 + 1e-9)  # (margin: rounding)
    return ((short & ~enough)[group] | (high & short[group])).nonzero()[0]
