"""Balancing: put document pieces into the rows of DP ranks so that the costliest rank is as cheap as possible.

Two layers. `kk_partition` and `greedy_partition` are plain multiway number partitioning (equalise
sums over k bins). `place` solves the planner's problem: pieces must also fit rows of seq_len tokens
and every rank has the same rows, so with the attention cost a rank costs
`beta*tokens + alpha*sum(len**2)` under a token budget. It balances each rank's *projected* cost,
`cost so far + free tokens * rate`, where `rate` is the cost per token of the pieces not yet placed:
a piece longer than average raises a projection (it goes to the lowest rank), a shorter one lowers
it (it goes to the highest), so long documents spread out and short ones fill the heavy ranks' gaps.
Each round places many pieces on distinct ranks at once (vectorised over ranks, not per piece).
"""

from __future__ import annotations

import heapq
from collections.abc import Callable
from dataclasses import dataclass
from enum import Enum

import numpy as np

from msdata_server.errors import ConfigError

from .pack import next_fit

__all__ = ["Layout", "Method", "PARTITIONERS", "Placement", "greedy_partition", "kk_partition", "method_of", "place"]

# Largest (pieces x ranks) for which "karmarkar_karp" runs exact largest differencing on the long
# pieces (O(n * dp log dp)); above it, where every rank holds many pieces and greedy balances as well,
# it uses the greedy rounds, to keep dp=512 under 100 ms (see `place`).
KK_BUDGET = 1 << 17
ROUND_DIV = 4  # a greedy round places at least dp / ROUND_DIV pieces...
TINY = 64  # ...and pieces shorter than seq_len / TINY go to every eligible rank at once
REFINE_ITERS = 32  # bounded refinement: move/swap passes that lower the costliest rank
REFINE_PARTNERS = 4  # cheapest ranks tried as partners in each pass
CARRY_KEEP = 1024  # left-over pieces kept as they are; beyond, `consolidate` trades them (state size)
CONSOLIDATE_RATIO = 8  # a traded placed piece is at least this many times the mean left-over

_BIG = np.iinfo(np.int64).max


class Method(str, Enum):
    """Balance methods, picked by name."""

    KARMARKAR_KARP = "karmarkar_karp"
    GREEDY = "greedy"
    NONE = "none"


METHOD_CHOICES = ", ".join(repr(m.value) for m in Method)


def method_of(value: str) -> Method:
    """Parse a method name; ConfigError listing the choices."""
    try:
        return Method(value)
    except ValueError:
        raise ConfigError(f"method={value!r} is not one of {METHOD_CHOICES}") from None


@dataclass(frozen=True, slots=True, kw_only=True)
class Layout:
    """The shape one step fills: dp ranks x micro-batches x rows of seq_len tokens."""

    dp: int
    micro: int
    rows: int
    seq_len: int

    @property
    def slots(self) -> int:
        """Rows per rank."""
        return self.micro * self.rows

    @property
    def capacity(self) -> int:
        """Tokens per step."""
        return self.dp * self.slots * self.seq_len


@dataclass(frozen=True, slots=True)
class Placement:
    """Where each piece went: rank and row slot (micro = slot // rows, row = slot % rows); -1 = carried."""

    rank: np.ndarray  # int64 per piece
    slot: np.ndarray  # int64 per piece
    rank_cost: np.ndarray  # float64 [dp]
    micro_cost: np.ndarray  # float64 [dp, micro]


# ---------------------------------------------------------------------------------------------
# plain number partitioning


def _resolve(parent: np.ndarray) -> np.ndarray:
    """Roots of a forest given as parent pointers (pointer jumping, vectorised)."""
    while True:
        nxt = parent[parent]
        if np.array_equal(nxt, parent):
            return parent
        parent = nxt


def kk_partition(values: np.ndarray, k: int, loads: np.ndarray | None = None) -> np.ndarray:
    """Largest differencing (Karmarkar–Karp) k-way partition: the bin of each value.

    Each value starts as a k-tuple (v, 0, ..., 0); the two tuples with the largest spread are merged
    (largest entry of one with the smallest of the other) until one tuple is left. `loads` (length k),
    if given, is the bins' existing content and joins as one more tuple, so bin i of the answer is the
    bin whose load was loads[i]. O(n k log k).
    """
    values = np.asarray(values, dtype=np.float64)
    n = values.size
    if k < 1:
        raise ConfigError(f"{k=} must be >= 1")
    if k == 1 or n == 0:
        return np.zeros(n, np.int64)
    parent = np.arange(n + k, dtype=np.int64)  # ids 0..n-1 are values, n..n+k-1 the existing bins
    heap: list[tuple[float, int, np.ndarray, np.ndarray]] = []
    for i in np.argsort(-values, kind="stable"):
        v = np.zeros(k)
        v[0] = values[i]
        ids = np.full(k, -1, np.int64)
        ids[0] = i
        heap.append((-float(values[i]), int(i), v, ids))
    if loads is not None:
        loads = np.asarray(loads, dtype=np.float64)
        o = np.argsort(-loads, kind="stable")
        v = loads[o] - loads[o[-1]]
        heap.append((-float(v[0]), n, v, n + o.astype(np.int64)))
    heapq.heapify(heap)
    tie = n + 1
    while len(heap) > 1:
        _, _, va, ia = heapq.heappop(heap)
        _, _, vb, ib = heapq.heappop(heap)
        vb, ib = vb[::-1], ib[::-1]  # largest of one with smallest of the other
        v = va + vb
        both = (ia >= 0) & (ib >= 0)
        parent[ib[both]] = ia[both]
        ids = np.where(ia >= 0, ia, ib)
        o = np.argsort(-v, kind="stable")
        v, ids = v[o], ids[o]
        v -= v[-1]
        heapq.heappush(heap, (-float(v[0]), tie, v, ids))
        tie += 1
    final = heap[0][3]
    root = _resolve(parent)
    pos_of = np.full(n + k, -1, np.int64)
    valid = final >= 0
    pos_of[final[valid]] = np.flatnonzero(valid)
    pos = pos_of[root]
    if loads is None:
        return pos[:n]
    bin_of_pos = np.empty(k, np.int64)
    bin_of_pos[pos[n:]] = np.arange(k)
    return bin_of_pos[pos[:n]]


def greedy_partition(values: np.ndarray, k: int, loads: np.ndarray | None = None) -> np.ndarray:
    """Longest processing time first: each value, largest first, to the currently lightest bin."""
    values = np.asarray(values, dtype=np.float64)
    if k < 1:
        raise ConfigError(f"{k=} must be >= 1")
    base = np.zeros(k) if loads is None else np.asarray(loads, dtype=np.float64)
    heap = [(float(base[b]), b) for b in range(k)]
    heapq.heapify(heap)
    out = np.zeros(values.size, np.int64)
    for i in np.argsort(-values, kind="stable"):
        load, b = heapq.heappop(heap)
        out[i] = b
        heapq.heappush(heap, (load + float(values[i]), b))
    return out


PARTITIONERS: dict[str, Callable[..., np.ndarray]] = {
    Method.GREEDY.value: greedy_partition,
    Method.KARMARKAR_KARP.value: kk_partition,
}


# ---------------------------------------------------------------------------------------------
# placement into rows


class _Rows:
    """Mutable fill state of one step: free tokens per row, cost per rank and micro-batch."""

    def __init__(self, lengths: np.ndarray, costs: np.ndarray, layout: Layout):
        self.L, self.c, self.lay = lengths, costs, layout
        dp, k = layout.dp, layout.slots
        self.rem = np.full((dp, k), layout.seq_len, np.int64)
        self.maxrem = np.full(dp, layout.seq_len, np.int64)
        self.rtok = np.full(dp, k * layout.seq_len, np.int64)
        self.rcost = np.zeros(dp)
        self.mcost = np.zeros((dp, layout.micro))
        self.mtok = np.full((dp, layout.micro), layout.rows * layout.seq_len, np.int64)
        self.micro_of = np.arange(k) // layout.rows
        self.rank = np.full(lengths.size, -1, np.int64)
        self.slot = np.full(lengths.size, -1, np.int64)
        self.pool_cost = float(costs.sum())  # pieces not yet placed or given up
        self.pool_tok = int(lengths.sum())
        self.cap = np.inf
        self.capped = False
        self.spread = True
        self.monotone = True  # cost never decreases with length (set by `place`)
        self.long = costs * float(lengths.sum()) > lengths * float(costs.sum())  # cost per token above average

    def set_cap(self, desc: np.ndarray, tolerance: float | None) -> None:
        """Cap rank costs at (1 + tolerance) x the mean expected if the longest pieces fill the step.

        (Pieces left over are the shortest, so the placed ones are the longest that fit.)
        """
        if tolerance is None or desc.size == 0:
            return
        n = int(np.searchsorted(np.cumsum(self.L[desc]), self.lay.capacity, side="right"))
        mean = float(self.c[desc[: max(n, 1)]].sum()) / self.lay.dp
        self.cap = max(mean * (1.0 + tolerance), float(self.c.max()))
        self.capped = True

    def rate(self) -> float:
        return self.pool_cost / self.pool_tok if self.pool_tok > 0 else 0.0

    def give_up(self, idx: np.ndarray) -> None:
        self.pool_cost -= float(self.c[idx].sum())
        self.pool_tok -= int(self.L[idx].sum())

    def put(self, idx: np.ndarray, ranks: np.ndarray, rate: float, check: bool = True) -> np.ndarray:
        """Put pieces idx on distinct ranks; returns a mask of the pieces that did not fit (or pass the cap).

        Row: a long piece (above the step's average) goes to the least projected micro-batch with a
        row it fits, spreading long pieces over micro-batches; a short one, and ties, to the
        tightest row it fits (best fit keeps whole rows free for later long pieces).
        """
        l = self.L[idx]
        c = self.c[idx]
        bad = np.zeros(idx.size, bool)
        if check:
            bad = self.maxrem[ranks] < l
            if self.capped:
                bad |= self.rcost[ranks] + c > self.cap
            if bad.any():
                ok = ~bad
                idx, ranks, l, c = idx[ok], ranks[ok], l[ok], c[ok]
        k = self.lay.slots
        if k == 1:
            w = np.zeros(idx.size, np.int64)
        else:
            rr = self.rem[ranks]
            fit = rr >= l[:, None]
            if self.spread and self.lay.micro > 1:
                long = self.long[idx]
                if long.any():
                    score = self.mcost[ranks] + self.mtok[ranks] * rate
                    if self.lay.rows > 1:
                        score = score[:, self.micro_of]
                    score = np.where(fit, score, np.inf)
                    fit = np.where(long[:, None], score == score.min(axis=1, keepdims=True), fit)
            w = np.argmin(np.where(fit, rr, _BIG), axis=1)
        self.rem.reshape(-1)[ranks * k + w] -= l
        self.maxrem[ranks] = self.rem[ranks].max(axis=1) if k > 1 else self.rem[ranks, 0]
        self.rtok[ranks] -= l
        self.rcost[ranks] += c
        if self.lay.micro > 1:
            mi = ranks * self.lay.micro + self.micro_of[w]
            self.mcost.reshape(-1)[mi] += c
            self.mtok.reshape(-1)[mi] -= l
        else:
            self.mcost[ranks, 0] += c
            self.mtok[ranks, 0] -= l
        self.rank[idx] = ranks
        self.slot[idx] = w
        self.pool_cost -= float(c.sum())
        self.pool_tok -= int(l.sum())
        return bad

    def greedy(self, queue: np.ndarray) -> None:
        """Place queue (longest first) in rounds; each round pairs pieces with ranks by projection.

        A round takes the next pieces that all raise (or all lower) a projection and gives them to as
        many distinct ranks: the lowest (highest) projected ones, at least dp/4 of them (all eligible
        ones for tiny pieces) and more while their projections are within the head piece's effect of
        the extreme, where LPT's choice among them would not matter. Since the queue is longest first
        and `rate` is the average of what is left, nearly every round raises.
        """
        L, c = self.L, self.c
        floor = max(1, self.lay.dp // ROUND_DIV)
        tiny = self.lay.seq_len / TINY
        retry: list[np.ndarray] = []
        i, n = 0, queue.size
        while i < n:
            head = queue[i]
            mask = self.maxrem >= L[head]
            if self.capped:
                mask &= self.rcost <= self.cap - c[head]
            elig = np.flatnonzero(mask)
            if elig.size == 0:
                queue, i = self._drop_infeasible(queue, i), 0
                n = queue.size
                continue
            rate = self.pool_cost / self.pool_tok if self.pool_tok > 0 else 0.0
            cand = queue[i : i + elig.size]
            delta = c[cand] - L[cand] * rate
            grow = bool(delta[0] >= 0)
            same = delta >= 0 if grow else delta < 0
            run = cand.size if same[-1] and same.all() else int(np.argmin(same))
            proj = self.rcost[elig] + self.rtok[elig] * rate
            if L[head] < tiny:
                near = elig.size
            elif grow:
                near = int(np.count_nonzero(proj <= proj.min() + delta[0]))
            else:
                near = int(np.count_nonzero(proj >= proj.max() + delta[:run].min()))
            take = min(run, max(near, floor))
            idx = cand[:take]
            by_proj = elig[np.argsort(proj, kind="stable")]
            if grow:  # the largest raise to the lowest projection
                ranks = by_proj[:take]
            else:  # the largest lowering to the highest projection
                ranks = np.empty(take, np.int64)
                ranks[np.argsort(delta[:take], kind="stable")] = by_proj[::-1][:take]
            # ranks were chosen to fit the head; pieces after it are shorter and, when cost grows
            # with length, no costlier, so they fit too
            failed = self.put(idx, ranks, rate, check=not self.monotone)
            if failed.any():
                retry.append(idx[failed])
            i += take
        for piece in np.concatenate(retry) if retry else ():  # a cost_fn not growing with length; rare
            self.one(int(piece))

    def _drop_infeasible(self, queue: np.ndarray, i: int) -> np.ndarray:
        """Give up the next queued pieces (from i) that fit no rank now, hence never will; return the rest.

        Checks a window of the queue (later pieces are shorter, so likelier to fit, and get checked
        when they come up); the queue's head afterwards fits somewhere, or the queue is empty.
        """
        o = np.argsort(-self.maxrem, kind="stable")
        room = self.maxrem[o]
        budget = np.maximum.accumulate(self.cap - self.rcost[o])
        window = max(4 * self.lay.dp, 1024)
        while i < queue.size:
            part = queue[i : i + window]
            cnt = np.searchsorted(-room, -self.L[part], side="right")  # ranks with a row this long
            feasible = (cnt > 0) & (budget[np.maximum(cnt - 1, 0)] >= self.c[part])
            self.give_up(part[~feasible])
            if feasible.any():
                return np.concatenate([part[feasible], queue[i + part.size :]])
            i += part.size
        return queue[:0]

    def one(self, piece: int) -> None:
        """Place a single piece on the best eligible rank, or give it up."""
        elig = np.flatnonzero((self.maxrem >= self.L[piece]) & (self.rcost + self.c[piece] <= self.cap))
        if elig.size == 0:
            self.give_up(np.array([piece]))
            return
        rate = self.rate()
        proj = self.rcost[elig] + self.rtok[elig] * rate
        grow = self.c[piece] - self.L[piece] * rate >= 0
        r = elig[np.argmin(proj)] if grow else elig[np.argmax(proj)]
        self.put(np.array([piece]), np.array([r]), rate)

    def fixed(self, idx: np.ndarray, ranks: np.ndarray) -> np.ndarray:
        """Place pieces on given ranks, each rank's longest first; returns the pieces that did not fit."""
        if idx.size == 0:
            return idx
        o = np.lexsort((idx, -self.L[idx], ranks))
        idx, ranks = idx[o], ranks[o]
        starts = np.flatnonzero(np.r_[True, ranks[1:] != ranks[:-1]])
        nth = np.arange(idx.size) - np.repeat(starts, np.diff(np.r_[starts, idx.size]))
        failed = []
        for j in range(int(nth.max()) + 1):
            sel = np.flatnonzero(nth == j)
            rate = self.rate()
            bad = self.put(idx[sel], ranks[sel], rate)
            failed.append(idx[sel][bad])
        return np.concatenate(failed)

    def refine(self, iters: int) -> None:
        """Lower the costliest rank by moving or swapping one piece with a cheap rank, while it helps."""
        L, c = self.L, self.c
        for _ in range(iters):
            r = int(np.argmax(self.rcost))
            top = self.rcost[r]
            mine = np.flatnonzero(self.rank == r)
            if mine.size == 0:
                return
            done = False
            for q in np.argsort(self.rcost, kind="stable")[:REFINE_PARTNERS]:
                q = int(q)
                gap = top - self.rcost[q]
                if q == r or gap <= 0:
                    break
                # move: a piece of r that fits a row of q, cost closest to gap/2
                fits = L[mine] <= self.maxrem[q]
                gain_move = np.where(fits & (c[mine] < gap), np.minimum(c[mine], gap - c[mine]), -1.0)
                theirs = np.flatnonzero(self.rank == q)
                best_swap = -1.0
                if theirs.size:
                    d = c[mine][:, None] - c[theirs][None, :]
                    room_r = self.rem[r, self.slot[mine]] + L[mine]  # free in a's row once a leaves
                    room_q = self.rem[q, self.slot[theirs]] + L[theirs]
                    ok = (d > 0) & (d < gap) & (L[theirs][None, :] <= room_r[:, None]) & (L[mine][:, None] <= room_q[None, :])
                    gain = np.where(ok, np.minimum(d, gap - d), -1.0)
                    flat = int(np.argmax(gain))
                    best_swap = float(gain.flat[flat])
                a = int(np.argmax(gain_move))
                if max(gain_move[a], best_swap) <= 0:
                    continue
                if gain_move[a] >= best_swap:
                    self._move(int(mine[a]), q)
                else:
                    ia, ib = divmod(flat, theirs.size)
                    self._swap(int(mine[ia]), int(theirs[ib]))
                done = True
                break
            if not done:
                return

    def consolidate(self, priority: int) -> None:
        """Bound the carry-over: trade short left-over pieces for fewer long placed ones.

        With the cost cap, the pieces left over are the shortest of the step, and there can be many
        (the state would grow with dp). Beyond CARRY_KEEP of them, the shortest are cut into
        consecutive chunks, each covering the tokens of one placed piece X (at least
        CONSOLIDATE_RATIO times their mean length, not itself carried over, one per row, the
        costliest ranks first); a chunk takes X's place when it fits X's row and costs no more than
        X (no rank gets costlier), and X is carried instead. A chunk may fall short of X by less than
        one short piece, which adds that much padding. Vectorised; no loop over pieces.
        """
        left = np.flatnonzero(self.rank < 0)
        excess = left.size - CARRY_KEEP
        if excess <= 0:
            return
        L, c, k = self.L, self.c, self.lay.slots
        left = left[np.lexsort((left, L[left]))][:excess]  # the shortest go first
        cand = np.flatnonzero(self.rank >= 0)
        lo = CONSOLIDATE_RATIO * float(L[left].mean())
        cand = cand[(cand >= priority) & (L[cand] >= lo) & (L[cand] <= self.lay.seq_len // 2)]
        if cand.size == 0:
            return
        cand = cand[np.lexsort((cand, -L[cand], -self.rcost[self.rank[cand]]))]
        _, first = np.unique(self.rank[cand] * k + self.slot[cand], return_index=True)
        cand = cand[np.sort(first)]  # one per row, in the order above
        ends = np.cumsum(L[left])
        cost_ends = np.concatenate([[0.0], np.cumsum(c[left])])
        stop = np.searchsorted(ends, np.cumsum(L[cand]), side="left") + 1  # chunk j: left[start_j:stop_j]
        keep = stop <= left.size
        cand, stop = cand[keep], stop[keep]
        start = np.concatenate([[0], stop[:-1]])
        tok = ends[stop - 1] - np.where(start > 0, ends[start - 1], 0)
        r, w = self.rank[cand], self.slot[cand]
        ok = (stop > start) & (tok <= L[cand] + self.rem[r, w]) & (cost_ends[stop] - cost_ends[start] <= c[cand])
        ok &= tok >= L[cand] - int(L[left].max())
        if not ok.any():
            return
        cand, start, stop, tok, r, w = cand[ok], start[ok], stop[ok], tok[ok], r[ok], w[ok]
        dtok = L[cand] - tok
        dcost = cost_ends[stop] - cost_ends[start] - c[cand]
        m = self.micro_of[w]
        self.rem[r, w] += dtok
        np.add.at(self.rtok, r, dtok)
        np.add.at(self.rcost, r, dcost)
        np.add.at(self.mcost, (r, m), dcost)
        np.add.at(self.mtok, (r, m), dtok)
        touched = np.unique(r)
        self.maxrem[touched] = self.rem[touched].max(axis=1)
        self.rank[cand] = self.slot[cand] = -1
        counts = stop - start
        within = np.arange(int(counts.sum())) - np.repeat(np.cumsum(counts) - counts, counts)
        pieces = left[np.repeat(start, counts) + within]
        self.rank[pieces] = np.repeat(r, counts)
        self.slot[pieces] = np.repeat(w, counts)

    def _take(self, p: int) -> tuple[int, int]:
        r, w = int(self.rank[p]), int(self.slot[p])
        m = self.micro_of[w]
        self.rem[r, w] += self.L[p]
        self.maxrem[r] = self.rem[r].max()
        self.rtok[r] += self.L[p]
        self.rcost[r] -= self.c[p]
        self.mcost[r, m] -= self.c[p]
        self.mtok[r, m] += self.L[p]
        return r, w

    def _drop(self, p: int, r: int, w: int) -> None:
        m = self.micro_of[w]
        self.rem[r, w] -= self.L[p]
        self.maxrem[r] = self.rem[r].max()
        self.rtok[r] -= self.L[p]
        self.rcost[r] += self.c[p]
        self.mcost[r, m] += self.c[p]
        self.mtok[r, m] -= self.L[p]
        self.rank[p], self.slot[p] = r, w

    def _move(self, p: int, q: int) -> None:
        self._take(p)
        free = self.rem[q]
        w = int(np.argmin(np.where(free >= self.L[p], free, _BIG)))  # best fit
        self._drop(p, q, w)

    def _swap(self, a: int, b: int) -> None:
        ra, wa = self._take(a)
        rb, wb = self._take(b)
        self._drop(a, rb, wb)
        self._drop(b, ra, wa)

    def result(self) -> Placement:
        return Placement(rank=self.rank, slot=self.slot, rank_cost=self.rcost, micro_cost=self.mcost)


def place(
    lengths: np.ndarray,
    costs: np.ndarray,
    layout: Layout,
    *,
    method: Method | str = Method.KARMARKAR_KARP,
    priority: int = 0,
    tolerance: float | None = 0.01,
) -> Placement:
    """Place pieces into rows of `layout`; pieces that do not fit get rank -1 (the caller carries them).

    The first `priority` pieces (carry-over from the last step) are placed before all others. Then
    "karmarkar_karp" partitions the pieces longer than average by largest differencing (with the
    ranks' loads so far as one more tuple) and fills in the rest with the greedy rounds; above
    KK_BUDGET pieces x ranks it uses the greedy rounds for all (same balance at that scale, far
    cheaper). "greedy" uses the rounds for all; both end with a few refinement swaps. "none" packs
    in the given order, rank by rank (the baseline). `tolerance`: a rank stops taking pieces once its
    cost would pass (1 + tolerance) x the mean, leaving padding where that shortens the step; None: never.
    """
    method = method_of(method) if isinstance(method, str) else method
    lengths = np.asarray(lengths, dtype=np.int64)
    costs = np.asarray(costs, dtype=np.float64)
    if method is Method.NONE:
        return _arrival(lengths, costs, layout)
    st = _Rows(lengths, costs, layout)
    n = lengths.size
    desc = np.argsort(-lengths, kind="stable")
    st.set_cap(desc, tolerance)
    st.monotone = bool(np.all(np.diff(costs[desc]) <= 0))
    # carry-over first, so that no piece is left over twice; best fit, which keeps whole rows free
    # for the long pieces that follow
    early = desc < priority
    st.spread = False
    st.greedy(desc[early])
    st.spread = True
    rest = desc[~early]
    if method is Method.KARMARKAR_KARP and layout.dp > 1 and rest.size:
        rate = st.rate()
        long = costs[rest] - lengths[rest] * rate > 0
        big = rest[long]
        if big.size and big.size * layout.dp <= KK_BUDGET:
            # project with the rate of the shorter pieces, which will fill the rest of the rows
            short = rest[~long]
            fill = float(costs[short].sum()) / max(int(lengths[short].sum()), 1)
            loads = st.rcost + st.rtok * fill
            ranks = kk_partition(costs[big] - lengths[big] * fill, layout.dp, loads)
            failed = st.fixed(big, ranks)
            keep = np.ones(n, bool)
            keep[big] = False
            keep[failed] = True
            rest = rest[keep[rest]]
    st.greedy(rest)
    st.refine(REFINE_ITERS)
    st.consolidate(priority)
    return st.result()


def _arrival(lengths: np.ndarray, costs: np.ndarray, layout: Layout) -> Placement:
    """Method "none": next-fit in the given order over rank 0's rows, then rank 1's, and so on."""
    row = next_fit(lengths, layout.dp * layout.slots, layout.seq_len)
    ok = row >= 0
    rank = np.where(ok, row // layout.slots, -1)
    slot = np.where(ok, row % layout.slots, -1)
    rank_cost = np.bincount(rank[ok], costs[ok], minlength=layout.dp)
    micro = rank[ok] * layout.micro + slot[ok] // layout.rows
    micro_cost = np.bincount(micro, costs[ok], minlength=layout.dp * layout.micro).reshape(layout.dp, layout.micro)
    return Placement(rank=rank, slot=slot, rank_cost=rank_cost, micro_cost=micro_cost)
