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
from .vlm_cost import VlmCost

__all__ = ["per_rank_steps"]

# (source index, n, rng) -> n lengths; with `vlm`, int64 [3, n]: lengths, image patches, patches squared
Draw = Callable[[int, int, np.random.Generator], np.ndarray]


def per_rank_steps(
    draw: Draw,
    weights: Mapping[str, float],
    mean_len: Mapping[str, float],
    *,
    seq_len: int,
    dp: int,
    micro_batches: int,
    rows: int,
    steps: int,
    seed: int,
    alpha: float = 1.0,
    beta: float = 4096.0,
    vlm: VlmCost | None = None,
) -> list[dict]:
    """Simulate `steps` steps of per-rank packing; per step: imbalance (max/mean cost), padding, tokens, max_cost
    and max_cost_padded (padding charged beta per token).

    Sources are drawn per document with probability weight/mean_len, so token shares follow the mixture.
    With `vlm` (two stages: its alpha and beta are the backbone's, and `alpha`/`beta` are not used), a
    document's encoder cost goes with its first piece, cost is both stages' per rank, and each step also
    has backbone_imbalance, encoder_imbalance, max_backbone and max_encoder (a step takes the sum of the two).
    """
    names = list(weights)
    w = np.array([weights[n] for n in names], dtype=np.float64)
    p = w / np.array([mean_len[n] for n in names], dtype=np.float64)
    p /= p.sum()
    k = micro_batches * rows
    rngs = [np.random.default_rng([seed, 1, r]) for r in range(dp)]
    pending = [np.zeros((2, 0) if vlm else 0, np.float64 if vlm else np.int64) for _ in range(dp)]
    out = []
    for _ in range(steps):
        cost = np.zeros(dp)
        enc = np.zeros(dp)
        free = np.zeros(dp)  # padding tokens per rank
        tokens = 0
        for r in range(dp):
            rng = rngs[r]
            need = k * seq_len
            docs = []
            have = int(pending[r][0].sum() if vlm else pending[r].sum())
            while have < need + seq_len:  # enough to fill every row
                src = rng.choice(len(names), size=64, p=p)
                lens = np.concatenate([draw(s, int((src == s).sum()), rng) for s in range(len(names))], axis=-1)
                lens = lens[..., rng.permutation(lens.shape[-1])]  # arrival order interleaves sources
                docs.append(lens)
                have += int(lens[0].sum() if vlm else lens.sum())
            if vlm is None:
                _, _, piece_len = pieces(np.concatenate([pending[r], *docs]), seq_len, LongDocs.SPLIT)
                piece_enc = np.zeros(piece_len.size)
            else:
                new = np.concatenate(docs, axis=-1) if docs else np.zeros((3, 0), np.int64)
                doc, off, plen = pieces(new[0], seq_len, LongDocs.SPLIT)
                first = np.where(off == 0, vlm.from_moments(new[1], new[2])[doc], 0.0)
                piece_len = np.concatenate([pending[r][0].astype(np.int64), plen])
                piece_enc = np.concatenate([pending[r][1], first])
            row = next_fit(piece_len, k, seq_len)
            placed = row >= 0
            if vlm is None:
                pending[r] = piece_len[~placed]
                cost[r] = attention_cost(piece_len[placed], alpha=alpha, beta=beta).sum()
            else:
                pending[r] = np.stack([piece_len[~placed], piece_enc[~placed]]).astype(np.float64)
                cost[r] = attention_cost(piece_len[placed], alpha=vlm.alpha, beta=vlm.beta).sum()
                enc[r] = piece_enc[placed].sum()
            tokens += int(piece_len[placed].sum())
            free[r] = k * seq_len - int(piece_len[placed].sum())
        step = {
            "imbalance": float((cost + enc).max() / (cost + enc).mean()),
            "padding": 1.0 - tokens / (dp * k * seq_len),
            "tokens": tokens,
            "max_cost": float((cost + enc).max()),
            # with every padding token charged beta, as a fixed-shape trainer pays it ([balance] pad_cost's default)
            "max_cost_padded": float((cost + enc + (vlm.beta if vlm else beta) * free).max()),
        }
        if vlm is not None:
            step.update(
                backbone_imbalance=float(cost.max() / cost.mean()),
                encoder_imbalance=float(enc.max() / enc.mean()) if enc.mean() > 0 else 1.0,
                max_backbone=float(cost.max()),
                max_encoder=float(enc.max()),
            )
        out.append(step)
    return out
