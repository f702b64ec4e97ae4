"""Which pieces of a step each node receives: the leader's per-node plan slices (issue 29).

A node needs of a step the pieces of the groups it builds (its ranks' data groups) and the pieces of the
partitions it reads or stands by for (to count their payload references, ``shardrefs``); nothing else. The
leader finds, for every piece, its building nodes (from where the ranks registered) and the owner and
standbys of its partition (the leader's ``PartitionLayout`` and the plan's partition table), then hands each
node its indices in plan order. Both maps are cached by what they depend on (the rank placement; the live
members, costs and tables), so a step costs a few vectorised passes over its pieces however many nodes there
are. A piece's partition whose named owner is gone (a later generation) goes to every node: rare, and never
less than a node needs.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Protocol

import numpy as np

from ..parts import BLOCK, PartsTable
from ..planwire import Cut

__all__ = ["Cut", "PlanSlicer", "Placed"]


class Placed(Protocol):
    """What the slicer reads of a run's partition layout (``placement.PartitionLayout``)."""

    n_shadows: int
    costs: list[float]
    down: set[str]
    table: PartsTable

    def placement(self) -> list[list[str]]: ...

    def layout(self) -> tuple[list[list[str]], list[list[tuple[str, ...]]]]: ...


def partitions_of(table: PartsTable, src: np.ndarray, ords: np.ndarray) -> np.ndarray:
    """``table.part`` of every (source, ordinal), vectorised."""
    src = np.asarray(src)
    block = np.asarray(ords, dtype=np.int64) // BLOCK
    n = np.array([row[0].n for row in table.gens], dtype=np.int64)
    out = block % n[src]  # the first generation's ids start at 0
    for s, row in enumerate(table.gens):
        if len(row) < 2:
            continue
        sel = np.flatnonzero(src == s)
        starts = np.array([g.start for g in row], dtype=np.int64)
        gi = np.maximum(np.searchsorted(starts, block[sel], side="right") - 1, 0)
        gf = np.array([g.first for g in row], dtype=np.int64)[gi]
        gn = np.array([g.n for g in row], dtype=np.int64)[gi]
        out[sel] = gf + block[sel] % gn
    return out


class PlanSlicer:
    """Per-node piece indices of the steps of one run (``cuts``); the maps behind them cached."""

    def __init__(self, group_of: Callable[[int], int], readers: Callable[[int], Sequence[int]]) -> None:
        self.group_of = group_of
        self.readers = readers  # the ranks that read a group (all must be placed for it to go to its nodes only)
        self._builders: tuple[object, np.ndarray, dict[int, list[int]]] | None = None
        self._placed: dict[int, str] = {}  # the rank placement ``_builders`` was made for
        self._owners: tuple[object, np.ndarray, np.ndarray] | None = None
        self._everywhere = False  # some partition's owner is gone (its pieces go to every node)

    def _builder_map(self, nodes: Sequence[str], rank_nodes: Mapping[int, str], dp: int) -> tuple[np.ndarray, dict]:
        """([dp, B] node index of each group's builders, -1 padded, -2: every node; node index -> its groups).

        A group some of whose readers are not registered on a live node goes to every node, as if built there:
        such a rank may come back on any node (its server restarted; a new leader has not heard of it yet), and
        the node it comes to builds its group from the plans it already holds (``job.late``). Transient: once
        every reader is placed, only its nodes get it."""
        key = (tuple(nodes), dp)
        if self._builders is not None and self._builders[0] == key and self._placed == rank_nodes:
            return self._builders[1], self._builders[2]  # (a dict compare: a tuple of 4,096 items cost ~3 ms)
        at = {n: i for i, n in enumerate(nodes)}
        per: dict[int, set[int]] = {}
        for r, nid in rank_nodes.items():
            g = self.group_of(int(r))
            if nid in at and 0 <= g < dp:
                per.setdefault(g, set()).add(at[nid])
        placed = {int(r) for r, nid in rank_nodes.items() if nid in at}
        loose = [g for g in range(dp) if not placed.issuperset(self.readers(g))]
        width = max((len(v) for v in per.values()), default=1)
        table = np.full((dp, width), -1, dtype=np.int32)
        groups: dict[int, list[int]] = {}
        for g, ns in per.items():
            for j, i in enumerate(sorted(ns)):
                table[g, j] = i
                groups.setdefault(i, []).append(g)
        table[loose] = -1
        table[loose, 0] = -2
        groups = {i: sorted(set(groups.get(i, [])) | set(loose)) for i in range(len(nodes))}
        self._builders = (key, table, groups)
        self._placed = dict(rank_nodes)
        return table, groups

    def _owner_map(self, nodes: Sequence[str], layout: Placed, table: PartsTable) -> tuple[np.ndarray, np.ndarray]:
        """(first partition id of each source in the flat map, [partitions, 1 + shadows] node indices: the
        owner, then the standbys; -1 none, -2 every node)."""
        key = (tuple(nodes), frozenset(layout.down), tuple(layout.costs), layout.table, table, layout.n_shadows)
        if self._owners is not None and self._owners[0] == key:
            return self._owners[1], self._owners[2]
        at = {n: i for i, n in enumerate(nodes)}
        if layout.n_shadows:
            pl, sh = layout.layout()
        else:
            pl = layout.placement()
            sh = [[() for _ in row] for row in pl]
        counts = [table.count(s) for s in range(len(table.gens))]
        off = np.concatenate([[0], np.cumsum(counts)]).astype(np.int64)
        flat = np.full((int(off[-1]), 1 + int(layout.n_shadows)), -1, dtype=np.int32)
        for s, c in enumerate(counts):
            for pid in range(c):
                row = flat[off[s] + pid]
                if pid < len(pl[s]):
                    row[0] = at.get(pl[s][pid], -2)
                    for j, nid in enumerate(sh[s][pid] if pid < len(sh[s]) else ()):
                        row[1 + j] = at.get(nid, -1)
                else:  # a generation the layout does not hold yet (it comes with this plan): its named owner
                    gen, k, _ = table.slot(s, pid)
                    row[0] = at.get((gen.owners or ("",) * (k + 1))[k], -2)
        self._owners = (key, off[:-1], flat)
        self._everywhere = bool((flat[:, 0] == -2).any())
        return off[:-1], flat

    def cuts(
        self,
        src: np.ndarray,
        ords: np.ndarray,
        group: np.ndarray,
        *,
        dp: int,
        nodes: Sequence[str],
        rank_nodes: Mapping[int, str],
        layout: Placed,
        table: PartsTable,
    ) -> dict[str, Cut]:
        """node -> its ``Cut``, for every node in ``nodes``."""
        nodes = sorted(nodes)
        n_nodes = len(nodes)
        builders, groups = self._builder_map(nodes, rank_nodes, dp)
        off, owners = self._owner_map(nodes, layout, table)
        flat = off[np.asarray(src, dtype=np.int64)] + partitions_of(table, src, ords)
        who = np.concatenate([builders[np.asarray(group, dtype=np.int64)], owners[flat]], axis=1)  # [pieces, R]
        r = who.shape[1]
        flat_who = who.reshape(-1)
        b = builders.shape[1]
        anywhere = np.flatnonzero(who[:, 0] == -2) if (builders[:, 0] == -2).any() else np.zeros(0, np.int64)
        everywhere = (
            np.unique(np.flatnonzero(who[:, b:] == -2) // (r - b)) if self._everywhere else np.zeros(0, np.int64)
        )
        extra_all = np.union1d(anywhere, everywhere) if anywhere.size or everywhere.size else anywhere
        for j in range(1, r):  # a node named twice for a piece (its builder and owner, say) keeps the first
            for k in range(j):
                who[who[:, j] == who[:, k], j] = -1
        shift = (r - 1).bit_length()  # rows padded to a power of two: an entry's piece and slot by shift and mask
        if r < 1 << shift:  # (an int64 division and remainder cost more than the sort)
            flat_who = np.concatenate([who, np.full((len(who), (1 << shift) - r), -1, who.dtype)], axis=1).reshape(-1)
        at = np.flatnonzero(flat_who >= 0)  # the (piece, slot) entries that name one node, in piece order
        node = flat_who[at].astype(np.int16 if n_nodes < 32767 else np.int32)
        order = at[np.argsort(node, kind="stable")]  # radix (O(n)): piece order kept within each node
        piece, built = order >> shift, (order & ((1 << shift) - 1)) < b
        bounds = np.zeros(n_nodes + 1, np.int64)
        np.cumsum(np.bincount(node, minlength=n_nodes), out=bounds[1:])
        out = {}
        for i, nid in enumerate(nodes):
            lo, hi = int(bounds[i]), int(bounds[i + 1])
            idx, mask = piece[lo:hi], built[lo:hi]
            if extra_all.size:  # pieces every node gets (loose groups: as built; a gone owner's: to count)
                extra = np.setdiff1d(extra_all, idx)
                idx = np.concatenate([idx, extra])
                mask = np.concatenate([mask, np.zeros(len(extra), dtype=bool)])
                o = np.argsort(idx, kind="stable")
                idx, mask = idx[o], mask[o]
                mask |= np.isin(idx, anywhere)
            out[nid] = Cut(idx, mask, groups.get(i, []))
        return out
