"""The standard benchmark workloads (a copy of ../shared/workloads.toml, so benchmarks run without it).

Document lengths in tokens are lognormal(median, sigma) clipped to [min, seq_len], drawn with a
numpy Generator seeded from (seed, workload, source, block): the length of an ordinal is a pure
function of those, so any range of ordinals can be generated in any order.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass

import numpy as np

__all__ = ["COST", "MANYSOURCES", "TEXT4", "LengthDist", "SyntheticLengths", "Workload", "lengths"]


@dataclass(frozen=True, slots=True, kw_only=True)
class LengthDist:
    """lognormal(log(median), sigma) rounded and clipped to [min, seq_len]."""

    median: float
    sigma: float
    min: int


@dataclass(frozen=True, slots=True, kw_only=True)
class Workload:
    name: str
    description: str
    seq_lens: tuple[int, ...]
    weights: dict[str, float]
    sources: dict[str, LengthDist]


TEXT4 = Workload(
    name="text4",
    description="four text sources, the default for balance, memory and end-to-end benchmarks",
    seq_lens=(4096, 8192, 16384),
    weights={"chat": 0.3, "web": 0.4, "code": 0.2, "books": 0.1},
    sources={
        "chat": LengthDist(median=300, sigma=0.8, min=16),
        "web": LengthDist(median=900, sigma=1.0, min=16),
        "code": LengthDist(median=2000, sigma=1.0, min=16),
        "books": LengthDist(median=8000, sigma=1.0, min=64),
    },
)

# per document: alpha * len**2 + beta * len (attention plus the linear layers)
COST = {"alpha": 1.0, "beta": 4096.0}

MANYSOURCES = {
    "description": "the memory benchmark: many Parquet sources shaped like real corpora",
    "sources": (8, 32, 64, 128),  # S; the headline figure is S = 64
    "ranks": 8,
    "workers_per_rank": 4,
    "files_per_source": 16,
    "row_groups_per_file": 8,
    "rows_per_row_group": 128,
    "text_median_bytes": 400,
    "text_sigma": 1.0,
    "seq_len": 4096,
}

BLOCK = 4096  # ordinals per independently seeded block


def _seed(*parts: object) -> int:
    return int.from_bytes(hashlib.blake2b(repr(parts).encode(), digest_size=8).digest(), "little")


def lengths(dist: LengthDist, n: int, seq_len: int, rng: np.random.Generator) -> np.ndarray:
    """n int64 lengths drawn from `dist`, clipped to [dist.min, seq_len]."""
    x = rng.lognormal(np.log(dist.median), dist.sigma, n)
    return np.clip(np.rint(x), dist.min, seq_len).astype(np.int64)


class SyntheticLengths:
    """A MetadataView over a workload: lengths(source, start, count), a pure function of the ordinals."""

    def __init__(self, workload: Workload, seq_len: int, *, seed: int = 0):
        self.workload, self.seq_len, self.seed = workload, seq_len, seed
        self.names = tuple(workload.sources)
        self._blocks: dict[tuple[int, int], np.ndarray] = {}

    def _block(self, source: int, block: int) -> np.ndarray:
        got = self._blocks.get((source, block))
        if got is None:
            name = self.names[source]
            rng = np.random.Generator(np.random.PCG64(_seed(self.seed, self.workload.name, name, block)))
            got = lengths(self.workload.sources[name], BLOCK, self.seq_len, rng)
            if len(self._blocks) > 4096:
                self._blocks.clear()
            self._blocks[(source, block)] = got
        return got

    def lengths(self, source: int, start: int, count: int) -> np.ndarray:
        first, last = start // BLOCK, (start + count - 1) // BLOCK if count else start // BLOCK
        parts = [self._block(source, b) for b in range(first, last + 1)]
        flat = np.concatenate(parts) if len(parts) > 1 else parts[0]
        lo = start - first * BLOCK
        return flat[lo : lo + count].copy()
