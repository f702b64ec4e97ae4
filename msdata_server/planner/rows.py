"""The engine of balance.place: the fill state of one step and the placement rounds on it.

`Rows` holds the free tokens of every row and the cost of every rank and micro-batch, and places
pieces in vectorised rounds (many pieces on distinct ranks, or tiny pieces into many rows at once,
matched by `fit`); `refine` holds the passes that improve a placement.
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np

from .fit import match_tiny, pair_few, pair_round, run_lengths, run_starts, scan_infeasible
from .layout import Layout
from .partition import kk_partition

__all__ = ["Rows", "order_by"]

ROUND_DIV = 4  # a greedy round places at least dp / ROUND_DIV pieces (Rows.round_div)...
TINY = 32  # ...and pieces shorter than seq_len / TINY go several per row (`_tiny_round`)
TAIL_GIVE_UP = 16  # a tiny round that places under 1/16 of the pieces left ends the step's filling
FEW = 4  # a round with at most this many eligible ranks runs in Python floats (`pair_few`, `Rows._put_few`)

_BIG = np.iinfo(np.int64).max
_COLUMNS = 8  # row_max/row_min: a loop over up to this many columns, else argmax and a gather


def _by_columns(a: np.ndarray, ufunc: np.ufunc, wide: Callable[[np.ndarray], np.ndarray]) -> np.ndarray:
    """``ufunc`` reduced along the short last axis of a 2-d array, one column at a time (numpy reduces a short last
    axis row by row, 10-20x slower); ``wide`` for more than _COLUMNS columns."""
    if a.shape[1] > _COLUMNS:
        return wide(a)
    if a.shape[1] == 1:
        return a[:, 0].copy()
    m = ufunc(a[:, 0], a[:, 1])
    for j in range(2, a.shape[1]):
        ufunc(m, a[:, j], out=m)
    return m


def row_max(a: np.ndarray) -> np.ndarray:
    """a.max(axis=1) of a 2-d array, faster (see _by_columns)."""
    return _by_columns(a, np.maximum, lambda w: w[np.arange(w.shape[0]), w.argmax(axis=1)])


def row_sum(a: np.ndarray) -> np.ndarray:
    """a.sum(axis=1) of a 2-d integer array (integers: the same in any order)."""
    return _by_columns(a, np.add, lambda w: w.sum(axis=1))


def row_min(a: np.ndarray) -> np.ndarray:
    """a.min(axis=1) of a 2-d array (see row_max)."""
    return _by_columns(a, np.minimum, lambda w: w[np.arange(w.shape[0]), w.argmin(axis=1)])


def order_by(keys: np.ndarray, bound: int) -> np.ndarray:
    """Stable argsort of int keys in [0, bound): numpy's radix sort when they fit 16 bits (5x faster)."""
    if bound <= 1 << 16:
        return keys.astype(np.uint16).argsort(kind="stable")
    return keys.argsort(kind="stable")


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
        self._rem_flat, self._mcost_flat, self._mtok_flat = (
            self.rem.reshape(-1),
            self.mcost.reshape(-1),
            self.mtok.reshape(-1),
        )
        self._none_bad = np.zeros(dp, bool)
        self._none_bad.flags.writeable = False
        self.rank = np.full(lengths.size, -1, np.int64)
        self.slot = np.full(lengths.size, -1, np.int64)
        self.pool_cost = float(costs.sum())  # pieces not yet placed or given up
        self.pool_tok = int(lengths.sum())
        self.cap = np.inf
        self.capped = False
        self.spread = True
        self.monotone = True  # cost never decreases with length (set by `place`)
        self.round_div = ROUND_DIV  # a greedy round's least size: dp / round_div (balance._fill sets its own)
        self.desc: np.ndarray | None = None  # the pieces longest first, ties in order (set by `place`), if known
        self.neg_len: np.ndarray | None = None  # -L[desc], ascending (set with desc, or refine.consolidate makes it)

    def set_cap(
        self,
        desc: np.ndarray,
        tolerance: float | None,
        base: float = 0.0,
        desc_len: np.ndarray | None = None,
        desc_cost: np.ndarray | None = None,
    ) -> None:
        """Cap rank costs at (1 + tolerance) x the mean expected if the longest pieces fill the step.

        (Pieces left over are the shortest, so the placed ones are the longest that fit.) `base`: what every
        rank costs besides its pieces (priced padding: pad_cost x its tokens; see cost.priced), which the
        tolerance applies to as well. `desc_len`, `desc_cost`: L[desc] and c[desc], when the caller has them.
        """
        if tolerance is None or desc.size == 0:
            return
        ends = (self.L[desc] if desc_len is None else desc_len).cumsum()
        n = int(ends.searchsorted(self.lay.capacity, side="right"))
        head = self.c[desc[: max(n, 1)]] if desc_cost is None else desc_cost[: max(n, 1)]  # (the same sum)
        mean = float(head.sum()) / self.lay.dp
        self.cap = max((mean + base) * (1.0 + tolerance) - base, float(self.c.max()))
        self.capped = True

    def rate(self) -> float:
        return self.pool_cost / self.pool_tok if self.pool_tok > 0 else 0.0

    def give_up(self, idx: np.ndarray) -> None:
        self.pool_cost -= float(self.c[idx].sum())
        self.pool_tok -= int(self.L[idx].sum())

    def put(
        self,
        idx: np.ndarray,
        ranks: np.ndarray,
        rate: float,
        check: bool = True,
        toks: np.ndarray | None = None,
        c: np.ndarray | None = None,
    ) -> np.ndarray:
        """Put pieces idx on distinct ranks; returns a mask of the pieces that did not fit (or pass the cap).

        Row: the least projected micro-batch of the rank with a row the piece fits (so micro-batches
        balance as ranks do), its tightest such row; without `spread` (the carry-over, placed before
        the long pieces) simply the tightest row, which keeps whole rows free. `toks`, `c`: the pieces' lengths and
        costs when the caller has them (else gathered here).
        """
        toks = self.L[idx] if toks is None else toks
        c = self.c[idx] if c is None else c
        bad = self._none_bad[: idx.size]  # (all False; read-only)
        if check:
            bad = self.maxrem[ranks] < toks
            if self.capped:
                bad |= self.rcost[ranks] + c > self.cap
            if bad.any():
                ok = ~bad
                idx, ranks, toks, c = idx[ok], ranks[ok], toks[ok], c[ok]
        lay, k = self.lay, self.lay.slots
        if k == 1:
            w = flat = ranks
            self.maxrem[ranks] -= toks
        else:
            rr = self.rem.take(ranks, axis=0)  # (np.take of whole rows: several times faster than rem[ranks])
            fit = rr >= toks[:, None]
            if self.spread and lay.micro > 1:
                if lay.rows > 1:  # micro-batch projections
                    mproj = self.mcost.take(ranks, axis=0) + self.mtok.take(ranks, axis=0) * rate
                    score = mproj[:, self.micro_of]
                else:  # (a row per micro-batch: its free tokens are the micro-batch's)
                    score = self.mcost.take(ranks, axis=0) + rr * rate
                score = np.where(fit, score, np.inf)
                fit = score == row_min(score)[:, None]
            w = np.where(fit, rr, _BIG).argmin(axis=1)
            flat = ranks * k + w
        # (the ranks are distinct, hence so are the rows and micro-batches: a fancy-index gather, add and scatter adds
        # once per entry, as ufunc.at would, and costs less)
        self._rem_flat[flat] -= toks
        if k > 1:
            self.maxrem[ranks] = row_max(self.rem.take(ranks, axis=0))
        self.rtok[ranks] -= toks
        self.rcost[ranks] += c
        mi = flat if lay.rows == 1 else ranks * lay.micro + self.micro_of[w]  # (a row per micro-batch: the row)
        self._mcost_flat[mi] += c
        self._mtok_flat[mi] -= toks
        if k == 1:
            w = np.zeros(idx.size, np.int64)
        self.rank[idx] = ranks
        self.slot[idx] = w
        self.pool_cost -= float(c.sum())
        self.pool_tok -= int(toks.sum())
        return bad

    def greedy(self, queue: np.ndarray, lengths: np.ndarray | None = None, costs: np.ndarray | None = None) -> None:
        """Place queue (longest first) in rounds; each round pairs pieces with ranks by projection.

        A round (`fit.pair_round`) gives the next pieces to distinct ranks that can take the head
        piece, at least dp / round_div of them. Tiny pieces go by `_tiny_round`; pieces that fit
        nowhere any more are given up (the caller carries them). `lengths`, `costs`: L[queue] and c[queue] when the
        caller has them; the rounds read the queue's lengths and costs from these, in queue order (slices, not
        gathers of pieces all over L and c), and keep them in step with the queue.
        """
        qlen = self.L[queue] if lengths is None else lengths
        qcost = self.c[queue] if costs is None else costs
        floor = max(1, self.lay.dp // self.round_div)
        tiny = self.lay.seq_len / TINY
        retry: list[np.ndarray] = []
        i, n, own = 0, queue.size, False
        while i < n:
            elig = self._eligible(qlen[i], qcost[i])
            if elig.size == 0:
                queue, qlen, qcost = self._drop_infeasible(queue, qlen, qcost, i)
                i, n, own = 0, queue.size, True
                continue
            if qlen[i] < tiny and self.spread:  # (not for carry-over: it would touch every row)
                if not own:  # _tiny_round reorders the queue in place: ours, not the caller's (what is left of it:
                    # the rounds read the queue from i on only)
                    queue, qlen, qcost, own = queue[i:].copy(), qlen[i:].copy(), qcost[i:].copy(), True
                    i, n = 0, queue.size
                at = self._tiny_round(queue, qlen, qcost, i)
                if at is not None:
                    i = at
                    continue
            rate = self.pool_cost / self.pool_tok if self.pool_tok > 0 else 0.0
            j = i + elig.size
            cand, lengths, costs = queue[i:j], qlen[i:j], qcost[i:j]
            if elig.size <= FEW:  # (the last rounds of a capped step: a few ranks with room left)
                i += _put_few(self, cand, lengths, costs, elig, rate, floor, retry)
                continue
            ranks = pair_round(self.rcost, self.rtok, elig, lengths, costs, rate, floor)
            n_put = ranks.size
            idx = cand[:n_put]
            # ranks were chosen to fit the head; pieces after it are shorter and, when cost grows
            # with length, no costlier, so they fit too
            failed = self.put(idx, ranks, rate, not self.monotone, lengths[:n_put], costs[:n_put])
            if np.count_nonzero(failed):  # (count_nonzero: a C call, where .any() goes through Python)
                retry.append(idx[failed])
            i += ranks.size
        for piece in np.concatenate(retry) if retry else ():  # a cost_fn not growing with length; rare
            self.one(int(piece))

    def place_on(self, idx: np.ndarray, ranks: np.ndarray) -> np.ndarray:
        """Place pieces on given ranks, each rank's longest first; returns the pieces that did not fit."""
        if idx.size == 0:
            return idx
        o = np.lexsort((idx, -self.L[idx], ranks))
        idx, ranks = idx[o], ranks[o]
        starts = run_starts(ranks)
        nth = np.arange(idx.size) - starts.repeat(run_lengths(starts, idx.size))
        failed = []
        for j in range(int(nth.max()) + 1):
            sel = (nth == j).nonzero()[0]
            rate = self.rate()
            bad = self.put(idx[sel], ranks[sel], rate)
            failed.append(idx[sel][bad])
        return np.concatenate(failed)

    def partition_long(self, big: np.ndarray, short: np.ndarray, budget: int) -> np.ndarray | None:
        """Largest differencing of the long pieces `big` over the ranks, onto them; the pieces that did not fit
        their rank, or None when there are none or more than `budget` (pieces x ranks) and the greedy rounds
        should place them. Projects with the rate of the `short` pieces, which will fill the rest of the rows."""
        dp = self.lay.dp
        if not (big.size and big.size * dp <= budget):
            return None
        L, c = self.L, self.c
        fill = float(c[short].sum()) / max(int(L[short].sum()), 1)
        loads = self.rcost + self.rtok * fill
        ranks = kk_partition(c[big] - L[big] * fill, dp, loads)
        return self.place_on(big, ranks)

    def eligible(self, piece: int) -> np.ndarray:
        """The ranks that can take `piece` now: a row it fits and, under the cap, room for its cost."""
        return self._eligible(self.L[piece], self.c[piece])

    def _eligible(self, length: np.int64, cost: np.float64) -> np.ndarray:
        """The ranks that can take a piece of this length and cost now."""
        mask = self.maxrem >= length
        if self.capped:
            mask &= self.rcost <= self.cap - cost
        return mask.nonzero()[0]

    def _tiny_round(self, queue: np.ndarray, qlen: np.ndarray, qcost: np.ndarray, i: int) -> int | None:
        """Place the next tiny pieces (`fit.match_tiny`); returns where the queue left starts (None: none placed).
        The pieces that waited move up in place, before the rest of the queue (no copy of the queue;
        `qlen`, `qcost`: the queue's lengths and costs, reordered alike).

        Tiny pieces barely move a projection, so placing thousands at once costs no balance, and the
        tail (many short pieces, few rows with room) takes a few rounds instead of one per rank. When
        a round places only a trickle, the rest of the queue is given up (carried over): the room
        left is then on ranks at the cap.
        """
        end = i + 4 * self.lay.dp * self.lay.slots
        cand, lengths, costs = queue[i:end], qlen[i:end], qcost[i:end]
        cap = self.cap if self.capped else None
        # (match_tiny needs their costliest only: the first when cost grows with length, as the queue is longest first)
        match = match_tiny(
            self.rem, self.rcost, self.rtok, lengths, costs[:1] if self.monotone else costs, cap, self.rate()
        )
        if match is None:
            return None
        got, rows = match
        wait = ~got
        idx = cand[got]  # (copies: cand, lengths and costs are views of the queue's)
        waiting = cand[wait], lengths[wait], costs[wait]
        self._put_rows(idx, rows, lengths[got], costs[got])
        at = end = i + cand.size
        at -= waiting[0].size
        queue[at:end], qlen[at:end], qcost[at:end] = waiting
        if idx.size * TAIL_GIVE_UP < queue.size - at:  # a trickle: the room left is on ranks at the cap
            self._give_up(qlen[at:], qcost[at:])
            return queue.size
        return at

    def _put_rows(self, idx: np.ndarray, rows: np.ndarray, toks: np.ndarray, cc: np.ndarray) -> None:
        """Put pieces idx (lengths `toks`, costs `cc`) into the given flat rows (rank * slots + slot), several per rank
        and row."""
        lay = self.lay
        k = lay.slots
        ranks, w = np.divmod(rows, k)
        # tokens per row, and from them per rank and micro-batch (integers: exact in any order)
        drow = np.bincount(rows, toks, minlength=self.rem.size).astype(np.int64).reshape(lay.dp, k)
        self.rem -= drow
        dmicro = drow.reshape(lay.dp, lay.micro, lay.rows).sum(axis=2) if lay.rows > 1 else drow
        drank = row_sum(dmicro)
        touched = drank.nonzero()[0]
        self.maxrem[touched] = row_max(self.rem.take(touched, axis=0))
        self.rtok -= drank
        self.rcost += np.bincount(ranks, cc, minlength=lay.dp)
        mi = ranks * lay.micro + self.micro_of[w] if lay.rows > 1 else rows  # (a row per micro-batch: the row)
        self.mcost += np.bincount(mi, cc, minlength=lay.dp * lay.micro).reshape(lay.dp, lay.micro)
        self.mtok -= dmicro
        self.rank[idx] = ranks
        self.slot[idx] = w
        self.pool_cost -= float(cc.sum())
        self.pool_tok -= int(toks.sum())

    def _drop_infeasible(
        self, queue: np.ndarray, qlen: np.ndarray, qcost: np.ndarray, i: int
    ) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """Give up the next queued pieces (from i) that fit no rank now, hence never will; return the rest (the queue,
        its lengths and its costs)."""
        window = max(4 * self.lay.dp, 1024)
        at, feasible, dropped = scan_infeasible(self.maxrem, self.rcost, self.cap, qlen, qcost, i, window)
        for lo, drop in dropped:
            hi = lo + drop.size
            self._give_up(qlen[lo:hi][drop], qcost[lo:hi][drop])
        hi = at + feasible.size
        return tuple(np.concatenate([a[at:hi][feasible], a[hi:]]) for a in (queue, qlen, qcost))  # type: ignore[return-value]

    def _give_up(self, lengths: np.ndarray, costs: np.ndarray) -> None:
        """`give_up` of pieces of these lengths and costs (in the same order: the same sums)."""
        self.pool_cost -= float(costs.sum())
        self.pool_tok -= int(lengths.sum())

    def one(self, piece: int) -> None:
        """Place a single piece on the best eligible rank, or give it up."""
        elig = ((self.maxrem >= self.L[piece]) & (self.rcost + self.c[piece] <= self.cap)).nonzero()[0]
        if elig.size == 0:
            self.give_up(np.array([piece]))
            return
        rate = self.rate()
        proj = self.rcost[elig] + self.rtok[elig] * rate
        grow = self.c[piece] - self.L[piece] * rate >= 0
        r = elig[proj.argmin()] if grow else elig[proj.argmax()]
        self.put(np.array([piece]), np.array([r]), rate)

    # -- moves of placed pieces (refine.py decides them) ----------------------------------------

    def move(self, p: int, q: int) -> None:
        """Move placed piece p to rank q, into its tightest row that fits."""
        self._take(p)
        free = self.rem[q]
        w = int(np.where(free >= self.L[p], free, _BIG).argmin())  # best fit
        self._drop(p, q, w)

    def swap(self, a: int, b: int) -> None:
        """Exchange the rows of placed pieces a and b."""
        ra, wa = self._take(a)
        rb, wb = self._take(b)
        self._drop(a, rb, wb)
        self._drop(b, ra, wa)

    def trade(self, out: np.ndarray, into: np.ndarray, counts: np.ndarray, dtok: np.ndarray, dcost: np.ndarray) -> None:
        """Carry placed pieces `out` over and put in each one's row the next counts[j] pieces of `into`.

        dtok, dcost: the tokens freed and the cost added in each of those rows (one row per piece of out).
        """
        r, w = self.rank[out], self.slot[out]
        m = self.micro_of[w]
        self.rem[r, w] += dtok
        np.add.at(self.rtok, r, dtok)
        np.add.at(self.rcost, r, dcost)
        np.add.at(self.mcost, (r, m), dcost)
        np.add.at(self.mtok, (r, m), dtok)
        touched = np.bincount(r, minlength=self.lay.dp).nonzero()[0]
        self.maxrem[touched] = row_max(self.rem.take(touched, axis=0))
        self.rank[out] = self.slot[out] = -1
        self.rank[into] = r.repeat(counts)
        self.slot[into] = w.repeat(counts)

    def carry(self, idx: np.ndarray) -> None:
        """Take placed pieces idx out of their rows: they are left over (carried to the next step)."""
        L, c, lay = self.L[idx], self.c[idx], self.lay
        r, w = self.rank[idx], self.slot[idx]
        rem = self.rem.reshape(-1)
        rem += np.bincount(r * lay.slots + w, L, minlength=rem.size).astype(np.int64)
        self.rtok += np.bincount(r, L, minlength=lay.dp).astype(np.int64)
        self.rcost -= np.bincount(r, c, minlength=lay.dp)
        mi = r * lay.micro + self.micro_of[w]
        self.mcost -= np.bincount(mi, c, minlength=lay.dp * lay.micro).reshape(lay.dp, lay.micro)
        self.mtok += np.bincount(mi, L, minlength=lay.dp * lay.micro).astype(np.int64).reshape(lay.dp, lay.micro)
        touched = np.bincount(r, minlength=lay.dp).nonzero()[0]
        self.maxrem[touched] = row_max(self.rem.take(touched, axis=0))
        self.rank[idx] = self.slot[idx] = -1

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

    def result(self) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
        """(rank, slot) per piece, cost per rank, cost per (rank, micro-batch)."""
        return self.rank, self.slot, self.rcost, self.mcost


def _put_few(
    st: Rows,
    cand: np.ndarray,
    cand_len: np.ndarray,
    cand_cost: np.ndarray,
    elig: np.ndarray,
    rate: float,
    floor: int,
    retry: list[np.ndarray],
) -> int:
    """`Rows.greedy`'s round over a few eligible ranks (`fit.pair_few`) and `put` of its pieces, one by one in Python
    floats: the same operations in the same order as the vectorised round, so the same placement. `cand_len`,
    `cand_cost`: the candidates' lengths and costs. Pieces that did not fit go to `retry`; returns how many
    pieces the round took."""
    lengths, costs = cand_len.tolist(), cand_cost.tolist()
    ranks = pair_few(st.rcost[elig].tolist(), st.rtok[elig].tolist(), elig.tolist(), lengths, costs, rate, floor)
    check, lay = not st.monotone, st.lay
    score_rows = st.spread and lay.micro > 1
    micro_of = st.micro_of.tolist()
    ok = []
    for j, r in enumerate(ranks):
        tok, cj = lengths[j], costs[j]
        if check and (st.maxrem[r] < tok or (st.capped and st.rcost[r] + cj > st.cap)):
            continue
        ok.append(j)
        rr = st.rem[r].tolist()
        if score_rows:  # the least projected micro-batch with a row the piece fits, its tightest such row
            if lay.rows > 1:
                mproj = [mc + mt * rate for mc, mt in zip(st.mcost[r].tolist(), st.mtok[r].tolist())]
                score = [mproj[micro_of[w]] if x >= tok else np.inf for w, x in enumerate(rr)]
            else:
                score = [mc + x * rate if x >= tok else np.inf for mc, x in zip(st.mcost[r].tolist(), rr)]
            low = min(score)
            fits = [sc == low for sc in score]
        else:
            fits = [x >= tok for x in rr]
        w = min(range(len(rr)), key=lambda v: rr[v] if fits[v] else _BIG)  # (the first of the least)
        rr[w] -= tok
        st.rem[r, w] = rr[w]
        st.maxrem[r] = max(rr)
        st.rtok[r] -= tok
        st.rcost[r] += cj
        m = micro_of[w]
        st.mcost[r, m] += cj
        st.mtok[r, m] -= tok
        st.rank[cand[j]], st.slot[cand[j]] = r, w
    n = len(ranks)
    if len(ok) < n:
        bad = np.ones(n, bool)
        bad[ok] = False
        retry.append(cand[:n][bad])
    st.pool_cost -= float(cand_cost[:n][ok].sum())  # (numpy's sum, as `put` takes it)
    st.pool_tok -= sum(lengths[j] for j in ok)
    return n
