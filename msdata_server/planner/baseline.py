"""The baseline msdata is measured against: per-rank loaders (what users run today, Megatron-style).

Every DP rank draws documents from the mixture with its own RNG and packs them in arrival order into its
rows (next-fit; long documents split; what does not fit waits for the rank's next step). Pure numpy, used by
bench/balance.py and the demo's summary, so both compare against the same thing.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping

import numpy as np

from .cost import attention_cost
from .pack import LongDocs, next_fit, pieces

__all__ = ["per_rank_steps"]

Draw = Callable[[int, int, np.random.Generator], np.ndarray]  # (source index, n, rng) -> n lengths


def per_rank_steps(draw: Draw, weights: Mapping[str, float], mean_len: Mapping[str, float], *, seq_len: int,
                   dp: int, micro_batches: int, rows: int, steps: int, seed: int, alpha: float = 1.0,
                   beta: float = 4096.0) -> list[dict]:
    """Simulate `steps` steps of per-rank packing; per step: imbalance (max/mean cost), padding, tokens, max_cost.

    Sources are drawn per document with probability weight/mean_len, so token shares follow the mixture.
    """
    names = list(weights)
    w = np.array([weights[n] for n in names], dtype=np.float64)
    p = w / np.array([mean_len[n] for n in names], dtype=np.float64)
    p /= p.sum()
    k = micro_batches * rows
    rngs = [np.random.default_rng([seed, 1, r]) for r in range(dp)]
    pending = [np.zeros(0, np.int64) for _ in range(dp)]
    out = []
    for _ in range(steps):
        cost = np.zeros(dp)
        tokens = 0
        for r in range(dp):
            rng = rngs[r]
            need = k * seq_len
            docs = [pending[r]]
            have = int(pending[r].sum())
            while have < need + seq_len:  # enough to fill every row
                src = rng.choice(len(names), size=64, p=p)
                lens = np.concatenate([draw(s, int((src == s).sum()), rng) for s in range(len(names))])
                lens = lens[rng.permutation(lens.size)]  # arrival order interleaves sources
                docs.append(lens)
                have += int(lens.sum())
            docs = np.concatenate(docs)
            _, _, piece_len = pieces(docs, seq_len, LongDocs.SPLIT)
            row = next_fit(piece_len, k, seq_len)
            placed = row >= 0
            pending[r] = piece_len[~placed]
            cost[r] = attention_cost(piece_len[placed], alpha=alpha, beta=beta).sum()
            tokens += int(piece_len[placed].sum())
        out.append({"imbalance": float(cost.max() / cost.mean()), "padding": 1.0 - tokens / (dp * k * seq_len),
                    "tokens": tokens, "max_cost": float(cost.max())})
    return out
