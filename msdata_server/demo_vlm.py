"""`msdata-server demo --vlm`: a small image-text job end to end, with images it generates (needs Pillow).

Writes captioned JPEG photos to Parquet (an ``image`` and a ``caption`` column), PNG document pages to
WebDataset tar shards (``png`` and ``txt`` parts) and plain text to Parquet, starts a node server in this
process, runs two simulated trainer ranks (dp=2) as separate processes that check every micro-batch's image
keys (placeholders per image, pixel rows per grid), and prints a summary: images and patches delivered, and
the two-stage planner's encoder and backbone imbalance.
"""

from __future__ import annotations

import io
import multiprocessing as mp
import os
import shutil
import tarfile
import tempfile
import time
from collections.abc import Callable
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

from .config import NodeConfig, ServerConfig
from .demo import follow_ranks, serve_in_thread, stop_server
from .errors import ConfigError

__all__ = ["make_vlm_dataset", "run_vlm_demo", "vlm_demo_job"]

PATCH, MERGE = 14, 2
TRANSFORM = f"msdata_server.transforms:vlm(patch={PATCH}, merge={MERGE}, min_pixels=3136, max_pixels=301056"
COLOURS = ("red", "green", "blue", "yellow", "white", "black", "orange", "purple")


def _image(rng: np.random.Generator, w: int, h: int, fmt: str) -> tuple[bytes, str]:
    """A generated picture (a colour field with a few boxes) and the colour its caption names."""
    from PIL import Image, ImageColor, ImageDraw

    colour = COLOURS[int(rng.integers(len(COLOURS)))]
    im = Image.new("RGB", (w, h), ImageColor.getrgb(colour))
    draw = ImageDraw.Draw(im)
    for _ in range(int(rng.integers(1, 6))):
        x, y = int(rng.integers(0, w)), int(rng.integers(0, h))
        draw.rectangle((x, y, x + w // 8, y + h // 8), fill=tuple(int(c) for c in rng.integers(0, 256, 3)))
    buf = io.BytesIO()
    im.save(buf, fmt, **({"quality": 90} if fmt == "JPEG" else {}))
    return buf.getvalue(), colour


def make_vlm_dataset(root: str, *, seed: int = 0, photos: int = 240, pages: int = 60) -> dict[str, str]:
    """Write the demo's three sources under root; returns {source: directory}."""
    rng = np.random.default_rng(seed)
    dirs = {n: os.path.join(root, n) for n in ("photos", "pages", "text")}
    for d in dirs.values():
        os.makedirs(d, exist_ok=True)
    for f in range(2):  # captioned photos: JPEG, small to medium
        rows = [_image(rng, int(rng.integers(80, 640)), int(rng.integers(80, 480)), "JPEG") for _ in range(photos // 2)]
        caps = [f"a photo, mostly {c}, number {f}-{i}" for i, (_, c) in enumerate(rows)]
        table = pa.table({"image": [b for b, _ in rows], "caption": caps})
        pq.write_table(table, os.path.join(dirs["photos"], f"part-{f}.parquet"), row_group_size=32)
    for k in range(2):  # document pages: PNG, large, with a longer text
        with tarfile.open(os.path.join(dirs["pages"], f"shard-{k:03d}.tar"), "w") as tf:
            for i in range(pages // 2):
                img, c = _image(rng, int(rng.integers(400, 900)), int(rng.integers(500, 1100)), "PNG")
                text = (f"page {k}-{i} on {c} paper. " * int(rng.integers(5, 60))).encode()
                for ext, data in (("png", img), ("txt", text)):
                    ti = tarfile.TarInfo(f"doc{k}/{i:05d}.{ext}")
                    ti.size = len(data)
                    tf.addfile(ti, io.BytesIO(data))
    words = np.array(
        ["the", "a", "data", "model", "image", "text", "token", "vision", "encoder", "backbone", "rank", "step"]
    )
    texts = [" ".join(rng.choice(words, int(rng.lognormal(5.0, 1.0)) + 4).tolist()) for _ in range(2000)]
    pq.write_table(pa.table({"text": texts}), os.path.join(dirs["text"], "part-0.parquet"), row_group_size=256)
    return dirs


def vlm_demo_job(dirs: dict[str, str]):
    """The demo's job: two picture sources and a text source, the two-stage cost, dp=2."""
    from msdata_client.graph import DGraph

    g = DGraph("demo-vlm", seed=1234)
    g.source("photos", "parquet", [dirs["photos"]], columns=["image", "caption"], transform=TRANSFORM + ")")
    g.source(
        "pages",
        "webdataset",
        [dirs["pages"]],
        columns=["png", "txt"],
        transform=TRANSFORM + ', image_key="png", text_key="txt")',
    )
    g.source("text", "parquet", [dirs["text"]])
    g.mix({"photos": 0.4, "pages": 0.4, "text": 0.2}).cost("vlm", alpha=1.0, beta=4096.0, alpha_v=1.0, beta_v=2048.0)
    return g.pack(4096, micro_batches=2).mesh(dp=2).prefetch(2).plan()


def _rank_main(job_dict: dict, endpoint: str, rank: int, world: int, steps: int, q) -> None:
    """A simulated trainer rank (separate process): checks and counts the image keys of every micro-batch."""
    import torch

    import msdata_client as msd

    torch.set_num_threads(1)
    spec = msd.JobSpec.from_dict(job_dict)
    images = patches = empty = 0
    t0 = time.perf_counter()
    with msd.DataClient(spec, endpoint=endpoint, rank=rank, world_size=world) as dc:
        for i in range(steps * spec.micro_batches):
            b = next(dc)
            grid, pv = b["image_grid_thw"], b["pixel_values"]
            placeholders = int((b["tokens"] == spec.image_token_id).sum())
            if pv.shape[0] != int(grid.prod(dim=1).sum()) or placeholders != pv.shape[0] // MERGE**2:
                raise AssertionError(f"rank {rank} micro-batch {i}: image keys disagree with the placeholders")
            images += grid.shape[0]
            patches += pv.shape[0]
            empty += grid.shape[0] == 0
            del b
            if (i + 1) % spec.micro_batches == 0:
                q.put(("step", rank, (i + 1) // spec.micro_batches))
    stats = {"seconds": time.perf_counter() - t0, "images": images, "patches": patches, "text_only": empty}
    q.put(("done", rank, stats))


def run_vlm_demo(steps: int = 30) -> int:
    try:
        import PIL  # noqa: F401
    except ImportError:
        raise ConfigError("demo --vlm needs Pillow: pip install 'msdata[vlm]' (or pip install pillow)") from None
    root = tempfile.mkdtemp(prefix="msdata-demo-vlm-")
    try:
        return _run(root, steps)
    finally:
        shutil.rmtree(root, ignore_errors=True)


def _run(root: str, steps: int) -> int:
    t0 = time.perf_counter()
    print(f"msdata demo --vlm: generating photos (JPEG/Parquet), pages (PNG/WebDataset) and text under {root} ...")
    spec = vlm_demo_job(make_vlm_dataset(os.path.join(root, "data")))
    sock = os.path.join(root, "msdata.sock")
    cfg = ServerConfig(node=NodeConfig(id="demo-vlm", socket=sock, workers=2, shm_prefix="msdvlm", log_level="WARNING"))
    followed = serve_ranks(cfg, spec, _rank_main, steps, t0)
    if followed is None:
        return 1
    done, status = followed
    _summary(done, status)
    print(f"demo --vlm finished in {time.perf_counter() - t0:.1f}s", flush=True)
    return 0


def serve_ranks(cfg: ServerConfig, spec: Any, rank_main: Callable[..., None], steps: int, t0: float):
    """A picture demo's run: the server in a thread, one spawned process per rank running ``rank_main(job_dict,
    endpoint, rank, world, steps, queue)``, a progress line every 10 steps. Returns (done per rank, the last
    status) once every rank is done, or None (after the failure was printed); the server is stopped either way."""
    sock = cfg.node.socket
    server, loop, thread = serve_in_thread(cfg)
    print(f"  data ready in {time.perf_counter() - t0:.1f}s; server on {sock}; 2 ranks, {steps} steps", flush=True)
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    world = spec.mesh.world_size
    procs = [
        ctx.Process(target=rank_main, args=(spec.to_dict(), sock, r, world, steps, q), daemon=True)
        for r in range(world)
    ]
    for p in procs:
        p.start()
    shown = [-1]

    def tick(status: dict, progress: dict[int, int]) -> None:
        lo = min(progress.values())
        if lo // 10 != shown[0] // 10:  # a line every 10 steps
            shown[0] = lo
            print(f"  step {lo}/{steps}", flush=True)

    try:
        followed = follow_ranks(procs, q, server, loop, tick, every=1.0)
        if followed is not None:
            for p in procs:
                p.join(30)
        return followed
    finally:
        stop_server(server, loop, thread)


def _summary(done: dict[int, dict], status: dict) -> None:
    job = (status.get("jobs") or [{}])[0]
    seconds = max(d["seconds"] for d in done.values())
    images = sum(d["images"] for d in done.values())

    def fig(k: str) -> str:
        v = job.get(k)
        return "n/a" if v is None else f"{v:.3f}"

    bad = {n: s.get("bad_samples") for n, s in job.get("sources", {}).items() if s.get("bad_samples")}
    rows = [
        ("images delivered (all ranks)", f"{images}"),
        ("images / s", f"{images / seconds:.1f}"),
        ("patches delivered", f"{sum(d['patches'] for d in done.values())}"),
        ("micro-batches without images", f"{sum(d['text_only'] for d in done.values())}"),
        ("encoder imbalance (max/mean, mean over steps)", fig("encoder_imbalance")),
        ("backbone imbalance (max/mean, mean over steps)", fig("backbone_imbalance")),
        ("padding fraction", fig("padding_fraction")),
        ("bad samples", str(bad or "none")),
    ]
    w = max(len(r[0]) for r in rows)
    print("\nsummary")
    print("-" * (w + 14))
    for k, v in rows:
        print(f"{k:<{w}}  {v:>10}")
    print("-" * (w + 14))
