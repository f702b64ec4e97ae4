"""Placement: which node runs the loader of each source partition — a pure function of the live member set.

Partitions are dealt round robin over the sorted node ids, continuing across sources, so every node holds
the same number of partitions (within one) whatever the sources; weighted by cost, the longest-processing-time
rule. Plans never depend on placement: it only says where a partition's payloads are read.
"""

from __future__ import annotations

from collections.abc import Sequence

from ..errors import ConfigError

__all__ = ["place", "place_sources"]


def _nodes(nodes: Sequence[str]) -> list[str]:
    ids = sorted(set(nodes))
    if not ids:
        raise ConfigError("placement needs at least one live node; the cluster has no members")
    return ids


def place(n_partitions: int, nodes: Sequence[str]) -> list[str]:
    """Node id of each of n_partitions partitions: round robin over the sorted ids."""
    if n_partitions < 0:
        raise ConfigError(f"{n_partitions=} must be >= 0")
    ids = _nodes(nodes)
    return [ids[k % len(ids)] for k in range(n_partitions)]


def place_sources(partitions: Sequence[int], nodes: Sequence[str],
                  cost: Sequence[float] | None = None) -> list[list[str]]:
    """Node of every (source, partition): ``out[s][k]``. Without costs, one round robin across all sources;
    with a per-source cost per partition, each partition (most costly first, ties by (s, k)) goes to the node
    with the least load so far (ties by id): deterministic, and within one partition's cost of even."""
    ids = _nodes(nodes)
    if any(p < 1 for p in partitions):
        raise ConfigError(f"partitions={list(partitions)} must all be >= 1")
    if cost is None:
        out, i = [], 0
        for p in partitions:
            out.append([ids[(i + k) % len(ids)] for k in range(p)])
            i += p
        return out
    if len(cost) != len(partitions) or any(c < 0 for c in cost):
        raise ConfigError(f"cost={list(cost)} must give one value >= 0 per source ({len(partitions)} sources)")
    items = sorted(((-float(cost[s]), s, k) for s, p in enumerate(partitions) for k in range(p)))
    load = {n: 0.0 for n in ids}
    out = [[""] * p for p in partitions]
    for negc, s, k in items:
        n = min(ids, key=lambda x: (load[x], x))
        out[s][k] = n
        load[n] += -negc
    return out
