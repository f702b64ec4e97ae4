"""Plumbing of balance.place: the fill state of one step and the moves on it.

`Rows` holds the free tokens of every row and the cost of every rank and micro-batch, and places
pieces in vectorised rounds (many pieces on distinct ranks, or tiny pieces into many rows at once).
"""

from __future__ import annotations

import numpy as np

from .layout import Layout

__all__ = ["Rows", "order_by"]

ROUND_DIV = 4  # a greedy round places at least dp / ROUND_DIV pieces...
TINY = 32  # ...and pieces shorter than seq_len / TINY go several per row (`_tiny_round`)
TAIL_GIVE_UP = 16  # a tiny round that places under 1/16 of the pieces left ends the step's filling
REFINE_PARTNERS = 4  # cheapest ranks tried as partners in each refinement pass
CARRY_KEEP = 1024  # left-over pieces kept as they are; beyond, `consolidate` trades them (state size)
CONSOLIDATE_RATIO = 8  # a traded placed piece is at least this many times the mean left-over

_BIG = np.iinfo(np.int64).max


def order_by(keys: np.ndarray, bound: int) -> np.ndarray:
    """Stable argsort of int keys in [0, bound): numpy's radix sort when they fit 16 bits (5x faster)."""
    if bound <= 1 << 16:
        return np.argsort(keys.astype(np.uint16), kind="stable")
    return np.argsort(keys, kind="stable")


class Rows:
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

        Row: the least projected micro-batch of the rank with a row the piece fits (so micro-batches
        balance as ranks do), its tightest such row; without `spread` (the carry-over, placed before
        the long pieces) simply the tightest row, which keeps whole rows free.
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
                score = self.mcost[ranks] + self.mtok[ranks] * rate  # micro-batch projections
                if self.lay.rows > 1:
                    score = score[:, self.micro_of]
                score = np.where(fit, score, np.inf)
                fit = score == score.min(axis=1, keepdims=True)
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
        many distinct ranks that can take the head piece: the lowest (highest) projected ones, at
        least dp/4 of them and more while their projections are within the head piece's effect of
        the extreme, where sequential LPT would choose among them anyway. Since the queue is longest
        first and `rate` is the average of what is left, nearly every round raises. Tiny pieces go
        by `_tiny_round`; pieces that fit nowhere any more are given up (the caller carries them).
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
            if L[head] < tiny and self.spread:  # (not for carry-over: it would touch every row)
                rest = self._tiny_round(queue, i)
                if rest is not None:
                    queue, i, n = rest, 0, rest.size
                    continue
            rate = self.pool_cost / self.pool_tok if self.pool_tok > 0 else 0.0
            cand = queue[i : i + elig.size]
            delta = c[cand] - L[cand] * rate
            grow = bool(delta[0] >= 0)
            same = delta >= 0 if grow else delta < 0
            run = cand.size if same[-1] and same.all() else int(np.argmin(same))
            proj = self.rcost[elig] + self.rtok[elig] * rate
            if grow:
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

    def _tiny_round(self, queue: np.ndarray, i: int) -> np.ndarray | None:
        """Place the next tiny pieces, many per rank and row; returns the queue left (None: none placed).

        Each row's free tokens are cut into slots the size of the longest piece here, plus one
        slot for the remainder. Slots are dealt round-robin over rows (the first slot of every row,
        then the second, ...; lower projected ranks first), remainders last, roomiest first, and the
        pieces, longest first, matched to them greedily: a piece takes the roomiest unused slot if
        it fits, else waits for the next round. A rank near the cap offers no more slots than the
        costliest of these pieces fits under it. Tiny pieces barely move a projection, so placing
        thousands at once costs no balance, and the tail (many short pieces, few rows with room)
        takes a few rounds instead of one per rank. When a round places only a trickle, the rest of
        the queue is given up (carried over): the room left is then on ranks at the cap.
        """
        L, c, lay = self.L, self.c, self.lay
        k = lay.slots
        cand = queue[i : i + 4 * lay.dp * k]
        size = int(L[cand[0]])
        full = self.rem // size
        part = self.rem % size >= L[cand[-1]]
        if self.capped:
            allow = np.floor((self.cap - self.rcost) / max(float(c[cand].max()), 1e-300)).astype(np.int64)
            room = allow[:, None] - (np.cumsum(full + part, axis=1) - (full + part))  # slots left in the rank
            full = np.clip(np.minimum(full, room), 0, None)
            part &= full < room
        rows = np.flatnonzero(full + part)
        if rows.size == 0:
            return None
        full, part = full.reshape(-1)[rows], part.reshape(-1)[rows]
        full = np.minimum(full, -(-cand.size // rows.size) + 1)  # enough for this round
        reps = full + part
        slot_row = np.repeat(rows, reps)
        nth = np.arange(slot_row.size) - np.repeat(np.cumsum(reps) - reps, reps)
        rem = self.rem.reshape(-1)
        slot_size = np.where(nth < np.repeat(full, reps), size, rem[slot_row] % size)
        rate = self.pool_cost / self.pool_tok if self.pool_tok > 0 else 0.0
        proj = self.rcost[slot_row // k] + self.rtok[slot_row // k] * rate
        o = np.lexsort((slot_row, proj, nth, -slot_size))
        slot_row, slot_size = slot_row[o], slot_size[o]
        fits = np.searchsorted(-slot_size, -L[cand], side="right")  # slots with room for each piece
        n = np.arange(cand.size)
        matched = np.minimum(n + 1, np.minimum.accumulate(fits - n) + n)  # greedy matches so far
        got = np.diff(matched, prepend=0) > 0
        if not got.any():
            return None
        rows = slot_row[matched[got] - 1]
        idx = cand[got]
        ranks, w = rows // k, rows % k
        l, cc = L[idx], c[idx]
        rem -= np.bincount(rows, l, minlength=rem.size).astype(np.int64)
        touched = np.unique(ranks)
        self.maxrem[touched] = self.rem[touched].max(axis=1)
        self.rtok -= np.bincount(ranks, l, minlength=lay.dp).astype(np.int64)
        self.rcost += np.bincount(ranks, cc, minlength=lay.dp)
        mi = ranks * lay.micro + self.micro_of[w]
        self.mcost += np.bincount(mi, cc, minlength=lay.dp * lay.micro).reshape(lay.dp, lay.micro)
        self.mtok -= np.bincount(mi, l, minlength=lay.dp * lay.micro).astype(np.int64).reshape(lay.dp, lay.micro)
        self.rank[idx] = ranks
        self.slot[idx] = w
        self.pool_cost -= float(cc.sum())
        self.pool_tok -= int(l.sum())
        rest = np.concatenate([cand[~got], queue[i + cand.size :]])
        if idx.size * TAIL_GIVE_UP < rest.size:  # a trickle: the room left is on ranks at the cap
            self.give_up(rest)
            return rest[:0]
        return rest

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
        """Lower the costliest rank by moving or swapping one piece with a cheap rank, while it helps.

        Each pass tries the REFINE_PARTNERS cheapest ranks: the move or swap whose cost difference
        is closest to half the gap, among those whose pieces fit the rows they go to.
        """
        L, c = self.L, self.c
        order = order_by(self.rank + 1, self.lay.dp + 1)  # members by rank; moves are tracked in `moved`
        bounds = np.searchsorted(self.rank[order], np.arange(self.lay.dp + 1))  # rank -1 comes first
        moved: dict[int, list[int]] = {}

        def members(r: int) -> np.ndarray:
            own = order[bounds[r] : bounds[r + 1]]
            if r in moved:
                own = np.concatenate([own, np.array(moved[r], np.int64)])
            return own[self.rank[own] == r]

        for _ in range(iters):
            r = int(np.argmax(self.rcost))
            top = self.rcost[r]
            mine = members(r)
            if mine.size == 0:
                return
            done = False
            for q in np.argsort(self.rcost, kind="stable")[:REFINE_PARTNERS].tolist():
                gap = top - self.rcost[q]
                if q == r or gap <= 0:
                    break
                # move: a piece of r that fits a row of q, cost closest to gap/2
                fits = L[mine] <= self.maxrem[q]
                gain_move = np.where(fits & (c[mine] < gap), np.minimum(c[mine], gap - c[mine]), -1.0)
                theirs = members(q)
                best_swap = -1.0
                if theirs.size:
                    d = c[mine][:, None] - c[theirs][None, :]
                    room_r = self.rem[r, self.slot[mine]] + L[mine]  # free in a's row once a leaves
                    room_q = self.rem[q, self.slot[theirs]] + L[theirs]
                    ok = (d > 0) & (d < gap)
                    ok &= (L[theirs][None, :] <= room_r[:, None]) & (L[mine][:, None] <= room_q[None, :])
                    gain = np.where(ok, np.minimum(d, gap - d), -1.0)
                    flat = int(np.argmax(gain))
                    best_swap = float(gain.flat[flat])
                a = int(np.argmax(gain_move))
                if max(gain_move[a], best_swap) <= 0:
                    continue
                if gain_move[a] >= best_swap:
                    self._move(int(mine[a]), q)
                    moved.setdefault(q, []).append(int(mine[a]))
                else:
                    ia, ib = divmod(flat, theirs.size)
                    self._swap(int(mine[ia]), int(theirs[ib]))
                    moved.setdefault(q, []).append(int(mine[ia]))
                    moved.setdefault(r, []).append(int(theirs[ib]))
                done = True
                break
            if not done:
                return

    def consolidate(self, priority: int) -> bool:
        """Bound the carry-over: trade short left-over pieces for fewer long placed ones.

        With the cost cap, the pieces left over are the shortest of the step, and there can be many
        (the state would grow with dp). Beyond CARRY_KEEP of them, the shortest are cut into
        consecutive chunks, each covering the tokens of one placed piece X (at least
        CONSOLIDATE_RATIO times their mean length, at most half a row, not itself carried over, one
        per row, the costliest ranks first); a chunk takes X's place when it fits X's row and costs no more than
        X (no rank gets costlier), and X is carried instead. A chunk may fall short of X by less than
        one short piece, which adds that much padding. Vectorised; no loop over pieces.
        """
        left = np.flatnonzero(self.rank < 0)
        excess = left.size - CARRY_KEEP
        if excess <= 0:
            return False
        L, c, k = self.L, self.c, self.lay.slots
        left = left[order_by(L[left], self.lay.seq_len + 1)][:excess]  # the shortest go first
        cand = np.flatnonzero(self.rank >= 0)
        lo = CONSOLIDATE_RATIO * float(L[left].mean())
        cand = cand[(cand >= priority) & (L[cand] >= lo) & (L[cand] <= self.lay.seq_len // 2)]
        if cand.size == 0:
            return False
        heavy_first = np.empty(self.lay.dp, np.int64)
        heavy_first[np.argsort(-self.rcost, kind="stable")] = np.arange(self.lay.dp)
        cand = cand[order_by(heavy_first[self.rank[cand]], self.lay.dp)]  # costliest ranks first
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
            return False
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
        return True

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

    def result(self) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
        """(rank, slot) per piece, cost per rank, cost per (rank, micro-batch)."""
        return self.rank, self.slot, self.rcost, self.mcost
