"""Where pieces go: the next pieces paired with ranks, tiny pieces matched to row slots, the pieces that fit no rank.

The choices of the placement rounds, as pure functions of the fill arrays of `rows.Rows` (free
tokens per row, cost and free tokens per rank); `Rows` applies what they return.
"""

from __future__ import annotations

import numpy as np

__all__ = ["least", "match_tiny", "pair_few", "pair_round", "run_lengths", "run_starts", "scan_infeasible"]

ROUND_ROBIN_LOOP = 16  # _round_robin: a loop over up to this many rounds of slots, else one sort
LEAST_SORT = 256  # least: below this many values, or m over 1/16 of them, it sorts them all (np.partition is slow)


def run_starts(a: np.ndarray) -> np.ndarray:
    """Where each run of equal values of a non-empty 1-d array starts (np.flatnonzero(np.r_[True, a[1:] != a[:-1]]),
    without np.r_'s and np.flatnonzero's Python-level overhead: these run in loops)."""
    return np.concatenate(([True], a[1:] != a[:-1])).nonzero()[0]


def run_lengths(starts: np.ndarray, n: int) -> np.ndarray:
    """The length of each run from its start (`run_starts`) in an array of n: np.diff(np.r_[starts, n])."""
    return np.concatenate((starts[1:], [n])) - starts


def least(a: np.ndarray, m: int) -> np.ndarray:
    """np.argsort(a, kind="stable")[:m] of a 1-d float array, without sorting all of it: a partition finds the
    m-th least value, and only the values up to it (the m least and their ties, in index order) are sorted."""
    if a.size <= LEAST_SORT or 16 * m >= a.size:
        return a.argsort(kind="stable")[:m]
    if m <= 0:
        return np.zeros(0, np.int64)
    sel = (a <= np.partition(a, m - 1)[m - 1]).nonzero()[0]
    return sel[a[sel].argsort(kind="stable")[:m]]


def pair_round(
    rcost: np.ndarray,
    rtok: np.ndarray,
    elig: np.ndarray,
    lengths: np.ndarray,
    costs: np.ndarray,
    rate: float,
    floor: int,
) -> np.ndarray:
    """Ranks for the next pieces of a greedy round (lengths/costs of the pieces from the queue's head on).

    The projection of rank r is `rcost[r] + rtok[r] * rate`. A round takes the next pieces that all
    raise (or all lower) a projection and gives them to as many distinct ranks of `elig` (those that
    can take the head piece): the lowest (highest) projected ones, at least `floor` of them and more
    while their projections are within the head piece's effect of the extreme, where sequential LPT
    would choose among them anyway. Since the queue is longest first and `rate` is the average of
    what is left, nearly every round raises. Returns the rank of each of the first len(result) pieces.
    """
    delta = costs - lengths * rate
    grow = bool(delta[0] >= 0)
    same = delta >= 0 if grow else delta < 0
    run = lengths.size if same[-1] and np.count_nonzero(same) == same.size else int(same.argmin())
    every = elig.size == rcost.size  # (elig is ascending: then every rank, in order)
    proj = rcost + rtok * rate if every else rcost[elig] + rtok[elig] * rate
    if grow:
        near = int(np.count_nonzero(proj <= proj.min() + delta[0]))
    else:
        near = int(np.count_nonzero(proj >= proj.max() + delta[:run].min()))
    take = min(run, max(near, floor))
    by_proj = proj.argsort(kind="stable")
    if not every:
        by_proj = elig[by_proj]
    if grow:  # the largest raise to the lowest projection
        return by_proj[:take]
    ranks = np.empty(take, np.int64)  # the largest lowering to the highest projection
    ranks[delta[:take].argsort(kind="stable")] = by_proj[::-1][:take]
    return ranks


def pair_few(
    rcost: list[float],
    rtok: list[int],
    elig: list[int],
    lengths: list[int],
    costs: list[float],
    rate: float,
    floor: int,
) -> list[int]:
    """`pair_round` of a few eligible ranks and pieces, in Python floats (the same IEEE operations in the same order,
    so the same ranks): where only a few ranks can take the head piece, a round's numpy calls cost more than its
    work. `rcost`/`rtok`: the eligible ranks' (elig, ascending); returns the ranks of the first pieces."""
    delta = [c - n * rate for c, n in zip(costs, lengths)]
    grow = delta[0] >= 0
    same = [d >= 0 for d in delta] if grow else [d < 0 for d in delta]
    run = len(delta) if all(same) else same.index(False)
    proj = [c + t * rate for c, t in zip(rcost, rtok)]
    if grow:
        bar = min(proj) + delta[0]
        near = sum(1 for p in proj if p <= bar)
    else:
        bar = max(proj) + min(delta[:run])
        near = sum(1 for p in proj if p >= bar)
    take = min(run, max(near, floor))
    by_proj = [elig[j] for j in sorted(range(len(proj)), key=proj.__getitem__)]  # (sorted is stable)
    if grow:
        return by_proj[:take]
    ranks = [0] * take
    for j, r in zip(sorted(range(take), key=delta.__getitem__), by_proj[::-1]):
        ranks[j] = r
    return ranks


def match_tiny(
    rem: np.ndarray,
    rcost: np.ndarray,
    rtok: np.ndarray,
    lengths: np.ndarray,
    costs: np.ndarray,
    cap: float | None,
    rate: float,
) -> tuple[np.ndarray, np.ndarray] | None:
    """Match tiny pieces (longest first) to rows, many per rank and row; (placed mask, flat row of each placed).

    `rem` [dp, slots] free tokens, `rcost`/`rtok` per rank, `cap` the rank cost cap (None: uncapped), `costs`
    the pieces' costs (only their maximum counts), `rate` the cost per token of what is left. Each row's free
    tokens are cut into slots the size of the longest piece here, plus one slot for the remainder. Slots are
    dealt round-robin over rows (the first slot of every row, then the second, ...; lower projected ranks
    first), remainders last, roomiest first, and the pieces matched to them greedily: a piece takes the
    roomiest unused slot if it fits, else waits for the next round. A rank near the cap offers no more slots
    than the costliest of these pieces fits under it. None: no piece fits.
    """
    k = rem.shape[1]
    size = int(lengths[0])
    full = rem // size
    part = rem - full * size >= lengths[-1]  # (the remainder, without a second division)
    if cap is not None and float(costs.max()) > 0:  # (free pieces, as priced padding makes them when alpha = 0)
        allow = np.floor(np.minimum((cap - rcost) / float(costs.max()), 2.0**40)).astype(np.int64)
        room = allow[:, None] - _before(full + part)  # slots left in the rank
        full = np.clip(np.minimum(full, room), 0, None)
        part &= full < room
    rows = (full + part).ravel().nonzero()[0]
    if rows.size == 0:
        return None
    full, part = full.reshape(-1)[rows], part.reshape(-1)[rows]
    full = np.minimum(full, -(-lengths.size // rows.size) + 1)  # enough for this round
    rows, full, part = _by_projection(rows, full, part, rcost + rtok * rate, k)
    # the full slots (all `size` long: every piece fits) come first, round-robin over the rows; then the
    # remainders, roomiest first (then by nth slot of the row, i.e. its full slots, and the row order above)
    n_full = int(full.sum())
    if n_full >= lengths.size:  # every piece fits a full slot: all matched, in order (the greedy below agrees)
        return np.ones(lengths.size, bool), rows[_round_robin(full, lengths.size)]
    tail = part.nonzero()[0]
    tail_size = rem.reshape(-1)[rows[tail]] % size
    o = np.lexsort((tail, full[tail], -tail_size))  # (rows here are few: one remainder each)
    tail, tail_size = tail[o], tail_size[o]
    # slots with room for each piece: the full ones and the remainders at least as long (a table by length: the
    # lengths are at most `size`, and a searchsorted of every piece was several times slower)
    at_least = (np.bincount(tail_size, minlength=size + 1)[::-1]).cumsum()[::-1]
    fits = n_full + at_least[lengths]
    n = np.arange(lengths.size)
    matched = np.minimum(n + 1, np.minimum.accumulate(fits - n) + n)  # greedy matches so far
    got = np.empty(matched.size, bool)  # (np.diff(matched, prepend=0) > 0)
    got[0] = matched[0] > 0
    np.greater(matched[1:], matched[:-1], out=got[1:])
    m = int(matched[-1])  # the pieces matched take the first m slots, in order
    if m == 0:
        return None
    head = _round_robin(full, min(m, n_full))
    return got, rows[np.concatenate([head, tail[: m - head.size]])]


def _before(a: np.ndarray) -> np.ndarray:
    """Per row of a 2-d int array, the sum of the entries before each (an exclusive cumsum along axis 1), by
    columns: numpy's cumsum along a short last axis is several times slower."""
    out = np.zeros_like(a)
    for j in range(1, a.shape[1]):
        np.add(out[:, j - 1], a[:, j - 1], out=out[:, j])
    return out


def _by_projection(
    rows: np.ndarray, full: np.ndarray, part: np.ndarray, proj: np.ndarray, k: int
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """The rows (flat: rank * k + slot) with their full-slot counts and remainder flags, lower projected rank
    first (ties by rank), then by slot: one scatter over the dp * k rows, no sort of them."""
    dp = proj.size
    place = np.empty(dp, np.int64)
    place[proj.argsort(kind="stable")] = np.arange(dp)
    at = np.full(dp * k, -1, np.int64)
    at[place[rows // k] * k + rows % k] = np.arange(rows.size)
    o = at[at >= 0]
    return rows[o], full[o], part[o]


def _round_robin(full: np.ndarray, m: int) -> np.ndarray:
    """The first m of the slots dealt round-robin over rows holding full[i] slots each: row i once per round,
    while it has slots left; as indices of the rows. (The rounds are few: a loop when so, else one stable sort.)"""
    rounds = int(full.max(initial=0))
    if rounds <= ROUND_ROBIN_LOOP:
        out, have, j = [], 0, 0
        while have < m:
            sel = (full > j).nonzero()[0]
            out.append(sel)
            have += sel.size
            j += 1
        return np.concatenate(out)[:m] if out else np.zeros(0, np.int64)
    row = np.arange(full.size).repeat(full)
    nth = np.arange(row.size) - (full.cumsum() - full).repeat(full)
    return row[(nth.astype(np.uint16) if rounds <= 1 << 16 else nth).argsort(kind="stable")][:m]


def scan_infeasible(
    maxrem: np.ndarray, rcost: np.ndarray, cap: float, lengths: np.ndarray, costs: np.ndarray, i: int, window: int
) -> tuple[int, np.ndarray, list[tuple[int, np.ndarray]]]:
    """Split the queue from i into the pieces left (the head fits a rank, or none left) and those that fit none.

    `maxrem` is each rank's roomiest row, `rcost` its cost, `lengths`/`costs` those of the queue's pieces, in queue
    order. Checks `window` pieces at a time (later pieces are shorter, so likelier to fit, and get checked when they
    come up). Returns (at, feasible, dropped): the last window checked starts at `at`, `feasible` masks the pieces in
    it that fit a rank (the queue past it is left unchecked; none: at = len(queue) and feasible is empty); `dropped`:
    per window checked, (its start, mask of its pieces that fit no rank now, hence never will).
    """
    o = (-maxrem).argsort(kind="stable")
    room = maxrem[o]
    budget = np.maximum.accumulate(cap - rcost[o])
    dropped: list[tuple[int, np.ndarray]] = []
    while i < lengths.size:
        part = slice(i, i + window)
        cnt = (-room).searchsorted(-lengths[part], side="right")  # ranks with a row this long
        feasible = (cnt > 0) & (budget[np.maximum(cnt - 1, 0)] >= costs[part])
        dropped.append((i, ~feasible))
        if feasible.any():
            return i, feasible, dropped
        i += feasible.size
    return lengths.size, np.zeros(0, bool), dropped
