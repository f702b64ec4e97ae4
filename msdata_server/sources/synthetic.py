"""A synthetic source: no files, documents whose length and tokens are pure functions of (seed, name, row).

Lengths are lognormal(median, sigma) clipped to [min_len, max_len] (EOS included); tokens are int32 in
[0, 256) followed by EOS 256. Everything is computed with a vectorised counter-based hash (splitmix64), so
any row is generated directly and a batch costs a few numpy passes: benchmarks and demos need no data.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from ..errors import ConfigError
from .base import ReadResult, Source, shuffle_of
from .order import Order, stable_seed

__all__ = ["EOS", "SyntheticSource"]

EOS = 256
_M64 = (1 << 64) - 1
_GOLDEN = np.uint64(0x9E3779B97F4A7C15)
_C1 = np.uint64(0xBF58476D1CE4E5B9)
_C2 = np.uint64(0x94D049BB133111EB)


def _mix(x: np.ndarray) -> np.ndarray:
    """splitmix64 over a uint64 array (wrapping arithmetic on arrays never warns)."""
    z = x + _GOLDEN
    z = (z ^ (z >> np.uint64(30))) * _C1
    z = (z ^ (z >> np.uint64(27))) * _C2
    return z ^ (z >> np.uint64(31))


def _unit(x: np.ndarray) -> np.ndarray:
    """Uniform floats in (0, 1) from uint64 hashes (53 bits, never exactly 0)."""
    return ((x >> np.uint64(11)).astype(np.float64) + 0.5) * (1.0 / (1 << 53))


class SyntheticSource(Source):
    """``spec.samples`` documents per epoch; row r's content never changes, the order changes per epoch."""

    format = "synthetic"

    def __init__(self, spec: Any, *, seed: int):
        super().__init__(spec, seed=seed)
        samples, median, sigma = spec.samples, spec.median, spec.sigma
        lo, hi = spec.min_len, spec.max_len
        if isinstance(samples, bool) or not isinstance(samples, int) or samples < 1 or samples >= 1 << 32:
            raise ConfigError(f"synthetic source {self.name!r}: samples = {samples!r} must be an integer in [1, 2**32)")
        if not median > 0 or not sigma >= 0:
            raise ConfigError(
                f"synthetic source {self.name!r}: median = {median!r} must be > 0 and sigma = {sigma!r} >= 0"
            )
        if not (isinstance(lo, int) and isinstance(hi, int) and 1 <= lo <= hi):
            raise ConfigError(f"synthetic source {self.name!r}: need 1 <= min_len ({lo!r}) <= max_len ({hi!r})")
        self.median, self.sigma, self.min_len, self.max_len = float(median), float(sigma), lo, hi
        key = stable_seed(self.seed, self.name, "synthetic")
        self._klen = np.array([key & _M64], dtype=np.uint64)
        self._ktok = np.array([(key >> 64) & _M64], dtype=np.uint64)
        shuffle = shuffle_of(spec)  # one "file": mixed and file-local orders agree
        units = [np.array([samples], np.int64)]
        self.order = Order.from_units(
            seed=self.seed, name=self.name, units=units, window=shuffle.window, mode=shuffle.mode, spread=shuffle.spread
        )

    def lengths_of_rows(self, rows) -> np.ndarray:
        """int64 length (tokens incl. EOS) of each row."""
        r = np.asarray(rows, dtype=np.uint64).reshape(-1)
        h = _mix(r ^ self._klen)
        u1, u2 = _unit(_mix(h)), _unit(_mix(h ^ _C1))
        z = np.sqrt(-2.0 * np.log(u1)) * np.cos(2.0 * np.pi * u2)  # Box-Muller: a standard normal
        n = np.rint(self.median * np.exp(self.sigma * z))
        return np.clip(n, self.min_len, self.max_len).astype(np.int64)

    def tokens_of_rows(self, rows) -> list[np.ndarray]:
        """The int32 documents of rows: ids in [0, 256) then EOS (8 ids from each 64-bit hash)."""
        r = np.asarray(rows, dtype=np.int64).reshape(-1)
        body = self.lengths_of_rows(r) - 1
        blocks = (body + 7) // 8
        total = int(blocks.sum())
        first = np.concatenate(([0], np.cumsum(blocks)[:-1])) if len(r) else np.zeros(0, np.int64)
        seeds = _mix(r.astype(np.uint64) ^ self._ktok)
        counter = np.arange(total, dtype=np.uint64) - np.repeat(first, blocks).astype(np.uint64)
        flat = _mix(np.repeat(seeds, blocks) + counter).astype("<u8", copy=False).view(np.uint8)  # little-endian bytes
        out = []
        for f, b in zip(first.tolist(), body.tolist()):
            doc = np.empty(b + 1, dtype=np.int32)
            doc[:b] = flat[8 * f : 8 * f + b]
            doc[b] = EOS
            out.append(doc)
        return out

    def lengths(self, ordinals) -> np.ndarray:
        """Lengths of ordinals without generating the tokens (for benchmarks and planners' tests)."""
        _, _, rows = self.locate_many(ordinals)
        return self.lengths_of_rows(rows)

    def read_batch(self, ordinals) -> ReadResult:
        _, _, rows = self.locate_many(ordinals)
        docs = self.tokens_of_rows(rows)
        nbytes = sum(d.nbytes for d in docs)
        with self._lock:
            self._account(len(docs), nbytes)
        return ReadResult(docs, nbytes)
