"""Placement: which node runs the loader of each source partition — a pure function of the live member set.

Partitions are dealt round robin over the sorted node ids, continuing across sources, so every node holds
the same number of partitions (within one) whatever the sources; weighted by cost, the longest-processing-time
rule. Jobs weight each partition by its source's share of the declared mixture (``partition_costs``), so a
node that leaves is replaced by an even share of the reading work, not of the partition count. Plans never
depend on placement: it only says where a partition's payloads are read.

Shadows (``[job] shadow_loaders = N``): each partition may have up to N hot standbys on nodes other than its
owner (``place_shadows``), dealt like the owners (most costly first, to the node with the least standby load,
then the least owned load, then by id). ``fail_over`` says where each partition goes when nodes are gone: to
its first live standby, else (no standby left) to the plain placement over the live nodes.

Splits and merges (``parts.PartsTable``): the partitions of a source's later generations are placed by the
leader (``place_split``: by reading cost over each node's worker budget, the nodes with spare budget first);
``PartitionLayout`` adds them after the first generation's, and a gone owner's go where ``fail_over`` puts them.
"""

from __future__ import annotations

import heapq
import logging
from collections.abc import Callable, Mapping, Sequence
from typing import TYPE_CHECKING

from ..errors import ConfigError
from .parts import PartsTable

if TYPE_CHECKING:
    from msdata_client.spec import MixSpec

__all__ = ["PartitionLayout", "fail_over", "partition_costs", "place", "place_shadows", "place_sources", "place_split"]

log = logging.getLogger(__name__)

_FLOOR = 0.01  # a source's cost is at least this fraction of the mean (one off at first still spreads out)


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


def place_sources(
    partitions: Sequence[int], nodes: Sequence[str], cost: Sequence[float] | None = None
) -> list[list[str]]:
    """Node of every (source, partition): ``out[s][k]``. Without costs, one round robin across all sources;
    with a per-source cost per partition, each partition (most costly first, ties by source, then source s's
    from its partition s mod its count on) goes to the node with the least load so far (ties by id):
    deterministic, within one partition's cost of even, and partition k of equally costly sources on
    different nodes."""
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
    # each source's partitions dealt from partition s (mod its count) on: with every source's partitions dealt
    # from 0, equal costs put partition k of every source on one node, and sources read in step (their
    # cursors in the same block) would send that node nearly every piece of a step to count
    items = sorted((-float(cost[s]), s, (k - s) % p, k) for s, p in enumerate(partitions) for k in range(p))
    heap = [(0.0, n) for n in ids]  # (load, id): the least loaded node, ties by id, in O(log N) (a min over
    # the nodes per partition took ~0.4 s of the leader's CPU at 512 nodes x 4 sources)
    out = [[""] * p for p in partitions]
    for negc, s, _, k in items:
        load, n = heap[0]
        out[s][k] = n
        heapq.heapreplace(heap, (load + -negc, n))
    return out


def place_split(n: int, cost: float, load: Mapping[str, float], budget: Mapping[str, float]) -> list[str]:
    """Owners of a new generation's ``n`` partitions, each of reading cost ``cost``: one by one to the node whose
    load after taking it, over its worker budget (``budget``: max workers; missing: 1), is least (then the least
    load, then the id). ``load``: the reading cost each live node carries now (measured cost x share)."""
    ids = _nodes(list(load))
    if n < 1 or cost < 0:
        raise ConfigError(f"a split needs n >= 1 partitions of cost >= 0, got {n=} {cost=}")
    held = {x: float(load[x]) for x in ids}
    out = []
    for _ in range(n):
        nid = min(ids, key=lambda x: ((held[x] + cost) / max(float(budget.get(x, 1.0)), 1e-9), held[x], x))
        out.append(nid)
        held[nid] += cost
    return out


def partition_costs(mix: MixSpec, sources: Sequence[str], nparts: int) -> list[float]:
    """The reading cost of one partition of each source: its share of the tokens over the declared mixture
    (a schedule: the mean over its points) split over ``nparts``; the same on every node (a function of the
    job's definition, not of run-time mixture changes)."""
    points = [dict(mix.weights)] if mix.weights is not None else [dict(w) for _, w in mix.schedule]
    share = [0.0] * len(sources)
    for w in points:
        total = sum(float(w.get(name, 0.0)) for name in sources) or 1.0
        for s, name in enumerate(sources):
            share[s] += float(w.get(name, 0.0)) / total / len(points)
    floor = _FLOOR / max(1, len(sources))
    return [max(x, floor) / max(1, nparts) for x in share]


def place_shadows(
    owners: Sequence[Sequence[str]], nodes: Sequence[str], n: int, cost: Sequence[float] | None = None
) -> list[list[tuple[str, ...]]]:
    """Standby nodes of every (source, partition): ``out[s][k]``, up to ``n`` distinct nodes, none of them the
    partition's owner ``owners[s][k]`` (fewer when there are fewer other nodes). Deterministic: partitions in
    order of cost (then (s, k)), each standby to the node with the least standby cost so far, then the least
    owned cost, then the smallest id."""
    ids = _nodes(nodes)
    if n < 0:
        raise ConfigError(f"shadow_loaders={n} must be >= 0")
    c = [1.0] * len(owners) if cost is None else [float(x) for x in cost]
    if len(c) != len(owners):
        raise ConfigError(f"cost={list(c)} must give one value per source ({len(owners)} sources)")
    owned = {x: 0.0 for x in ids}
    for s, row in enumerate(owners):
        for nid in row:
            if nid in owned:
                owned[nid] += c[s]
    load = {x: 0.0 for x in ids}
    out: list[list[tuple[str, ...]]] = [[() for _ in row] for row in owners]
    for negc, s, k in sorted((-c[s], s, k) for s, row in enumerate(owners) for k in range(len(row))):
        pick: list[str] = []
        for _ in range(min(n, len(ids) - (owners[s][k] in owned))):
            nid = min((x for x in ids if x != owners[s][k] and x not in pick), key=lambda x: (load[x], owned[x], x))
            pick.append(nid)
            load[nid] += -negc
        out[s][k] = tuple(pick)
    return out


def fail_over(
    owners: Sequence[Sequence[str]],
    shadows: Sequence[Sequence[Sequence[str]]],
    live: Sequence[str],
    cost: Sequence[float] | None = None,
) -> tuple[list[list[str]], list[tuple[int, int]]]:
    """Owners once only ``live`` nodes remain: a partition whose owner is gone goes to its first live standby
    (a takeover; its (s, k) is listed), else to its node in ``place_sources`` over the live nodes (cold);
    every other partition stays where it is."""
    alive = set(_nodes(live))
    cold = place_sources([len(row) for row in owners], sorted(alive), cost)
    out, taken = [], []
    for s, row in enumerate(owners):
        new = []
        for k, nid in enumerate(row):
            if nid in alive:
                new.append(nid)
                continue
            standby = next((x for x in shadows[s][k] if x in alive), None)
            if standby is not None:
                taken.append((s, k))
            new.append(standby if standby is not None else cold[s][k])
        out.append(new)
    return out, taken


class PartitionLayout:
    """Owner (and, with shadows, standbys) of every partition of one run over the live nodes, as this node sees
    them. Without shadows: ``place_sources`` over the live members. With shadows: sticky while nodes only leave
    (a leaving node's partitions go to their standbys, ``fail_over``), dealt afresh when a node joins or comes
    back, or when the costs change. ``down``: nodes our link to broke (gone until they come back). Partitions of
    later generations (``table``, splits and merges) follow, at their named owners (``_later``)."""

    def __init__(
        self,
        job: str,
        nsources: int,
        nparts: int,
        n_shadows: int,
        costs: list[float],
        live: Callable[[], list[str]],
        me: str,
    ):
        self.job, self.nsources, self.nparts, self.n_shadows = job, nsources, nparts, n_shadows
        self.costs = costs  # per source: the placement cost of one partition (the autoscaler may measure them)
        self.live, self.me = live, me
        self.down: set[str] = set()
        self.table = PartsTable.base(nsources, nparts)
        self._last: tuple[frozenset[str], list[list[str]], list[list[tuple[str, ...]]], tuple] | None = None

    def placement(self) -> list[list[str]]:
        if not self.n_shadows:
            return self._later(place_sources([self.nparts] * self.nsources, self.live(), self.costs), self.live())
        return self.layout()[0]

    def _later(self, rows: list[list[str]], alive: Sequence[str]) -> list[list[str]]:
        """Owners of every partition: the first generation's ``rows``, then the later generations' named owners
        (a gone owner's partition goes where ``fail_over`` puts it)."""
        later = [[o for g in row[1:] for o in g.owners or ()] for row in self.table.gens]
        idx = [s for s, row in enumerate(later) if row]
        if not idx:
            return rows
        moved, _ = fail_over([later[s] for s in idx], [[()] * len(later[s]) for s in idx], alive)
        out = [list(row) for row in rows]
        for s, row in zip(idx, moved):
            out[s] += row
        return out

    def layout(self) -> tuple[list[list[str]], list[list[tuple[str, ...]]]]:
        """(owner, standbys) of every partition."""
        alive = frozenset(n for n in self.live() if n not in self.down)
        costs = tuple(self.costs)
        old = self._last
        if old is not None and old[0] == alive and old[3] == costs:
            return self._later(old[1], sorted(alive)), self._padded(old[2])
        if old is None or not alive < old[0] or old[3] != costs:  # a join, or new costs: dealt afresh
            owners = place_sources([self.nparts] * self.nsources, sorted(alive), self.costs)
        else:
            owners, taken = fail_over(old[1], old[2], sorted(alive), self.costs)
            mine = [(s, k) for s, k in taken if owners[s][k] == self.me]
            if taken:
                log.info(
                    "node %s: job %s: %s gone; %d partition(s) taken over by their standbys (%d here)",
                    self.me,
                    self.job,
                    ",".join(sorted(old[0] - alive)),
                    len(taken),
                    len(mine),
                )
        shadows = place_shadows(owners, sorted(alive), self.n_shadows, self.costs)
        self._last = (alive, owners, shadows, costs)
        return self._later(owners, sorted(alive)), self._padded(shadows)

    def _padded(self, shadows: list[list[tuple[str, ...]]]) -> list[list[tuple[str, ...]]]:
        """Standbys of every partition: later generations have none."""
        return [row + [()] * (self.table.count(s) - len(row)) for s, row in enumerate(shadows)]

    def node_down(self, nid: str) -> bool:
        """Our link to node nid broke: with shadows, its partitions go to their standbys now (not at its lease's
        end). True when the layout changed."""
        if not self.n_shadows or nid == self.me or nid in self.down:
            return False
        before = self.placement()
        self.down.add(nid)
        return self.placement() != before

    def node_up(self, nid: str) -> None:
        """Our link to nid is up again: it counts as live (a join: the layout is dealt afresh)."""
        self.down.discard(nid)
