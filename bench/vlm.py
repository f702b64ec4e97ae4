# .venv/bin/python bench/vlm.py --quick
"""VLM benchmark: two-stage balancing (cost "vlm") against per-rank arrival-order packing, and the vlm transform's rate.

Workload vlm4 (bench/workloads.py, a copy of ../shared/workloads.toml): image-caption and document-image
sources, one image per document with the resolutions given there (patches as Qwen2-VL's smart_resize
gives them, patch 14, merge 2: a document is its image's placeholders, then its text), plus two text
sources. A rank costs the vision encoder alpha_v*p^2 + beta_v*p per image of p patches and the backbone
alpha*L^2 + beta*L per document of L tokens; the stages synchronise separately, so a step takes as long
as the slowest rank's encoder plus the slowest rank's backbone, and throughput = useful tokens / that.
Baseline (msdata_server.planner.baseline, as bench/balance.py): every DP rank draws from the mixture
with its own RNG and packs in arrival order. msdata: one Planner with cost = "vlm" for all ranks.
Reported per config: encoder and backbone imbalance (max / mean over ranks), padding, throughput gain,
the planner's compute per step; steady-state means after one warm-up step (plan ms: medians).

Then the real preprocessing rate: JPEGs generated here with Pillow (sizes drawn from the same
resolution distributions, caption and document images in their share of images), run through the
actual `msdata_server.transforms:vlm` transform in this one process (one worker): decode, resize,
patchify, tokenize. Warm-up (the first images) and steady state are reported apart.

Video (workload vlm_video: captions, document images, short clips, a heavy tail of long clips, web text;
metadata only, seq_len 16384, max_frames 224 so one clip fits): the same two-stage planner against the
same per-rank baseline, where a clip of t temporal patches of h x w patches costs the encoder
alpha_v * t * (h*w)**2 + beta_v * t*h*w. Then real clips: a 1280x720 H.264 clip at 30 fps generated
once per run into a temp dir (2 minutes; --smoke: 6 seconds at 640x360), decoded by the vlm transform
at 2 fps (frames per second per worker, against decoding every frame), and the peak memory of a fresh
process while it decodes that clip beside the pixel bytes of the sample it produced. The last line is
one JSON object.
"""

from __future__ import annotations

import argparse
import io
import json
import os
import statistics
import sys
import time

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from progress import say, track
from workloads import (
    VLM4,
    VLM_VIDEO,
    ImageDist,
    SyntheticVideo,
    SyntheticVlm,
    VlmWorkload,
    doc_moments,
    image_sizes,
    vlm_docs,
)

from msdata_server.planner import Mixture, Planner, PlannerConfig
from msdata_server.planner.baseline import per_rank_steps
from msdata_server.planner.vlm_cost import VlmCost
from msdata_server.transforms import load_transform, smart_resize

MICRO, ROWS = 4, 1  # per DP rank per step, as bench/balance.py
COST = VlmCost(**VLM4.cost)
TRANSFORM = (
    f"msdata_server.transforms:vlm(patch={VLM4.patch}, merge={VLM4.merge}, "
    f"min_pixels={VLM4.min_pixels}, max_pixels={VLM4.max_pixels})"
)


def mean_lengths(seq_len: int, seed: int, wl: VlmWorkload = VLM4) -> dict[str, float]:
    rng = np.random.default_rng(seed)
    n = 20000 if wl is VLM4 else 4000
    return {name: float(doc_moments(wl, name, n, seq_len, rng)[0].mean()) for name in wl.sources}


def baseline(seq_len: int, dp: int, steps: int, seed: int, wl: VlmWorkload = VLM4) -> list[dict]:
    """Per-rank loaders, each rank's documents with their images' (or clips' temporal patches') patches (a
    document's encoder cost goes with its first piece)."""
    names = list(wl.sources)

    def draw(source: int, n: int, rng: np.random.Generator) -> np.ndarray:
        return doc_moments(wl, names[source], n, seq_len, rng)

    rows = per_rank_steps(
        draw,
        wl.weights,
        mean_lengths(seq_len, seed, wl),
        seq_len=seq_len,
        dp=dp,
        micro_batches=MICRO,
        rows=ROWS,
        steps=steps,
        seed=seed,
        vlm=COST,
    )
    for r in rows:
        r["time"] = r["max_backbone"] + r["max_encoder"]
    return rows


def msdata(seq_len: int, dp: int, steps: int, seed: int, tolerance: float | None, wl: VlmWorkload = VLM4) -> list[dict]:
    cfg = PlannerConfig(
        sources=tuple(wl.sources),
        seq_len=seq_len,
        dp=dp,
        micro_batches=MICRO,
        rows=ROWS,
        cost="vlm",
        balance_tolerance=tolerance,
        mixture=Mixture.constant(wl.weights),
        alpha=COST.alpha,
        beta=COST.beta,
        alpha_v=COST.alpha_v,
        beta_v=COST.beta_v,
    )
    view = SyntheticVlm(wl, seq_len, seed=seed) if wl is VLM4 else SyntheticVideo(wl, seq_len, seed=seed)
    planner = Planner(cfg)
    out = []
    for _ in range(steps):
        plan = planner.plan_step(view)
        s = plan.stats
        assert s.stage_cost is not None  # cost = "vlm"
        backbone, encoder = s.stage_cost
        out.append(
            {
                "encoder_imbalance": s.encoder_imbalance,
                "backbone_imbalance": s.backbone_imbalance,
                "padding": s.padding_fraction,
                "tokens": int(plan.length.sum()),
                "time": float(backbone.max() + encoder.max()),
                "even": float(backbone.mean() + encoder.mean()),  # the step's time were both stages even
                "plan_ms": s.plan_ms,
                "ingest_ms": s.ingest_ms,
                "docs": s.docs,
                "state_bytes": len(json.dumps(planner.state_dict())),
            }
        )
    return out


def throughput(rows: list[dict]) -> float:
    """Useful tokens per unit of simulated time (per step: slowest encoder + slowest backbone)."""
    return sum(r["tokens"] for r in rows) / sum(r["time"] for r in rows)


def mean(rows: list[dict], key: str) -> float:
    return statistics.mean(r[key] for r in rows)


# -- the real preprocessing rate -------------------------------------------------------------------------


def make_jpegs(n: int, seed: int) -> tuple[list[dict], np.ndarray]:
    """n image-caption records (JPEG bytes, caption) and the patches smart_resize predicts for each."""
    from PIL import Image

    rng = np.random.default_rng([seed, 7])
    pics = {name: d for name, d in VLM4.sources.items() if isinstance(d, ImageDist)}
    # each image source's share of images: its share of tokens over its mean document length
    mean_len = {name: float(vlm_docs(VLM4, name, 4000, max(VLM4.seq_lens), rng)[0].mean()) for name in pics}
    share = np.array([VLM4.weights[name] / mean_len[name] for name in pics])
    which = rng.choice(len(pics), size=n, p=share / share.sum())
    records, patches = [], np.zeros(n, np.int64)
    factor = VLM4.patch * VLM4.merge
    for i, k in enumerate(which.tolist()):
        dist = list(pics.values())[k]
        h, w = (int(x[0]) for x in image_sizes(dist, 1, rng))
        # a smooth random field with some grain: compresses like a photograph, not like noise or a flat colour
        small = rng.integers(0, 256, (max(2, h // 64), max(2, w // 64), 3), dtype=np.uint8)
        img = Image.fromarray(small).resize((w, h), Image.Resampling.BILINEAR)
        grain = rng.integers(-12, 13, (h, w, 3), dtype=np.int16)
        arr = np.clip(np.asarray(img, np.int16) + grain, 0, 255).astype(np.uint8)
        buf = io.BytesIO()
        Image.fromarray(arr).save(buf, format="JPEG", quality=90)
        words = int(max(4, rng.lognormal(np.log(dist.text_median), dist.text_sigma)))
        records.append({"image": buf.getvalue(), "caption": "a picture " * (words // 10 + 1)})
        th, tw = smart_resize(h, w, factor=factor, min_pixels=VLM4.min_pixels, max_pixels=VLM4.max_pixels)
        patches[i] = (th // VLM4.patch) * (tw // VLM4.patch)
    return records, patches


def preprocessing_rate(n: int, seed: int) -> dict:
    """Images per second through the vlm transform in this process; warm-up (first 10%) apart."""
    t = time.perf_counter()
    records, predicted = make_jpegs(n, seed)
    gen_s = time.perf_counter() - t
    fn = load_transform(TRANSFORM)  # as a worker loads it; called per record as a worker calls it
    warm = max(1, n // 10)
    t0 = time.perf_counter()
    first = [fn(r, rng=None) for r in records[:warm]]
    t1 = time.perf_counter()
    rest = [fn(r, rng=None) for r in records[warm:]]
    t2 = time.perf_counter()
    out = first + rest
    got = np.array([int(np.prod(s.image_grid_thw, axis=1).sum()) for s in out])
    if not np.array_equal(got, predicted):  # the bench's patch counts are the transform's
        raise SystemExit(f"patches differ from smart_resize's prediction for {int((got != predicted).sum())} images")
    mpix = sum(s.pixel_values.shape[0] for s in out[warm:]) * VLM4.patch**2 / 1e6
    return {
        "images": n,
        "generate_s": gen_s,
        "warmup_images_per_s": warm / (t1 - t0),
        "images_per_s_per_worker": (n - warm) / (t2 - t1),
        "megapixels_per_s_per_worker": mpix / (t2 - t1),
        "jpeg_kb_mean": statistics.mean(len(r["image"]) for r in records) / 1e3,
        "patches_mean": float(predicted.mean()),
    }


# -- video ------------------------------------------------------------------------------------------------


def video_planner(dps: list[int], steps: int, seed: int, tolerance: float | None) -> dict[str, float]:
    """The vlm_video workload at 16k through the planner and the per-rank baseline: per dp, both stages'
    imbalance and the throughput gain."""
    seq_len, out = 16384, {}
    say(
        f"\nvlm_video at seq_len {seq_len}: {steps} measured steps after 1 warm-up; bound: the gain if the "
        f"baseline's own documents were spread perfectly evenly in both stages at its padding; own: the gain if "
        f"msdata's placed pieces were (no plan of them beats it)"
    )
    head = f"{'dp':>5} | {'enc imb':>7} {'bb imb':>7} {'pad':>6} {'gain':>5} {'plan ms':>8} | "
    head += f"{'base enc':>8} {'base bb':>8} {'bound':>6} {'own':>6}"
    say(head)
    say("-" * len(head))
    for dp in dps:
        base = baseline(seq_len, dp, steps + 1, seed, VLM_VIDEO)[1:]
        rows = msdata(seq_len, dp, steps + 1, seed, tolerance, VLM_VIDEO)[1:]
        gain = throughput(rows) / throughput(base)
        enc, bb = mean(rows, "encoder_imbalance"), mean(rows, "backbone_imbalance")
        plan_ms = statistics.median(r["plan_ms"] for r in rows)
        say(
            f"{dp:>5} | {enc:7.4f} {bb:7.4f} {mean(rows, 'padding'):6.4f} {gain:5.2f} {plan_ms:8.1f} | "
            f"{mean(base, 'encoder_imbalance'):8.4f} {mean(base, 'backbone_imbalance'):8.4f} {gain_bound(base):6.2f} "
            f"{own_bound(rows) / throughput(base):6.2f}"
        )
        tag = f"16k_dp{dp}"
        out[f"video_encoder_imbalance_{tag}"] = round(enc, 4)
        out[f"video_backbone_imbalance_{tag}"] = round(bb, 4)
        out[f"gain_video_{tag}"] = round(gain, 3)
        out[f"video_padding_{tag}"] = round(mean(rows, "padding"), 4)
        out[f"video_plan_ms_{tag}"] = round(plan_ms, 1)
        out[f"video_baseline_encoder_imbalance_{tag}"] = round(mean(base, "encoder_imbalance"), 4)
        out[f"video_baseline_backbone_imbalance_{tag}"] = round(mean(base, "backbone_imbalance"), 4)
        out[f"video_gain_bound_{tag}"] = round(gain_bound(base), 3)
        out[f"gain_bound_video_{tag}"] = round(own_bound(rows) / throughput(base), 3)
    return out


def own_bound(rows: list[dict]) -> float:
    """msdata's throughput were each step's placed pieces spread perfectly evenly in both stages: a step takes at
    least its mean encoder load plus its mean backbone load (max >= mean), so no plan of these pieces beats it;
    over this bound the baseline's throughput, `gain_bound_video_*`, bounds `gain_video_*` (padding costs no
    time here, so this does not depend on padding)."""
    return sum(r["tokens"] for r in rows) / sum(r["even"] for r in rows)


def gain_bound(base: list[dict]) -> float:
    """The gain over the baseline if its own documents, at its own padding, were spread perfectly evenly in
    both stages (each stage at its mean load): what balancing alone can win on this workload."""
    even = sum(r["max_backbone"] / r["backbone_imbalance"] + r["max_encoder"] / r["encoder_imbalance"] for r in base)
    return throughput(base) ** -1 * sum(r["tokens"] for r in base) / even


def write_clip(path: str, seconds: float, width: int, height: int, rate: int = 30) -> float:
    """An H.264 clip (ultrafast, crf 23) of moving gradients; the seconds it took to make."""
    import av

    t = time.perf_counter()
    x = np.arange(width, dtype=np.uint16)[None, :]
    y = np.arange(height, dtype=np.uint16)[:, None]
    frame = np.empty((height, width, 3), np.uint8)
    with av.open(path, "w", format="mp4") as c:
        s = c.add_stream("libx264", rate=rate)
        s.width, s.height, s.pix_fmt = width, height, "yuv420p"
        s.options = {"preset": "ultrafast", "crf": "23"}
        for i in range(int(seconds * rate)):
            frame[..., 0] = (x + 3 * i) & 255
            frame[..., 1] = (y + 2 * i) & 255
            frame[..., 2] = (x + y + i) & 255
            for p in s.encode(av.VideoFrame.from_ndarray(frame, format="rgb24")):
                c.mux(p)
        for p in s.encode():
            c.mux(p)
    return time.perf_counter() - t


VIDEO_TRANSFORM = 'msdata_server.transforms:vlm(video_key="mp4", text_key="txt", fps=2.0)'

_PEAK = """
import json, sys
from msdata_server.transforms import load_transform
fn = load_transform(sys.argv[2])
blob = open(sys.argv[1], "rb").read()
fn({"mp4": blob[:], "txt": b""}, rng=None)  # warm up: libraries loaded, allocator pools made
def status(key):
    return [int(l.split()[1]) * 1024 for l in open("/proc/self/status") if l.startswith(key)][0]
open("/proc/self/clear_refs", "w").write("5")  # the peak (VmHWM) starts again from now
base = status("VmRSS")
s = fn({"mp4": blob, "txt": b""}, rng=None)
print(json.dumps({"peak": status("VmHWM") - base, "sample": s.pixel_values_videos.nbytes}))
"""


def video_decode(smoke: bool) -> dict[str, float]:
    """Real clips through the vlm transform: sampled frames per second per worker against decoding every frame,
    and a fresh process's peak memory while decoding the long clip beside its sample's pixel bytes."""
    import subprocess
    import tempfile

    import av

    seconds, (w, h) = (6.0, (640, 360)) if smoke else (120.0, (1280, 720))
    with tempfile.TemporaryDirectory(prefix="msd-bench-video-") as d:
        path = os.path.join(d, "clip.mp4")
        gen_s = write_clip(path, seconds, w, h)
        with open(path, "rb") as fh:
            blob = fh.read()
        fn = load_transform(VIDEO_TRANSFORM)
        fn({"mp4": make_small_clip(), "txt": b""}, rng=None)  # warm-up: PyAV and its codecs loaded
        t = time.perf_counter()
        sample = fn({"mp4": blob, "txt": b""}, rng=None)
        sampled_s = time.perf_counter() - t
        frames = int(sample.video_grid_thw[0, 0]) * 2
        t = time.perf_counter()
        with av.open(io.BytesIO(blob)) as c:
            c.streams.video[0].codec_context.thread_count = 1
            every = sum(1 for _ in c.decode(video=0))
        every_s = time.perf_counter() - t
        root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
        env = {**os.environ, "PYTHONPATH": root}
        got = subprocess.run(
            [sys.executable, "-c", _PEAK, path, VIDEO_TRANSFORM], capture_output=True, text=True, env=env, check=True
        )
        mem = json.loads(got.stdout.strip().splitlines()[-1])
    out = {
        "video_frames_per_s_per_worker": round(frames / sampled_s, 1),
        "video_decode_every_frame_per_s": round(every / every_s, 1),
        "video_sampled_frames_per_s_if_decoding_every_frame": round(frames / every_s, 1),
        "video_worker_peak_mib": round(mem["peak"] / 2**20, 1),
        "video_sample_pixel_mib": round(mem["sample"] / 2**20, 1),
        "video_clip_seconds": seconds,
        "video_clip_generate_s": round(gen_s, 1),
    }
    say(
        f"\nvideo: a {seconds:.0f} s {w}x{h} H.264 clip at 30 fps ({len(blob) / 1e6:.1f} MB, made in {gen_s:.1f} s): "
        f"{frames} frames sampled at 2 fps, grid {sample.video_grid_thw[0].tolist()}, in {sampled_s:.2f} s = "
        f"{out['video_frames_per_s_per_worker']} sampled frames/s per worker; decoding every frame ({every}) "
        f"takes {every_s:.2f} s ({out['video_decode_every_frame_per_s']} frames/s, so "
        f"{out['video_sampled_frames_per_s_if_decoding_every_frame']} sampled frames/s before any resizing); "
        f"peak memory while decoding {out['video_worker_peak_mib']} MiB beside {out['video_sample_pixel_mib']} MiB "
        f"of sample pixels (target <= 2 x that + 64)"
    )
    return out


def make_small_clip() -> bytes:
    import av

    buf = io.BytesIO()
    with av.open(buf, "w", format="mp4") as c:
        s = c.add_stream("libx264", rate=10)
        s.width = s.height = 64
        s.pix_fmt = "yuv420p"
        for i in range(4):
            for p in s.encode(av.VideoFrame.from_ndarray(np.full((64, 64, 3), i * 40, np.uint8), format="rgb24")):
                c.mux(p)
        for p in s.encode():
            c.mux(p)
    return buf.getvalue()


def main() -> None:
    global MICRO, ROWS
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="fewer steps and images (under two minutes)")
    ap.add_argument("--smoke", action="store_true", help="seconds: one small config of each part, a short clip")
    ap.add_argument("--video-dp", default="8,64,512", help="comma list of DP sizes for the vlm_video planner part")
    ap.add_argument("--steps", type=int, default=None, help="measured steps per config (after one warm-up)")
    ap.add_argument("--dp", default="8,64,512", help="comma list of DP sizes")
    ap.add_argument("--seq-lens", default=None, help="comma list (default: the workload's 8192,16384)")
    ap.add_argument("--tolerance", default="0.01", help="balance_tolerance, or 'none'")
    ap.add_argument("--images", type=int, default=None, help="JPEGs through the transform (default 150, quick 80)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--micro", type=int, default=MICRO, help="micro-batches per rank per step")
    ap.add_argument("--rows", type=int, default=ROWS, help="rows per micro-batch")
    args = ap.parse_args()
    if args.smoke:
        args.steps, args.dp, args.images, args.micro, args.rows = 1, "8", 10, 2, 1
        args.seq_lens = args.seq_lens or str(min(VLM4.seq_lens))
    MICRO, ROWS = args.micro, args.rows
    steps = args.steps or (1 if args.smoke else 3 if args.quick else 10)
    images = args.images or (10 if args.smoke else 80 if args.quick else 300)
    dps = [8] if args.smoke else [int(x) for x in args.dp.split(",")]
    seq_lens = (
        [8192] if args.smoke else [int(x) for x in (args.seq_lens or ",".join(map(str, VLM4.seq_lens))).split(",")]
    )
    tolerance = None if args.tolerance == "none" else float(args.tolerance)

    say(
        f"vlm4, micro_batches={MICRO}, rows={ROWS}, cost {VLM4.cost}, balance_tolerance={tolerance}, "
        f"{steps} measured steps after 1 warm-up; means (plan ms: median); gain = throughput / baseline's, "
        f"a step = slowest encoder + slowest backbone"
    )
    head = (
        f"{'seq_len':>7} {'dp':>5} | {'enc imb':>7} {'bb imb':>7} {'pad':>6} {'gain':>5} {'plan ms':>8} "
        f"{'warm ms':>8} {'docs':>7} {'state kB':>8} | {'base enc':>8} {'base bb':>8} {'base pad':>8}"
    )
    say(head)
    say("-" * len(head))
    results: dict[str, float] = {}
    for seq_len, dp in track([(s, d) for s in seq_lens for d in dps], "vlm configs", unit="config"):
        base = baseline(seq_len, dp, steps + 1, args.seed)[1:]
        rows = msdata(seq_len, dp, steps + 1, args.seed, tolerance)
        warm, rows = rows[0], rows[1:]
        gain = throughput(rows) / throughput(base)
        plan_ms = statistics.median(r["plan_ms"] for r in rows)
        say(
            f"{seq_len:>7} {dp:>5} | {mean(rows, 'encoder_imbalance'):7.4f} "
            f"{mean(rows, 'backbone_imbalance'):7.4f} {mean(rows, 'padding'):6.4f} {gain:5.2f} {plan_ms:8.1f} "
            f"{warm['plan_ms']:8.1f} {int(mean(rows, 'docs')):>7} "
            f"{max(r['state_bytes'] for r in rows) / 1e3:8.1f} | {mean(base, 'encoder_imbalance'):8.4f} "
            f"{mean(base, 'backbone_imbalance'):8.4f} {mean(base, 'padding'):8.4f}"
        )
        tag = f"{seq_len // 1024}k_dp{dp}"
        results[f"gain_vlm_{tag}"] = round(gain, 3)
        results[f"encoder_imbalance_{tag}"] = round(mean(rows, "encoder_imbalance"), 4)
        results[f"backbone_imbalance_{tag}"] = round(mean(rows, "backbone_imbalance"), 4)
        results[f"worst_stage_imbalance_{tag}"] = round(
            max(max(r["encoder_imbalance"], r["backbone_imbalance"]) for r in rows), 4
        )
        results[f"padding_{tag}"] = round(mean(rows, "padding"), 4)
        results[f"plan_ms_{tag}"] = round(plan_ms, 1)
        results[f"baseline_encoder_imbalance_{tag}"] = round(mean(base, "encoder_imbalance"), 4)
        results[f"baseline_backbone_imbalance_{tag}"] = round(mean(base, "backbone_imbalance"), 4)
        results[f"baseline_padding_{tag}"] = round(mean(base, "padding"), 4)
    rate = preprocessing_rate(images, args.seed)
    say(
        f"\nvlm transform, one process: {rate['images']} generated JPEGs (mean {rate['jpeg_kb_mean']:.0f} kB, "
        f"{rate['patches_mean']:.0f} patches; generated in {rate['generate_s']:.1f} s): warm-up "
        f"{rate['warmup_images_per_s']:.1f} images/s, steady {rate['images_per_s_per_worker']:.1f} images/s "
        f"({rate['megapixels_per_s_per_worker']:.1f} Mpixel/s of patches) per worker"
    )
    results["images_per_s_per_worker"] = round(rate["images_per_s_per_worker"], 1)
    results["images_per_s_warmup"] = round(rate["warmup_images_per_s"], 1)
    results["megapixels_per_s_per_worker"] = round(rate["megapixels_per_s_per_worker"], 2)
    video_dps = [8] if args.smoke else [int(x) for x in args.video_dp.split(",")]
    results.update(video_planner(video_dps, 1 if args.smoke else steps, args.seed, tolerance))
    results.update(video_decode(args.smoke))
    say(json.dumps(results, sort_keys=True))


if __name__ == "__main__":
    main()
