"""A run's partition table: each source's partitions as generations, split and merged live (cluster source
auto-partitioning, ARCHITECTURE §3).

Source s starts with one generation of ``nparts`` partitions from block 0. A split or merge appends a
generation (first block B, n partitions, their owners): blocks >= B are dealt over its n partitions (block b
to its partition b % n, as ``SourceLoader`` partitions deal them), blocks below B stay with the generations
that read them. Partitions are numbered per source across generations; a generation's first id is the count
before it, so ids never change.

Why this is safe at any moment: the leader appends a generation when it plans a step S, with B at or past the
planner's cursor at the start of S (``RunParts.at``), so no plan before S names an ordinal at or past B, and
the table travels whole in every plan frame from S on; a node applies it (``JobShard.repartition``) when that
plan takes its turn, before it counts the plan's references. Every node therefore counts each ordinal at the
same owner, whatever step it switched at: nothing already counted moves, and plans never depend on the table
(it only says where payloads are read). Later generations are only ever appended.

The first generation is placed by the live-member rule (``placement.PartitionLayout``); later ones name their
owners (the leader places them by measured cost on the nodes with spare budget, ``placement.place_split``).
Pure apart from logging.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

__all__ = ["Gen", "MAX_GENERATIONS", "PartsTable", "RunParts", "longest"]

log = logging.getLogger(__name__)

BLOCK = 64  # SourceLoader's default batch: the unit partitions are dealt in

MAX_GENERATIONS = 64  # per source and run: beyond it a run keeps its partitions (see the README: pruning)


@dataclass(frozen=True, slots=True)
class Gen:
    """One generation of a source's partitions: from block ``start`` on, ``n`` partitions with ids
    ``first .. first + n - 1``; ``owners`` names their nodes (None: the first generation, placed by the
    live-member rule)."""

    start: int
    n: int
    first: int
    owners: tuple[str, ...] | None = None


class PartsTable:
    """Every source's generations (oldest first). Immutable: ``split`` returns a new table."""

    __slots__ = ("gens",)

    def __init__(self, gens: Sequence[Sequence[Gen]]):
        self.gens: tuple[tuple[Gen, ...], ...] = tuple(tuple(g) for g in gens)

    @classmethod
    def base(cls, nsources: int, nparts: int) -> PartsTable:
        return cls([[Gen(0, nparts, 0)] for _ in range(nsources)])

    def __eq__(self, other: object) -> bool:
        return isinstance(other, PartsTable) and other.gens == self.gens

    def __hash__(self) -> int:
        return hash(self.gens)

    def _gen_of_block(self, s: int, b: int) -> Gen:
        for g in reversed(self.gens[s]):
            if g.start <= b:
                return g
        return self.gens[s][0]

    @property
    def ended(self) -> bool:
        """Whether some source has a generation that ended (a split or merge happened)."""
        return any(len(row) > 1 for row in self.gens)

    def part(self, s: int, ordinal: int) -> int:
        """The id of the partition that reads ``ordinal`` of source s."""
        b = int(ordinal) // BLOCK
        g = self._gen_of_block(s, b)
        return g.first + b % g.n

    def slot(self, s: int, pid: int) -> tuple[Gen, int, int | None]:
        """(generation, its local partition k, the block it ends at: None for the newest) of partition pid."""
        row = self.gens[s]
        for i, g in enumerate(row):
            if g.first <= pid < g.first + g.n:
                return g, pid - g.first, row[i + 1].start if i + 1 < len(row) else None
        raise KeyError(f"source {s} has no partition {pid} (it has {self.count(s)})")

    def count(self, s: int) -> int:
        """Partition ids of source s, over all its generations."""
        g = self.gens[s][-1]
        return g.first + g.n

    def partitions(self, s: int) -> int:
        """How many partitions source s reads with now (its newest generation)."""
        return self.gens[s][-1].n

    def newest(self, s: int) -> range:
        g = self.gens[s][-1]
        return range(g.first, g.first + g.n)

    def split(self, s: int, start: int, n: int, owners: Sequence[str]) -> PartsTable:
        """This table with source s read in ``n`` partitions (on ``owners``) from block ``start`` on."""
        last = self.gens[s][-1]
        if start <= last.start:
            raise ValueError(f"a new generation of source {s} must start past block {last.start}, not at {start}")
        if n < 1 or len(owners) != n:
            raise ValueError(f"a generation needs n >= 1 partitions and one owner each, got {n=} {list(owners)}")
        gens = [list(row) for row in self.gens]
        gens[s].append(Gen(int(start), int(n), last.first + last.n, tuple(str(o) for o in owners)))
        return PartsTable(gens)

    def wire(self) -> list:
        """The table as plan frames carry it: per source, the later generations as [start, n, owners]."""
        return [[[g.start, g.n, list(g.owners or ())] for g in row[1:]] for row in self.gens]

    def applied(self, wire: object) -> PartsTable:
        """This table with the later generations of a plan frame's ``parts`` (ValueError if malformed). A
        frame from before a change (fewer generations) leaves it as it is: generations are only appended."""
        if not isinstance(wire, list) or len(wire) != len(self.gens):
            raise ValueError(f"parts must list the generations of each of the {len(self.gens)} sources")
        table = self
        for s, row in enumerate(wire):
            have = len(self.gens[s]) - 1
            if not isinstance(row, list) or len(row) > MAX_GENERATIONS:
                raise ValueError(f"parts of source {s} must be a list of at most {MAX_GENERATIONS} generations")
            for i, item in enumerate(row):
                start, n, owners = item
                if i < have:
                    g = self.gens[s][i + 1]
                    if [g.start, g.n, list(g.owners or ())] != [start, n, list(owners)]:
                        raise ValueError(f"parts of source {s}: generation {i + 1} differs from the one applied")
                    continue
                if not (isinstance(start, int) and isinstance(n, int)) or not all(isinstance(o, str) for o in owners):
                    raise ValueError(f"parts of source {s}: {item!r} is not [start block, n, [owner per partition]]")
                table = table.split(s, start, n, owners)
        return table


def longest(wires: Iterable[object]) -> list | None:
    """Of the tables nodes report (``wire`` forms, None: none), the one with the most generations: what a new
    leader resumes a run with (its predecessor may have sent a change to some nodes only, and all tables are
    prefixes of one history). None when no node reports one."""
    best: list | None = None
    for w in wires:
        if (
            isinstance(w, list)
            and all(isinstance(r, list) for r in w)
            and (best is None or sum(map(len, w)) > sum(map(len, best)))
        ):
            best = w
    return best


class RunParts:
    """The leader's table of one run: a split or merge the autoscaler asks for (``want``) waits for the next
    step planned (``at``), which gets it and every later plan carries it."""

    def __init__(self, job: str, sources: Sequence[str], table: PartsTable):
        self.job, self.sources, self.table = job, tuple(sources), table
        self.pending: dict[int, tuple[int, tuple[str, ...]]] = {}  # source -> (n, owners)

    def want(self, s: int, n: int, owners: Sequence[str], why: str) -> None:
        if len(self.table.gens[s]) >= MAX_GENERATIONS + 1:
            log.warning(
                "job %s: source %s keeps %d partitions: %d changes this run already (the most a run makes)",
                self.job,
                self.sources[s],
                self.table.partitions(s),
                MAX_GENERATIONS,
            )
            return
        self.pending[s] = (int(n), tuple(owners))
        log.info(
            "job %s: source %s partitions %d -> %d: %s; read on %s from the next step planned",
            self.job,
            self.sources[s],
            self.table.partitions(s),
            n,
            why,
            ", ".join(owners),
        )

    def at(self, step: int, cursor: Sequence[int] | None) -> list:
        """The table the plan of ``step`` carries: pending changes start at the first whole block at or past the
        planner's cursor (``cursor[s]``: its state at the start of the step). Each change was logged once, when
        asked for (``want``); every node logs the step it applies it at."""
        for s, (n, owners) in sorted(self.pending.items()):
            last = self.table.gens[s][-1]
            if n == last.n:
                continue  # split and merged back before a step was planned: nothing changes
            at = -(-int(cursor[s]) // BLOCK) if cursor is not None else 0
            start = max(at, last.start + 1)
            self.table = self.table.split(s, start, n, owners)
            log.debug(
                "job %s: source %s in %d partitions from step %d (block %d)", self.job, self.sources[s], n, step, start
            )
        self.pending.clear()
        return self.table.wire()
