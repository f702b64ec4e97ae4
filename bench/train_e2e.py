# .venv/bin/python bench/train_e2e.py --quick
"""End-to-end gain on real model compute: the planner's placement against per-rank arrival-order packing.

A small plain-torch transformer (CPU-sized widths) runs forward and backward on every timed micro-batch of
full length (4k/8k/16k tokens), with attention restricted to each document (scaled dot-product attention
per segment of ``cu_seqlens``). Both placements read the text4 documents from the same per-source streams:
msdata's Planner (cost constants from ``msdata_client.calibrate`` on this very model) and the per-rank
loaders of ``msdata_server.planner.baseline`` (each rank draws sources with its own RNG and packs in arrival
order). A synchronous-DP step lasts as long as its slowest rank; ranks run one after another here and each
is timed. Throughput = useful tokens of the whole step / slowest rank's seconds.

At dp <= --full-dp every rank is timed. Above it (dp 64), per step and placement the --top ranks the cost
model predicts slowest are timed plus --sample others drawn at random (seeded): the step's time is the
slowest timed rank, and the table counts how often that was a predicted-slowest one.

Timing: the process CPU time of the one compute thread (torch runs single-threaded), which other jobs on a
shared machine do not inflate by preempting it; wall time is recorded beside it. Each timed micro-batch runs
--passes times (in alternating order over the whole list) and keeps its fastest run. Forward+backward only:
the optimizer step and the gradient all-reduce cost the same in both placements. Rows run whole, padding
included (fixed shapes, as msdata delivers them); --padding skip runs only the documents' tokens. The planner
prices padding as a job does by default (``[balance] pad_cost`` = the calibrated beta; 0 with --padding skip or
--pad-cost free), and "pred" is its cost model's gain (padding charged pad_cost per token); the "free" column is
the gain the padding-free model predicts, "rows" the gain with padding charged beta per token.
The last line is one JSON object.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
import tempfile
import time
from collections.abc import Callable, Mapping

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import itertools

from progress import bar, say
from workloads import TEXT4, SyntheticLengths

from msdata_client.calibration import Calibration, calibrate, packed_batch
from msdata_server.planner import Mixture, Planner, PlannerConfig, StepPlan
from msdata_server.planner.baseline import per_rank_steps
from msdata_server.planner.pack import LongDocs, next_fit, pieces

MICRO, ROWS = 4, 1  # per DP rank per step, as bench/balance.py
PAD_ID, VOCAB = 257, 260  # byte tokens, EOS 256, padding 257 (the job default)

# -- the model ------------------------------------------------------------------------------------------


def doc_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu_seqlens: torch.Tensor) -> torch.Tensor:
    """Causal attention of q, k, v ``[tokens, heads, head_dim]`` within each segment of ``cu_seqlens``.

    One SDPA call per document on a ``split`` view (its backward concatenates the gradients once; slicing
    would add a full-size gradient per document). Tokens past ``cu_seqlens[-1]`` get zeros."""
    bounds = cu_seqlens.tolist()
    lens = [b - a for a, b in itertools.pairwise(bounds)]
    tail = q.shape[0] - bounds[-1]
    outs = []
    for qs, ks, vs in zip(q.split([*lens, tail]), k.split([*lens, tail]), v.split([*lens, tail])):
        if qs.shape[0] == 0:
            continue
        if len(outs) == len(lens):  # the tail past the last segment: nothing to attend to
            outs.append(torch.zeros_like(qs))
            continue
        # 4-d [1, heads, L, head_dim]: the CPU flash kernel takes no 3-d input (the math path would build L x L)
        o = F.scaled_dot_product_attention(
            qs[None].transpose(1, 2), ks[None].transpose(1, 2), vs[None].transpose(1, 2), is_causal=True
        )
        outs.append(o.transpose(1, 2)[0])
    return torch.cat(outs) if len(outs) > 1 else outs[0]


class Block(nn.Module):
    def __init__(self, d_model: int, heads: int, head_dim: int):
        super().__init__()
        self.heads, self.head_dim = heads, head_dim
        self.ln1, self.ln2 = nn.LayerNorm(d_model), nn.LayerNorm(d_model)
        self.qkv = nn.Linear(d_model, 3 * heads * head_dim)
        self.proj = nn.Linear(heads * head_dim, d_model)
        self.mlp = nn.Sequential(nn.Linear(d_model, 4 * d_model), nn.GELU(), nn.Linear(4 * d_model, d_model))

    def forward(self, x: torch.Tensor, cu_seqlens: torch.Tensor) -> torch.Tensor:
        q, k, v = self.qkv(self.ln1(x)).view(x.shape[0], 3, self.heads, self.head_dim).unbind(1)
        x = x + self.proj(doc_attention(q, k, v, cu_seqlens).reshape(x.shape[0], -1))
        return x + self.mlp(self.ln2(x))


class TinyLM(nn.Module):
    """Decoder-only LM over one packed row: token + position embeddings (positions restart per document)."""

    def __init__(
        self,
        *,
        vocab: int = VOCAB,
        d_model: int = 32,
        heads: int = 1,
        head_dim: int = 16,
        layers: int = 2,
        max_len: int = 16384,
    ):
        super().__init__()
        self.tok = nn.Embedding(vocab, d_model)
        self.pos = nn.Embedding(max_len, d_model)
        self.blocks = nn.ModuleList(Block(d_model, heads, head_dim) for _ in range(layers))
        self.ln = nn.LayerNorm(d_model)
        self.head = nn.Linear(d_model, vocab, bias=False)

    def forward(self, tokens: torch.Tensor, position_ids: torch.Tensor, cu_seqlens: torch.Tensor) -> torch.Tensor:
        """Logits ``[tokens, vocab]`` of the flattened row(s)."""
        x = self.tok(tokens.reshape(-1)) + self.pos(position_ids.reshape(-1))
        for blk in self.blocks:
            x = blk(x, cu_seqlens)
        return self.head(self.ln(x))


def real_segments(batch: Mapping[str, torch.Tensor]) -> torch.Tensor:
    """cu_seqlens without the row's padding tail (padding attends to nothing: it carries no loss)."""
    cu = batch["cu_seqlens"]
    used = int((batch["tokens"].reshape(-1) != PAD_ID).sum())
    return cu[cu <= used]


def make_step(model: TinyLM, *, skip_padding: bool = False) -> Callable[[Mapping[str, torch.Tensor]], float]:
    """Forward + backward of one micro-batch (gradients accumulate, as under gradient accumulation).

    The whole row runs through the model, padding included, as in a trainer with fixed shapes; with
    ``skip_padding`` only the documents' tokens do (a trainer that unpads, as varlen attention allows)."""

    def step(batch: Mapping[str, torch.Tensor]) -> float:
        cu = real_segments(batch)
        if skip_padding:
            used = int(cu[-1])
            batch = {k: v[..., :used] if k != "cu_seqlens" else v for k, v in batch.items()}
        logits = model(batch["tokens"], batch["position_ids"], cu)
        mask = batch["loss_mask"].reshape(-1)
        loss = (F.cross_entropy(logits, batch["labels"].reshape(-1), reduction="none") * mask).sum() / mask.sum()
        loss.backward()
        return float(loss.detach())

    return step


# -- placements -----------------------------------------------------------------------------------------

Placed = list[list[list[int]]]  # [rank][micro] -> lengths of the pieces in that micro-batch, in order


class SharedStreams:
    """Each source's documents in one order, taken by whoever asks next: the baseline's ranks read the same
    documents, in the same per-source order, as the planner does (not merely the same distribution)."""

    def __init__(self, seq_len: int, seed: int):
        self.view = SyntheticLengths(TEXT4, seq_len, seed=seed)
        self.cursor = [0] * len(TEXT4.sources)

    def draw(self, source: int, n: int, rng: np.random.Generator) -> np.ndarray:
        out = self.view.lengths(source, self.cursor[source], n)
        self.cursor[source] += n
        return out

    def mean_len(self) -> dict[str, float]:
        return {name: float(self.view.lengths(i, 0, 20000).mean()) for i, name in enumerate(self.view.names)}


def planner_steps(
    seq_len: int, dp: int, steps: int, seed: int, alpha: float, beta: float, pad_cost: float
) -> list[tuple[Placed, int]]:
    """msdata: one Planner for all ranks, costed with the calibrated constants (padding at pad_cost per token)."""
    cfg = PlannerConfig(
        sources=tuple(TEXT4.sources),
        seq_len=seq_len,
        dp=dp,
        micro_batches=MICRO,
        rows=ROWS,
        alpha=alpha,
        beta=beta,
        pad_cost=pad_cost,
        mixture=Mixture.constant(TEXT4.weights),
    )
    planner, view = Planner(cfg), SyntheticLengths(TEXT4, seq_len, seed=seed)
    out = []
    for _ in range(steps):
        plan: StepPlan = planner.plan_step(view)
        placed: Placed = [[[] for _ in range(MICRO)] for _ in range(dp)]
        for g, m, n in zip(plan.group.tolist(), plan.micro.tolist(), plan.length.tolist()):
            placed[g][m].append(n)
        out.append((placed, int(plan.length.sum())))
    return out


def arrival_steps(seq_len: int, dp: int, steps: int, seed: int) -> list[tuple[Placed, int]]:
    """The baseline's placements. ``per_rank_steps`` returns only each step's figures, so this follows it
    draw for draw (same RNG calls, pieces and next_fit) to get the micro-batches, and checks that the
    figures it gives for the same steps are the ones ``per_rank_steps`` computes."""
    streams = SharedStreams(seq_len, seed)
    mean_len = streams.mean_len()
    names = list(TEXT4.weights)
    w = np.array([TEXT4.weights[n] for n in names]) / np.array([mean_len[n] for n in names])
    p = w / w.sum()
    k = MICRO * ROWS
    rngs = [np.random.default_rng([seed, 1, r]) for r in range(dp)]
    pending = [np.zeros(0, np.int64) for _ in range(dp)]
    out = []
    for _ in range(steps):
        placed: Placed = []
        tokens = 0
        for r in range(dp):
            docs, have = [pending[r]], int(pending[r].sum())
            while have < k * seq_len + seq_len:
                src = rngs[r].choice(len(names), size=64, p=p)
                lens = np.concatenate([streams.draw(s, int((src == s).sum()), rngs[r]) for s in range(len(names))])
                lens = lens[rngs[r].permutation(lens.size)]
                docs.append(lens)
                have += int(lens.sum())
            _, _, piece_len = pieces(np.concatenate(docs), seq_len, LongDocs.SPLIT)
            row = next_fit(piece_len, k, seq_len)
            pending[r] = piece_len[row < 0]
            micro: list[list[int]] = [[] for _ in range(MICRO)]
            for rw, n in zip(row.tolist(), piece_len.tolist()):
                if rw >= 0:
                    micro[rw // ROWS].append(n)
            placed.append(micro)
            tokens += int(piece_len[row >= 0].sum())
        out.append((placed, tokens))
    check = SharedStreams(seq_len, seed)
    ref = per_rank_steps(
        check.draw,
        TEXT4.weights,
        check.mean_len(),
        seq_len=seq_len,
        dp=dp,
        micro_batches=MICRO,
        rows=ROWS,
        steps=steps,
        seed=seed,
        alpha=1.0,
        beta=0.0,
    )
    for (placed, tokens), want in zip(out, ref):
        sq = max(sum(n * n for mb in rank for n in mb) for rank in placed)
        if tokens != want["tokens"] or not math.isclose(sq, want["max_cost"], rel_tol=1e-12):
            raise RuntimeError("arrival_steps no longer follows msdata_server.planner.baseline.per_rank_steps")
    return out


# -- measuring ------------------------------------------------------------------------------------------


def pad_cost(args: argparse.Namespace, cal: Calibration) -> float:
    """What the planner charges a padded token: the calibrated beta (a job's default: fixed shapes run the padding
    through the linear layers), 0 when the trainer skips padding or --pad-cost free."""
    return 0.0 if args.padding == "skip" or args.pad_cost == "free" else cal.beta


def timed_ranks(pred: np.ndarray, dp: int, full_dp: int, top: int, sample: int, rng: np.random.Generator) -> list[int]:
    """Every rank at dp <= full_dp; else the `top` predicted slowest plus `sample` others at random."""
    if dp <= full_dp:
        return list(range(dp))
    order = np.argsort(-pred, kind="stable")
    rest = order[top:]
    return sorted(order[:top].tolist() + rng.choice(rest, size=min(sample, rest.size), replace=False).tolist())


def run_micro(step: Callable, lengths: list[int], seq_len: int, gen: torch.Generator) -> tuple[float, float]:
    """(cpu seconds, wall seconds) of forward+backward on one packed micro-batch."""
    batch = packed_batch(lengths, seq_len, generator=gen) if lengths else packed_batch([1], seq_len, generator=gen)
    c, t = time.process_time(), time.perf_counter()
    step(batch)
    return time.process_time() - c, time.perf_counter() - t


def measure(args: argparse.Namespace, model: TinyLM, seq_len: int, dp: int, cal: Calibration) -> dict:
    """Plan, time and summarise one (seq_len, dp): per placement, tokens and the slowest timed rank per step.

    Every timed micro-batch runs --passes times, the passes in alternate order (forward, then backward
    through the list), and keeps its fastest run: noise on a shared machine only ever adds time, and a slow
    spell of the machine then rarely hits both runs of one micro-batch."""
    step = make_step(model, skip_padding=args.padding == "skip")
    total = args.steps + 1  # step 0 is the planner's warm-up (no carry-over yet), as in bench/balance.py
    placements = {
        "msdata": planner_steps(seq_len, dp, total, args.seed, cal.alpha, cal.beta, pad_cost(args, cal))[1:],
        "baseline": arrival_steps(seq_len, dp, total, args.seed)[1:],
    }
    rng = np.random.default_rng([args.seed, seq_len, dp])
    acc = {
        m: {"tokens": 0, "cpu": 0.0, "wall": 0.0, "pred": 0.0, "free": 0.0, "pred_rows": 0.0, "timed": 0, "top_hit": 0}
        | {"imb": []}
        for m in placements
    }
    jobs: list[tuple[str, int, int, int, list[int]]] = []  # (method, step, rank, micro, lengths), in run order
    tops: dict[tuple[str, int], set[int]] = {}
    for s in range(args.steps):
        chosen = []
        for method, steps in placements.items():
            placed, tokens = steps[s]
            free = np.array([sum(cal.predict(mb) for mb in rank) for rank in placed])
            pads = np.array([MICRO * ROWS * seq_len - sum(map(sum, rank)) for rank in placed], np.float64)
            pred = free + pad_cost(args, cal) * pads  # the planner's cost model
            chosen.append((method, timed_ranks(pred, dp, args.full_dp, args.top, args.sample, rng)))
            tops[method, s] = set(np.argsort(-pred, kind="stable")[: args.top].tolist())
            acc[method]["tokens"] += tokens
            acc[method]["pred"] += float(pred.max())
            acc[method]["free"] += float(free.max())
            # the same cost with every padding token charged beta, as a fixed-shape trainer pays it
            acc[method]["pred_rows"] += float((free + cal.beta * pads).max())
            acc[method]["timed"] += len(chosen[-1][1])
        # interleave the placements micro-batch by micro-batch, so that a slow spell of the machine touches both
        lists = [
            [(method, s, r, m, mb) for r in ranks for m, mb in enumerate(placements[method][s][0][r])]
            for method, ranks in chosen
        ]
        for i in range(max(map(len, lists))):
            jobs += [lst[i] for lst in lists if i < len(lst)]
    best = np.full((len(jobs), 2), np.inf)
    gen = torch.Generator().manual_seed(args.seed)
    for p in range(args.passes):
        order = range(len(jobs)) if p % 2 == 0 else range(len(jobs) - 1, -1, -1)
        for j in order:
            best[j] = np.minimum(best[j], run_micro(step, jobs[j][4], seq_len, gen))
    micro_rows = [
        {
            "seq_len": seq_len,
            "dp": dp,
            "method": job[0],
            "step": job[1],
            "rank": job[2],
            "micro": job[3],
            "lengths": job[4],
            "pred": cal.predict(job[4]),
            "cpu": float(b[0]),
            "wall": float(b[1]),
        }
        for job, b in zip(jobs, best)
    ]
    ranks: dict[tuple[str, int], dict[int, np.ndarray]] = {}
    for (method, s, r, _, _), b in zip(jobs, best):
        per = ranks.setdefault((method, s), {})
        per[r] = per.get(r, 0.0) + b
    for (method, s), per in ranks.items():
        cpu = {r: float(v[0]) for r, v in per.items()}
        slow = max(cpu, key=cpu.__getitem__)
        a = acc[method]
        a["cpu"] += cpu[slow]
        a["wall"] += max(float(v[1]) for v in per.values())
        a["top_hit"] += int(slow in tops[method, s])
        a["imb"].append(cpu[slow] / float(np.mean(list(cpu.values()))))
    out: dict = {"micro": micro_rows}
    for method, a in acc.items():
        out[method] = {
            "tok_s": a["tokens"] / a["cpu"],
            "tok_s_wall": a["tokens"] / a["wall"],
            "tok_s_pred": a["tokens"] / a["pred"],
            "tok_s_rows": a["tokens"] / a["pred_rows"],
            "tok_s_free": a["tokens"] / a["free"],
            "timed": a["timed"] / args.steps,
            "top_hit": a["top_hit"],
            "imbalance": float(np.mean(a["imb"])),
        }
    return out


def r_squared(rows: list[dict], key: str, *, calibrated: bool = False) -> float:
    """R^2 of measured seconds against the predicted cost: of the least-squares line from cost to seconds (the
    planner uses costs only relative to each other), or, ``calibrated``, of the calibrated seconds themselves
    (which also asks that the machine ran as fast while timing as while calibrating)."""
    y = np.array([r[key] for r in rows])
    p = np.array([r["pred"] for r in rows])
    if not calibrated:
        p = np.polyval(np.polyfit(p, y, 1), p)
    tot = float(((y - y.mean()) ** 2).sum())
    return 1.0 - float(((y - p) ** 2).sum()) / tot if tot > 0 else 1.0


def mean_abs_error(rows: list[dict], key: str) -> float:
    """sum |measured - predicted| / sum predicted (weighted, so that a nearly empty micro-batch, whose padding the
    cost model calls free, does not dominate)."""
    return float(sum(abs(r[key] - r["pred"]) for r in rows) / sum(r["pred"] for r in rows))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="one measured step per config, fewer ranks (< 5 min)")
    ap.add_argument("--steps", type=int, default=None, help="measured steps per config (after the planner's warm-up)")
    ap.add_argument("--dp", default="8,64", help="comma list of DP sizes")
    ap.add_argument("--seq-lens", default=",".join(map(str, TEXT4.seq_lens)), help="comma list")
    ap.add_argument("--full-dp", type=int, default=8, help="time every rank up to this dp")
    ap.add_argument("--top", type=int, default=None, help="above --full-dp: predicted-slowest ranks timed per step")
    ap.add_argument("--sample", type=int, default=None, help="above --full-dp: other ranks timed at random per step")
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--d-model", type=int, default=32)
    ap.add_argument("--heads", type=int, default=1)
    ap.add_argument("--head-dim", type=int, default=16)
    ap.add_argument("--passes", type=int, default=3, help="runs of each timed micro-batch (the fastest is kept)")
    ap.add_argument(
        "--padding",
        choices=("compute", "skip"),
        default="compute",
        help="compute: whole rows run (fixed shapes); skip: only the documents' tokens run (unpadded)",
    )
    ap.add_argument(
        "--pad-cost",
        choices=("beta", "free"),
        default="beta",
        help="what the planner charges a padded token: the calibrated beta (a job's default) or nothing",
    )
    ap.add_argument("--threads", type=int, default=1, help="torch threads (1 makes the CPU clock exact)")
    ap.add_argument("--repeats", type=int, default=None, help="calibration repeats per length")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--dump", default=None, help="write every timed micro-batch (lengths, predicted, measured) as JSON")
    ap.add_argument("--smoke", action="store_true", help="seconds: 4k, dp 2 (every rank) and 8 (top + sample), 1 step")
    args = ap.parse_args()
    smoke_dump = None
    if args.smoke:  # every rank timed at dp 2, the sampled ranks at dp 8; both passes' orders; the dump written
        args.seq_lens, args.dp, args.full_dp, args.steps, args.top, args.sample = "4096", "2,8", 2, 1, 1, 1
        args.passes, args.repeats, args.layers = 2, 1, 1
        if args.dump is None:
            fd, smoke_dump = tempfile.mkstemp(prefix="msd-e2e-smoke-", suffix=".json")
            os.close(fd)
            args.dump = smoke_dump
    args.steps = args.steps or (1 if args.quick else 3)
    args.top = args.top if args.top is not None else (2 if args.quick else 4)
    args.sample = args.sample if args.sample is not None else (2 if args.quick else 4)
    repeats = args.repeats or 3
    torch.set_num_threads(args.threads)
    torch.manual_seed(args.seed)
    seq_lens = [int(x) for x in args.seq_lens.split(",")]
    dps = [int(x) for x in args.dp.split(",")]
    model = TinyLM(
        d_model=args.d_model, heads=args.heads, head_dim=args.head_dim, layers=args.layers, max_len=max(seq_lens)
    )
    t_start = time.perf_counter()
    say(
        f"text4, micro_batches={MICRO}, rows={ROWS}; model: {args.layers} layers, d_model {args.d_model}, "
        f"{args.heads} heads x {args.head_dim}, {sum(p.numel() for p in model.parameters())} parameters, "
        f"{args.threads} thread(s); {args.steps} measured step(s) per config; ranks timed above dp {args.full_dp}: "
        f"{args.top} predicted slowest + {args.sample} random"
    )
    head = (
        f"{'seq_len':>7} {'dp':>4} | {'alpha':>8} {'beta':>8} {'cal R2':>6} | {'timed':>5} {'top':>3} | "
        f"{'msd tok/s':>9} {'base tok/s':>10} | {'pred':>5} {'free':>5} {'rows':>5} {'e2e':>5} {'wall':>5} "
        f"{'e2e/pred':>8} | "
        f"{'R2':>6} {'R2cal':>6} {'err':>5} {'s':>4}"
    )
    say(head)
    say("-" * len(head))
    res: dict[str, float | str] = {
        "padding": args.padding,
        "model": f"{args.layers}x(d{args.d_model}, {args.heads}x{args.head_dim} attention)",
        "steps": args.steps,
        "passes": args.passes,
        "timed_above_dp8": f"top {args.top} + {args.sample} random",
        "pad_cost": "0" if args.padding == "skip" or args.pad_cost == "free" else "beta",
    }
    every: list[dict] = []
    step = make_step(model)
    prog = bar(len(seq_lens) * len(dps), "train_e2e", "config")
    for seq_len in seq_lens:
        k = f"{seq_len // 1024}k"
        lengths = [n for n in (256, 512, 1024, 2048, 4096, 8192, 16384) if n <= seq_len]
        cal = calibrate(step, lengths=lengths, seq_len=seq_len, repeats=repeats)
        res.update(
            {
                f"alpha_{k}": float(f"{cal.alpha:.4g}"),
                f"beta_{k}": float(f"{cal.beta:.4g}"),
                f"calibration_r2_{k}": round(cal.r2, 4),
            }
        )
        by_len: list[dict] = []
        for dp in dps:
            t0 = time.perf_counter()
            out = measure(args, model, seq_len, dp, cal)
            msd, base = out["msdata"], out["baseline"]
            gain, pred = msd["tok_s"] / base["tok_s"], msd["tok_s_pred"] / base["tok_s_pred"]
            rows, wall = msd["tok_s_rows"] / base["tok_s_rows"], msd["tok_s_wall"] / base["tok_s_wall"]
            free = msd["tok_s_free"] / base["tok_s_free"]
            by_len += out["micro"]
            tag = f"{k}_dp{dp}"
            res.update(
                {
                    f"e2e_gain_{tag}": round(gain, 3),
                    f"predicted_gain_{tag}": round(pred, 3),
                    f"predicted_gain_rows_{tag}": round(rows, 3),
                    f"predicted_gain_free_{tag}": round(free, 3),
                    f"e2e_over_predicted_{tag}": round(gain / pred, 3),
                    f"e2e_gain_wall_{tag}": round(wall, 3),
                    f"tokens_per_s_{tag}": round(msd["tok_s"]),
                    f"baseline_tokens_per_s_{tag}": round(base["tok_s"]),
                    f"measured_imbalance_{tag}": round(msd["imbalance"], 3),
                    f"baseline_measured_imbalance_{tag}": round(base["imbalance"], 3),
                }
            )
            say(
                f"{seq_len:>7} {dp:>4} | {cal.alpha:8.2e} {cal.beta:8.2e} {cal.r2:6.3f} | "
                f"{msd['timed'] + base['timed']:5.0f} {msd['top_hit'] + base['top_hit']:>3} | "
                f"{msd['tok_s']:9.0f} {base['tok_s']:10.0f} | {pred:5.2f} {free:5.2f} {rows:5.2f} {gain:5.2f} "
                f"{wall:5.2f} "
                f"{gain / pred:8.3f} | {r_squared(out['micro'], 'cpu'):6.3f} "
                f"{r_squared(out['micro'], 'cpu', calibrated=True):6.3f} "
                f"{mean_abs_error(out['micro'], 'cpu'):5.3f} "
                f"{time.perf_counter() - t0:4.0f}"
            )
            prog.update(1)
        res[f"cost_model_r2_{k}"] = round(r_squared(by_len, "cpu"), 4)
        res[f"cost_model_r2_calibrated_{k}"] = round(r_squared(by_len, "cpu", calibrated=True), 4)
        res[f"cost_model_error_{k}"] = round(mean_abs_error(by_len, "cpu"), 4)
        every += by_len
    prog.close()
    if args.dump:
        with open(args.dump, "w") as f:
            json.dump(every, f)
        if smoke_dump is not None:
            os.unlink(smoke_dump)
    res["cost_model_r2"] = round(r_squared(every, "cpu"), 4)
    res["cost_model_r2_calibrated"] = round(r_squared(every, "cpu", calibrated=True), 4)
    res["cost_model_r2_wall"] = round(r_squared(every, "wall"), 4)
    res["cost_model_error"] = round(mean_abs_error(every, "cpu"), 4)
    res["micro_batches_timed"] = len(every)
    res["wall_s"] = round(time.perf_counter() - t_start, 1)
    say(
        "tok/s: useful tokens of the whole step (all dp ranks) per second of its slowest rank, CPU clock. Gains over "
        "the baseline: pred = the planner's cost model (padding charged pad_cost per token), free = the cost model "
        "with padding free, rows = with padding charged beta per token, e2e = measured (CPU clock), wall = measured "
        "(wall clock). timed: ranks timed per step (both placements); top: steps whose slowest timed rank was a "
        "predicted-slowest one. R2: of measured CPU seconds per micro-batch against the cost alpha*L^2 + beta*L (a "
        "line from cost to seconds); R2cal and err (sum |measured - predicted| / sum predicted): against the "
        f"calibrated seconds themselves; {len(every)} micro-batches in all; s: seconds this row took"
    )
    say(json.dumps(res, sort_keys=True))


if __name__ == "__main__":
    main()
