"""Multiway number partitioning: split values into k bins so that the largest bin sum is small.

Largest differencing (Karmarkar-Karp) and longest-processing-time-first (greedy), both accepting
the bins' existing loads. The planner uses them for the long pieces of a step (see balance.place).
"""

from __future__ import annotations

import heapq
from collections.abc import Callable

import numpy as np

from msdata_server.errors import ConfigError

__all__ = ["PARTITIONERS", "greedy_partition", "kk_partition"]


def _resolve(parent: np.ndarray) -> np.ndarray:
    """Roots of a forest given as parent pointers (pointer jumping, vectorised)."""
    while True:
        nxt = parent[parent]
        if np.array_equal(nxt, parent):
            return parent
        parent = nxt


def kk_partition(values: np.ndarray, k: int, loads: np.ndarray | None = None) -> np.ndarray:
    """Largest differencing (Karmarkar-Karp) k-way partition: the bin of each value.

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


PARTITIONERS: dict[str, Callable[..., np.ndarray]] = {"greedy": greedy_partition, "karmarkar_karp": kk_partition}
