"""Passes that improve a placement of `rows.Rows`: moves and swaps that lower the costliest rank, and
trades that bound the carry-over (short left-over pieces for fewer long placed ones)."""

from __future__ import annotations

import numpy as np

from .rows import Rows, order_by

__all__ = ["CARRY_KEEP", "CONSOLIDATE_PASSES", "consolidate", "refine"]

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
        self.bounds = np.searchsorted(rank[self.order], np.arange(dp + 1))  # rank -1 comes first
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
        r = int(np.argmax(st.rcost))
        top = st.rcost[r]
        mine = members(r)
        if mine.size == 0:
            return
        done = False
        for q in np.argsort(st.rcost, kind="stable")[:REFINE_PARTNERS].tolist():
            gap = top - st.rcost[q]
            if q == r or gap <= 0:
                break
            # move: a piece of r that fits a row of q, cost closest to gap/2
            fits = L[mine] <= st.maxrem[q]
            gain_move = np.where(fits & (c[mine] < gap), np.minimum(c[mine], gap - c[mine]), -1.0)
            theirs = members(q)
            best_swap = -1.0
            if theirs.size:
                d = c[mine][:, None] - c[theirs][None, :]
                room_r = st.rem[r, st.slot[mine]] + L[mine]  # free in a's row once a leaves
                room_q = st.rem[q, st.slot[theirs]] + L[theirs]
                ok = (d > 0) & (d < gap)
                ok &= (L[theirs][None, :] <= room_r[:, None]) & (L[mine][:, None] <= room_q[None, :])
                gain = np.where(ok, np.minimum(d, gap - d), -1.0)
                flat = int(np.argmax(gain))
                best_swap = float(gain.flat[flat])
            a = int(np.argmax(gain_move))
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


def consolidate(st: Rows, priority: int, movable: np.ndarray | None = None) -> bool:
    """Bound the carry-over: trade short left-over pieces for fewer long placed ones; False: none traded.

    With the cost cap, the pieces left over are the shortest of the step, and there can be many
    (the state would grow with dp). Beyond CARRY_KEEP of them, the shortest are cut into
    consecutive chunks, each covering the tokens of one placed piece X (at least
    CONSOLIDATE_RATIO times their mean length, at most half a row, not itself carried over, one
    per row, the costliest ranks first); a chunk takes X's place when it fits X's row and costs no more than
    X (no rank gets costlier), and X is carried instead. A chunk may fall short of X by less than
    one short piece, which adds that much padding. Vectorised; no loop over pieces.
    `movable` (bool per piece, None: all): only these are traded, either way (two stages: the text pieces).
    """
    left = np.flatnonzero(st.rank < 0)
    excess = left.size - CARRY_KEEP
    if excess <= 0:
        return False
    L, c, k = st.L, st.c, st.lay.slots
    if movable is not None:
        left = left[movable[left]]
    left = left[order_by(L[left], st.lay.seq_len + 1)][:excess]  # the shortest go first
    if left.size == 0:
        return False
    cand = np.flatnonzero(st.rank >= 0) if movable is None else np.flatnonzero((st.rank >= 0) & movable)
    lo = CONSOLIDATE_RATIO * float(L[left].mean())
    cand = cand[(cand >= priority) & (L[cand] >= lo) & (L[cand] <= st.lay.seq_len // 2)]
    if cand.size == 0:
        return False
    heavy_first = np.empty(st.lay.dp, np.int64)
    heavy_first[np.argsort(-st.rcost, kind="stable")] = np.arange(st.lay.dp)
    cand = cand[order_by(heavy_first[st.rank[cand]], st.lay.dp)]  # costliest ranks first
    key = st.rank[cand] * k + st.slot[cand]
    o = order_by(key, st.lay.dp * k)  # stable: each row's first candidate leads its group
    first = o[np.flatnonzero(np.diff(key[o], prepend=-1))]
    cand = cand[np.sort(first)]  # one per row, in the order above
    ends = np.cumsum(L[left])
    cost_ends = np.concatenate([[0.0], np.cumsum(c[left])])
    stop = np.searchsorted(ends, np.cumsum(L[cand]), side="left") + 1  # chunk j: left[start_j:stop_j]
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
    within = np.arange(int(counts.sum())) - np.repeat(np.cumsum(counts) - counts, counts)
    st.trade(cand, left[np.repeat(start, counts) + within], counts, dtok, dcost)
    return True
