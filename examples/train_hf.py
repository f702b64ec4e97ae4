# torchrun --nproc-per-node 2 examples/train_hf.py --job examples/demo_job.toml --steps 50 --ckpt /tmp/hf-ckpt
"""Train a Hugging Face Llama (small random config) on msdata batches, with checkpoints that resume exactly.

Needs the `examples` extra (``pip install -e ".[examples]"``) and a node server (``msdata-server serve``);
the job's ``[mesh] dp`` must equal the number of processes. Under torchrun (or RANK, WORLD_SIZE,
MASTER_ADDR and MASTER_PORT in the environment) every process is one DP rank: gloo on CPU, NCCL on GPU.

The batches are packed the way Hugging Face expects packed rows: ``position_ids`` restart at every
document, no ``attention_mask`` and ``use_cache=False``, so the model's attention stays within each
document. The loss is the batch's own: ``labels`` are already the next tokens, ``loss_mask`` zeroes the
document boundaries and the padding. A checkpoint holds the model, the optimizer and
``loader.state_dict()`` of one step boundary (``step-N.pt``); ``--resume`` continues from the newest one
(or the one named) with the same losses, bit for bit, as a run that was never stopped.
"""

from __future__ import annotations

import argparse
import json
import os
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP
from transformers import LlamaConfig, LlamaForCausalLM

import msdata_client as msd


def build_model(args: argparse.Namespace, seq_len: int) -> LlamaForCausalLM:
    """A small Llama from a random initialisation (the same on every rank: seeded)."""
    torch.manual_seed(args.seed)
    cfg = LlamaConfig(
        vocab_size=args.vocab,
        hidden_size=args.hidden,
        intermediate_size=2 * args.hidden,
        num_hidden_layers=args.layers,
        num_attention_heads=args.heads,
        num_key_value_heads=args.heads,
        max_position_embeddings=seq_len,
        attn_implementation="sdpa",
        use_cache=False,
    )
    return LlamaForCausalLM(cfg)


def micro_loss(model: torch.nn.Module, batch: dict, device: torch.device) -> torch.Tensor:
    """Mean next-token loss over the micro-batch's loss mask."""
    tokens = batch["tokens"].to(device, non_blocking=True)
    logits = model(input_ids=tokens, position_ids=batch["position_ids"].to(device), use_cache=False).logits
    mask = batch["loss_mask"].to(device).reshape(-1).float()
    ce = F.cross_entropy(
        logits.reshape(-1, logits.shape[-1]).float(), batch["labels"].to(device).reshape(-1), reduction="none"
    )
    return (ce * mask).sum() / mask.sum().clamp(min=1.0)


def save(path: Path, model: torch.nn.Module, opt: torch.optim.Optimizer, loader: msd.DataClient, step: int) -> None:
    """Model, optimizer and the data position of one step boundary, together (rank 0 writes; all wait)."""
    data = loader.state_dict()  # every rank's state at a step boundary holds the same global position
    if dist.get_rank() == 0:
        tmp = path / f"step-{step}.pt.tmp"
        torch.save({"step": step, "model": model.state_dict(), "optimizer": opt.state_dict(), "data": data}, tmp)
        os.replace(tmp, path / f"step-{step}.pt")  # a crash mid-write never leaves a half checkpoint
    dist.barrier()


def latest(ckpt_dir: Path | None) -> Path | None:
    """The checkpoint of the highest step in ckpt_dir, if any."""
    found = sorted(ckpt_dir.glob("step-*.pt"), key=lambda p: int(p.stem[5:])) if ckpt_dir else []
    return found[-1] if found else None


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--job", default="examples/demo_job.toml", help="the job TOML (its [mesh] dp = processes)")
    ap.add_argument("--endpoint", default=None, help="the node server's socket (default: $MSDATA_ENDPOINT)")
    ap.add_argument("--steps", type=int, default=50, help="optimizer steps to reach")
    ap.add_argument("--ckpt", default=None, help="checkpoint folder")
    ap.add_argument("--save-every", type=int, default=10)
    ap.add_argument(
        "--resume",
        nargs="?",
        const="latest",
        default=None,
        help="continue from a checkpoint: the newest step-N.pt in --ckpt, or the file named",
    )
    ap.add_argument("--losses", default=None, help="rank 0 appends one JSON line per step (step, loss)")
    ap.add_argument("--lr", type=float, default=3e-3)
    ap.add_argument("--vocab", type=int, default=320, help="> the job's pad_id (byte tokens, EOS 256, pad 257)")
    ap.add_argument("--hidden", type=int, default=64)
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--heads", type=int, default=4)
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()

    cuda = torch.cuda.is_available()
    dist.init_process_group("nccl" if cuda else "gloo")
    device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0))) if cuda else torch.device("cpu")
    if cuda:
        torch.cuda.set_device(device)
    job = msd.DGraph.from_toml(args.job).plan()  # the validated JobSpec
    micro = job.micro_batches
    model = build_model(args, job.seq_len).to(device)
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.0)
    ckpt_dir = Path(args.ckpt) if args.ckpt else None
    start = 0
    state = None
    if args.resume:
        path = latest(ckpt_dir) if args.resume == "latest" else Path(args.resume)
        if path is None or not path.exists():
            raise SystemExit(f"--resume {args.resume}: no checkpoint found (--ckpt {args.ckpt!r})")
        state = torch.load(path, map_location=device, weights_only=True)
        model.load_state_dict(state["model"])
        opt.load_state_dict(state["optimizer"])
        start = state["step"]
    ddp = DDP(model, device_ids=[device.index] if cuda else None)

    with msd.DataClient(job, endpoint=args.endpoint) as loader:  # rank and world size from the environment
        if state is not None:
            loader.load_state_dict(state["data"])  # before iterating
        for step in range(start, args.steps):
            opt.zero_grad(set_to_none=True)
            total = torch.zeros((), device=device)
            for m in range(micro):
                batch = next(loader)
                if m < micro - 1:
                    with ddp.no_sync():  # gradients are averaged across ranks once, on the last micro-batch
                        loss = micro_loss(ddp, batch, device) / micro
                        loss.backward()
                else:
                    loss = micro_loss(ddp, batch, device) / micro
                    loss.backward()
                total += loss.detach()
                del batch  # its shared-memory slot goes back to the ring
            opt.step()
            dist.all_reduce(total)
            mean = float(total) / dist.get_world_size()
            if dist.get_rank() == 0:
                print(f"step {step + 1}: loss {mean:.4f}", flush=True)
                if args.losses:
                    with open(args.losses, "a") as f:
                        f.write(json.dumps({"step": step + 1, "loss": mean}) + "\n")
            done = step + 1
            if ckpt_dir is not None and done % args.save_every == 0:
                ckpt_dir.mkdir(parents=True, exist_ok=True)
                save(ckpt_dir, model, opt, loader, done)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
