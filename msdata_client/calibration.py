"""Cost calibration: time *your* forward+backward on packed micro-batches and fit the planner's cost model.

The planner balances DP ranks by a per-document cost ``alpha * L**2 + beta * L``. ``calibrate`` builds
synthetic micro-batches of ``seq_len`` tokens, each packed with documents of one chosen length, runs the
user's ``step_fn`` on them (on the user's device), and fits alpha and beta by least squares on the
per-micro-batch sums (sum of L**2, sum of L). Every micro-batch is full, so beta also carries the fixed
cost of a micro-batch spread over its tokens: what a rank pays per token whatever the documents.
``Calibration.toml()`` is the ``[balance]`` table to paste into the job.

torch is imported only when a batch is built, so the fit itself is plain numpy.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from .choices import ATTENTION_COST
from .errors import ConfigError

__all__ = ["Calibration", "Sample", "calibrate", "fit", "packed_batch"]

StepFn = Callable[[Mapping[str, Any]], object]


@dataclass(frozen=True, slots=True, kw_only=True)
class Sample:
    """One timed micro-batch: the lengths of its documents and the seconds ``step_fn`` took."""

    lengths: tuple[int, ...]
    seconds: float


@dataclass(frozen=True, slots=True, kw_only=True)
class Calibration:
    """Fitted cost of a document of L tokens, ``alpha * L**2 + beta * L`` seconds, and how well it fits."""

    alpha: float  # seconds per squared token (attention)
    beta: float  # seconds per token (linear layers, plus the micro-batch's fixed cost per token)
    r2: float  # of the fitted seconds against the fastest run of each micro-batch
    seq_len: int
    samples: tuple[Sample, ...]

    def predict(self, lengths: Sequence[int] | np.ndarray) -> float:
        """Predicted seconds of one micro-batch holding documents of these lengths."""
        x = np.asarray(lengths, dtype=np.float64)
        return float(self.alpha * (x * x).sum() + self.beta * x.sum())

    def toml(self) -> str:
        """The job's ``[balance]`` cost, with the fit quality as a comment (paste it into job.toml)."""
        ratio = f"{self.beta / self.alpha:.4g}" if self.alpha > 0 else "inf"
        return (
            f"# msdata cost calibration: seq_len {self.seq_len}, {len(self.samples)} timed micro-batches, "
            f"R^2 {self.r2:.4f}\n"
            f"# a document of L tokens costs alpha*L**2 + beta*L seconds (beta/alpha = {ratio})\n"
            "[balance]\n"
            f'cost = "{ATTENTION_COST}"\n'
            f"alpha = {float(f'{self.alpha:.6g}')!r}\n"
            f"beta = {float(f'{self.beta:.6g}')!r}\n"
        )


def _design(samples: Sequence[Sample]) -> tuple[np.ndarray, np.ndarray]:
    x = np.array([[sum(n * n for n in s.lengths), sum(s.lengths)] for s in samples], dtype=np.float64)
    return x, np.array([s.seconds for s in samples], dtype=np.float64)


def fit(samples: Sequence[Sample], *, seq_len: int) -> Calibration:
    """Least squares of seconds on (sum L**2, sum L) over the fastest run of each distinct micro-batch (noise,
    a busy machine or a stray collection, only ever adds time); alpha and beta are kept >= 0 (the planner
    refuses negative costs). R^2 is that of the fit over those fastest runs."""
    groups: dict[tuple[int, ...], float] = {}
    for s in samples:
        groups[s.lengths] = min(s.seconds, groups.get(s.lengths, math.inf))
    if len({sum(n * n for n in k) for k in groups}) < 2:
        raise ConfigError(
            f"calibration needs micro-batches of at least two different document lengths, got {sorted(groups)}"
        )
    x, y = _design([Sample(lengths=k, seconds=v) for k, v in groups.items()])
    # scale the columns so that lstsq is well conditioned (sum L**2 is ~seq_len times sum L)
    scale = np.abs(x).max(axis=0)
    scale[scale == 0] = 1.0
    coef = np.linalg.lstsq(x / scale, y, rcond=None)[0] / scale
    if coef[0] < 0 or coef[1] < 0:  # the better of the two one-term fits
        alone = [np.zeros(2), np.zeros(2)]
        for j in (0, 1):
            col = x[:, j]
            alone[j][j] = max(0.0, float(col @ y) / float(col @ col)) if col @ col > 0 else 0.0
        coef = min(alone, key=lambda c: float(((x @ c - y) ** 2).sum()))
    total = float(((y - y.mean()) ** 2).sum())
    r2 = 1.0 - float(((y - x @ coef) ** 2).sum()) / total if total > 0 else 1.0
    return Calibration(alpha=float(coef[0]), beta=float(coef[1]), r2=r2, seq_len=seq_len, samples=tuple(samples))


def packed_batch(
    lengths: Sequence[int],
    seq_len: int,
    *,
    vocab: int = 256,
    pad_id: int = 257,
    generator: Any = None,
    device: Any = None,
) -> dict[str, Any]:
    """One packed row shaped like a DataClient batch: ``tokens``, ``labels``, ``loss_mask``, ``position_ids``
    (``[1, seq_len]``) and ``cu_seqlens`` (int32; the padding tail, if any, is its own segment)."""
    import torch

    lens = [int(n) for n in lengths]
    used = sum(lens)
    if any(n <= 0 for n in lens) or used > seq_len:
        raise ConfigError(f"document lengths {lens} must be > 0 and sum to at most {seq_len=}")
    tokens = torch.full((1, seq_len), pad_id, dtype=torch.int64)
    tokens[0, :used] = torch.randint(0, vocab, (used,), generator=generator)
    bounds = [0, *np.cumsum(lens).tolist()] + ([seq_len] if used < seq_len else [])
    position_ids = torch.zeros((1, seq_len), dtype=torch.int64)
    loss_mask = torch.zeros((1, seq_len), dtype=torch.float32)
    for a, n in zip(bounds, lens):
        position_ids[0, a : a + n] = torch.arange(n)
        loss_mask[0, a : a + n - 1] = 1.0  # the next token is of the same document
    labels = torch.full((1, seq_len), pad_id, dtype=torch.int64)
    labels[0, :-1] = tokens[0, 1:]
    batch = {
        "tokens": tokens,
        "labels": labels,
        "loss_mask": loss_mask,
        "position_ids": position_ids,
        "cu_seqlens": torch.tensor(bounds, dtype=torch.int32),
    }
    return {k: v.to(device) for k, v in batch.items()} if device is not None else batch


def _docs(length: int, seq_len: int) -> tuple[int, ...]:
    """Documents of `length` filling a row exactly (the last one shorter when it does not divide seq_len)."""
    n, rest = divmod(seq_len, length)
    return (length,) * n + ((rest,) if rest else ())


def _sync_for(device: Any) -> Callable[[], None]:
    """What waits for the device's queued work (CUDA and MPS run asynchronously; the CPU does not)."""
    if device is None:
        return lambda: None
    import torch

    dev = torch.device(device)
    if dev.type == "cuda":
        return lambda: torch.cuda.synchronize(dev)
    if dev.type == "mps":
        return torch.mps.synchronize
    return lambda: None


def calibrate(
    step_fn: StepFn,
    *,
    lengths: Sequence[int] | None = None,
    seq_len: int = 8192,
    repeats: int = 3,
    device: Any = None,
    warmup: int = 1,
    vocab: int = 256,
    seed: int = 0,
    clock: Callable[[], float] = time.perf_counter,
) -> Calibration:
    """Time ``step_fn(batch)`` (the model's forward and backward on one micro-batch) on full rows of documents of
    each of ``lengths`` (default: seq_len/64 ... seq_len), ``repeats`` times each after ``warmup`` untimed calls,
    and fit the cost. ``clock`` is any monotonic seconds counter (tests inject a fake one)."""
    if isinstance(seq_len, bool) or not isinstance(seq_len, int) or seq_len < 2:
        raise ConfigError(f"{seq_len=} must be an int >= 2")
    if lengths is None:
        lengths = sorted({max(1, seq_len // d) for d in (64, 16, 4, 2, 1)})
    lengths = [int(n) for n in lengths]
    if not lengths or any(n < 1 or n > seq_len for n in lengths):
        raise ConfigError(f"{lengths=} must be document lengths in [1, {seq_len=}]")
    if isinstance(repeats, bool) or not isinstance(repeats, int) or repeats < 1:
        raise ConfigError(f"{repeats=} must be an int >= 1")
    import torch

    gen = torch.Generator().manual_seed(seed)
    batches = [
        (_docs(n, seq_len), packed_batch(_docs(n, seq_len), seq_len, vocab=vocab, generator=gen, device=device))
        for n in lengths
    ]
    sync = _sync_for(device)
    for i in range(max(0, warmup)):
        step_fn(batches[i % len(batches)][1])
    sync()
    samples = []
    for _ in range(repeats):  # round robin, so that a slow spell of the machine touches every length
        for docs, batch in batches:
            sync()
            t0 = clock()
            step_fn(batch)
            sync()
            samples.append(Sample(lengths=docs, seconds=clock() - t0))
    if not all(math.isfinite(s.seconds) and s.seconds >= 0 for s in samples):
        raise ConfigError("the clock went backwards or gave a non-finite time; pass a monotonic clock")
    return fit(samples, seq_len=seq_len)
