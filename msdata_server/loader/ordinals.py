"""Which ordinals a loader partition owns, and where they fall among its batches: pure arithmetic.

Partition (k, n) of a source owns the ordinals whose batch index ``ordinal // batch`` is congruent to k
modulo n. A "global" batch index counts all batches of the source, a "local" one only this partition's
(global = local * n + k); a local sample index counts this partition's ordinals in order. Kept apart from
the loader so the rule is written once and can be tested without a source or an event loop.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

__all__ = ["Partition"]


@dataclass(frozen=True, slots=True)
class Partition:
    """Partition ``k`` of ``n`` of a source's ordinals, by whole batches of ``batch`` ordinals."""

    k: int
    n: int
    batch: int

    def local_batch(self, b: int) -> int:
        """The local index of global batch b (of this partition)."""
        return b // self.n

    def global_batch(self, j: int) -> int:
        """The global index of this partition's local batch j."""
        return j * self.n + self.k

    def local_index(self, ordinal: int) -> int:
        """The local sample index of one of this partition's ordinals."""
        return self.local_batch(ordinal // self.batch) * self.batch + ordinal % self.batch

    def owns(self, ordinal: int) -> bool:
        """Whether this partition reads ``ordinal``."""
        return (int(ordinal) // self.batch) % self.n == self.k

    def check(self, ordinals: np.ndarray) -> np.ndarray:
        """Batch indices of ordinals, which must belong to this partition (ValueError saying why not)."""
        if len(ordinals) and int(ordinals.min()) < 0:
            raise ValueError(f"ordinals must be >= 0, got {int(ordinals.min())}")
        b = ordinals // self.batch
        k, n = self.k, self.n
        if n > 1 and not np.all(b % n == k):
            bad = int(ordinals[np.flatnonzero(b % n != k)[0]])
            raise ValueError(
                f"ordinal {bad} belongs to partition {(bad // self.batch) % n} of {n}, not {k}: "
                f"partition k handles ordinals with (ordinal // {self.batch}) % {n} == k"
            )
        return b

    def first_local(self, ordinal: int) -> tuple[int, int]:
        """(local batch, local index) of this partition's first ordinal at or after ``ordinal``."""
        k, n = self.k, self.n
        b = ordinal // self.batch
        j = b // n + (1 if b % n > k else 0)
        return j, j * self.batch + (ordinal % self.batch if self.global_batch(j) == b else 0)
