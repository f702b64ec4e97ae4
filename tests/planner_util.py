"""What the planner tests share: a view of document lengths that is a pure function of (seed, source, ordinal),
the sources' medians and a planner config."""

from __future__ import annotations

import hashlib

import numpy as np

from msdata_server.planner import Mixture, PlannerConfig

BLOCK = 1024


class View:
    """Lengths as a pure function of (seed, source, ordinal): lognormal per source, in blocks."""

    def __init__(self, medians, *, seed=0, sigma=1.0, max_len=None, zero_every=0):
        self.medians, self.seed, self.sigma = medians, seed, sigma
        self.max_len, self.zero_every = max_len, zero_every
        self.calls = 0

    def block(self, source, b):
        digest = hashlib.blake2b(repr((self.seed, source, b)).encode(), digest_size=8).digest()
        rng = np.random.default_rng(int.from_bytes(digest, "little"))
        x = np.rint(rng.lognormal(np.log(self.medians[source]), self.sigma, BLOCK)).astype(np.int64)
        x = np.maximum(x, 1)
        if self.max_len:
            x = np.minimum(x, self.max_len)
        if self.zero_every:
            x[(np.arange(BLOCK) + b * BLOCK) % self.zero_every == 0] = 0  # skipped bad samples
        return x

    def lengths(self, source, start, count):
        self.calls += 1
        first, last = start // BLOCK, (start + count - 1) // BLOCK
        flat = np.concatenate([self.block(source, b) for b in range(first, last + 1)])
        return flat[start - first * BLOCK :][:count]

    def all(self, source, stop):
        return self.lengths(source, 0, stop) if stop else np.zeros(0, np.int64)


NAMES = ("chat", "web", "code", "books")
MEDIANS = (300, 900, 2000, 8000)


def config(**kw):
    base = dict(
        sources=NAMES,
        seq_len=4096,
        dp=4,
        micro_batches=2,
        rows=1,
        mixture=Mixture.constant({"chat": 0.3, "web": 0.4, "code": 0.2, "books": 0.1}),
    )
    base.update(kw)
    return PlannerConfig(**base)
