"""`msdata-server demo --video`: a small job mixing captions, pages, short clips and long clips end to end, with
clips it generates (needs PyAV and Pillow).

Writes the ``--vlm`` demo's photos, pages and text (``demo_vlm.make_vlm_dataset``), plus H.264 clips: short ones
(2 to 6 s) in WebDataset shards (``mp4`` and ``txt`` parts) and long ones (20 to 40 s) in a Parquet binary
column. Starts a node server in this process, runs two simulated trainer ranks (dp=2) as separate processes
that check every micro-batch's video keys (placeholders per temporal patch, rows per grid, boundaries per
temporal patch), and prints a summary: clips, frames and images delivered, and both stages' imbalance.
"""

from __future__ import annotations

import io
import os
import shutil
import tarfile
import tempfile
import time

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

from .config import NodeConfig, ServerConfig
from .demo_vlm import MERGE, TRANSFORM, make_vlm_dataset, serve_ranks
from .errors import ConfigError

__all__ = ["make_clip", "make_video_dataset", "run_video_demo", "video_demo_job"]

FPS = 10  # frames per second of the generated clips
VIDEO = TRANSFORM + ', video_key="mp4", text_key="txt", video_min_pixels=3136, video_max_pixels=50176)'


def make_clip(seconds: float, width: int, height: int, seed: int) -> bytes:
    """An H.264 clip of moving colour gradients (``FPS`` frames a second)."""
    import av

    rng = np.random.default_rng(seed)
    dx, dy = (int(v) for v in rng.integers(1, 6, 2))
    x = np.arange(width, dtype=np.uint16)[None, :]
    y = np.arange(height, dtype=np.uint16)[:, None]
    frame = np.empty((height, width, 3), np.uint8)
    buf = io.BytesIO()
    with av.open(buf, "w", format="mp4") as c:
        s = c.add_stream("libx264", rate=FPS)
        s.width, s.height, s.pix_fmt = width, height, "yuv420p"
        s.options = {"preset": "ultrafast"}
        for i in range(max(1, int(seconds * FPS))):
            frame[..., 0] = (x + dx * i) & 255
            frame[..., 1] = (y + dy * i) & 255
            frame[..., 2] = (x + y + i + seed) & 255
            for p in s.encode(av.VideoFrame.from_ndarray(frame, format="rgb24")):
                c.mux(p)
        for p in s.encode():
            c.mux(p)
    return buf.getvalue()


def make_video_dataset(root: str, *, seed: int = 0, clips: int = 40, long_clips: int = 6) -> dict[str, str]:
    """The --vlm demo's sources plus short clips (WebDataset) and long clips (Parquet) under root."""
    dirs = make_vlm_dataset(root, seed=seed, photos=80, pages=20)
    rng = np.random.default_rng([seed, 1])
    dirs["clips"], dirs["long"] = os.path.join(root, "clips"), os.path.join(root, "long")
    os.makedirs(dirs["clips"], exist_ok=True)
    os.makedirs(dirs["long"], exist_ok=True)
    for k in range(2):
        with tarfile.open(os.path.join(dirs["clips"], f"shard-{k:03d}.tar"), "w") as tf:
            for i in range(clips // 2):
                secs = float(rng.uniform(2, 6))
                w, h = int(rng.integers(4, 11)) * 32, int(rng.integers(3, 8)) * 32
                parts = {"mp4": make_clip(secs, w, h, k * 1000 + i), "txt": f"a {secs:.1f} s clip {k}-{i}".encode()}
                for ext, data in parts.items():
                    ti = tarfile.TarInfo(f"clip{k}/{i:05d}.{ext}")
                    ti.size = len(data)
                    tf.addfile(ti, io.BytesIO(data))
    secs = rng.uniform(20, 40, long_clips).tolist()
    blobs = [make_clip(s, 320, 240, 5000 + i) for i, s in enumerate(secs)]
    texts = [f"a long clip of {s:.0f} seconds. " * int(rng.integers(5, 30)) for s in secs]
    pq.write_table(pa.table({"mp4": blobs, "txt": texts}), os.path.join(dirs["long"], "part-0.parquet"))
    return dirs


def video_demo_job(dirs: dict[str, str]):
    """The demo's job: photos, pages, short clips, long clips and text in one mixture, two-stage cost, dp=2."""
    from msdata_client.graph import DGraph

    g = DGraph("demo-video", seed=1234)
    g.source("photos", "parquet", [dirs["photos"]], columns=["image", "caption"], transform=TRANSFORM + ")")
    g.source(
        "pages",
        "webdataset",
        [dirs["pages"]],
        columns=["png", "txt"],
        transform=TRANSFORM + ', image_key="png", text_key="txt")',
    )
    g.source("clips", "webdataset", [dirs["clips"]], columns=["mp4", "txt"], transform=VIDEO)
    g.source("long", "parquet", [dirs["long"]], columns=["mp4", "txt"], transform=VIDEO)
    g.source("text", "parquet", [dirs["text"]])
    weights = {"photos": 0.2, "pages": 0.15, "clips": 0.25, "long": 0.25, "text": 0.15}
    g.mix(weights).cost("vlm", alpha=1.0, beta=4096.0, alpha_v=1.0, beta_v=2048.0)
    return g.pack(4096, micro_batches=2).mesh(dp=2).prefetch(2).plan()


def _rank_main(job_dict: dict, endpoint: str, rank: int, world: int, steps: int, q) -> None:
    """A simulated trainer rank (separate process): checks and counts the video and image keys of every batch."""
    import torch

    import msdata_client as msd

    torch.set_num_threads(1)
    spec = msd.JobSpec.from_dict(job_dict)
    clips = frames = images = empty = 0
    t0 = time.perf_counter()
    with msd.DataClient(spec, endpoint=endpoint, rank=rank, world_size=world) as dc:
        for i in range(steps * spec.micro_batches):
            b = next(dc)
            grid, pv, cu = b["video_grid_thw"], b["pixel_values_videos"], b["video_cu_seqlens"]
            placeholders = int((b["tokens"] == spec.video_token_id).sum())
            per = torch.repeat_interleave(grid[:, 1] * grid[:, 2], grid[:, 0])
            if (
                pv.shape[0] != int(grid.prod(dim=1).sum())
                or placeholders != pv.shape[0] // MERGE**2
                or cu.tolist() != [0, *torch.cumsum(per, 0).tolist()]
            ):
                raise AssertionError(f"rank {rank} micro-batch {i}: video keys disagree with the placeholders")
            clips += grid.shape[0]
            frames += int(grid[:, 0].sum()) * 2
            images += b["image_grid_thw"].shape[0]
            empty += grid.shape[0] == 0
            del b
            if (i + 1) % spec.micro_batches == 0:
                q.put(("step", rank, (i + 1) // spec.micro_batches))
    stats = {"seconds": time.perf_counter() - t0, "clips": clips, "frames": frames, "images": images, "none": empty}
    q.put(("done", rank, stats))


def run_video_demo(steps: int = 20) -> int:
    try:
        import av  # noqa: F401
        import PIL  # noqa: F401
    except ImportError:
        raise ConfigError("demo --video needs PyAV and Pillow: pip install 'msdata[video,vlm]'") from None
    root = tempfile.mkdtemp(prefix="msdata-demo-video-")
    try:
        return _run(root, steps)
    finally:
        shutil.rmtree(root, ignore_errors=True)


def _run(root: str, steps: int) -> int:
    t0 = time.perf_counter()
    print(f"msdata demo --video: generating photos, pages, text, short and long clips under {root} ...", flush=True)
    spec = video_demo_job(make_video_dataset(os.path.join(root, "data")))
    sock = os.path.join(root, "msdata.sock")
    cfg = ServerConfig(
        node=NodeConfig(id="demo-video", socket=sock, workers=2, shm_prefix="msdvid", log_level="WARNING")
    )
    followed = serve_ranks(cfg, spec, _rank_main, steps, t0)
    if followed is None:
        return 1
    done, status = followed
    _summary(done, status)
    print(f"demo --video finished in {time.perf_counter() - t0:.1f}s", flush=True)
    return 0


def _summary(done: dict[int, dict], status: dict) -> None:
    job = (status.get("jobs") or [{}])[0]

    def fig(k: str) -> str:
        v = job.get(k)
        return "n/a" if v is None else f"{v:.3f}"

    def total(k: str) -> int:
        return sum(d[k] for d in done.values())

    bad = {n: s.get("bad_samples") for n, s in job.get("sources", {}).items() if s.get("bad_samples")}
    rows = [
        ("clips delivered (all ranks)", f"{total('clips')}"),
        ("frames delivered", f"{total('frames')}"),
        ("images delivered", f"{total('images')}"),
        ("micro-batches without clips", f"{total('none')}"),
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
