"""Clips for the video tests, made with PyAV (libx264 is in its wheels): every frame shows its own index as eight
horizontal bands (bit b of the index: band b bright or dark), so which frames a sample holds, in which order,
can be read back exactly from its patches (``frames_of`` undoes the Qwen2-VL patch order)."""

from __future__ import annotations

import io
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

import msdata_client as msd

av = pytest.importorskip("av")

PATCH, MERGE, TP = 14, 2, 2
VIDEO_TOKEN = 259
DARK, BRIGHT = 30, 225


def index_frame(i: int, height: int, width: int) -> np.ndarray:
    """uint8 [height, width, 3]: frame i's index in eight bands (least significant bit at the top)."""
    a = np.full((height, width, 3), DARK, np.uint8)
    for b in range(8):
        if (i >> b) & 1:
            a[b * height // 8 : (b + 1) * height // 8] = BRIGHT
    return a


def make_clip(
    n: int,
    *,
    width: int = 224,
    height: int = 224,
    rate: int | float = 10,
    container: str = "mp4",
    codec: str = "libx264",
    pix_fmt: str = "yuv420p",
    rotation: int = 0,
    gop: int | None = None,
    content=index_frame,
) -> bytes:
    """An encoded clip of n frames (frame i = ``content(i, height, width)``) at ``rate`` frames per second."""
    buf = io.BytesIO()
    with av.open(buf, "w", format=container) as c:
        s = c.add_stream(codec, rate=rate)
        s.width, s.height, s.pix_fmt = width, height, pix_fmt
        if codec == "libx264":
            s.options = {"preset": "ultrafast", "crf": "18"}
        if gop is not None:
            s.codec_context.gop_size = gop
        if rotation:
            s.set_display_rotation(rotation)
        for i in range(n):
            frame = av.VideoFrame.from_ndarray(content(i, height, width), format="rgb24")
            for p in s.encode(frame):
                c.mux(p)
        for p in s.encode():
            c.mux(p)
    return buf.getvalue()


def frames_of(values: np.ndarray, grid, *, patch: int = PATCH, merge: int = MERGE, tp: int = TP) -> np.ndarray:
    """uint8 [t * tp, h * patch, w * patch, 3]: a clip's frames back from its pixel_values_videos rows."""
    t, h, w = (int(x) for x in grid)
    v = values.reshape(t, h // merge, w // merge, merge, merge, 3, tp, patch, patch)
    # (t, bh, bw, mh, mw, c, f, ph, pw) -> (t, f, bh, mh, ph, bw, mw, pw, c)
    return v.transpose(0, 6, 1, 3, 7, 2, 4, 8, 5).reshape(t * tp, h * patch, w * patch, 3)


def index_of(frame: np.ndarray) -> int:
    """The index a frame shows (index_frame), read from the brightness of its eight bands."""
    h = frame.shape[0]
    return sum(1 << b for b in range(8) if frame[b * h // 8 : (b + 1) * h // 8].mean() > (DARK + BRIGHT) / 2)


def indices_of(values: np.ndarray, grids) -> list[list[int]]:
    """The frame indices each clip of pixel_values_videos holds, clip by clip."""
    out, at = [], 0
    for g in np.asarray(grids).reshape(-1, 3):
        n = int(np.prod(g))
        out.append([index_of(f) for f in frames_of(values[at : at + n], g)])
        at += n
    return out


CLIP_SIDE = 112  # 8 x 8 patches a frame: 16 placeholders a temporal patch
VIDEO_VLM = (
    f'msdata_server.transforms:vlm(patch={PATCH}, merge={MERGE}, min_pixels=3136, max_pixels=40000, video_key="mp4", '
    f'text_key="txt", video_min_pixels=3136, video_max_pixels={CLIP_SIDE * CLIP_SIDE})'
)


def caption(k: int, n: int, rate: int) -> str:
    """A clip's text: which clip, how many frames at what rate (so a test knows which frames it must hold)."""
    return f"clip {k} of {n} frames at {rate}"


def expected_frames(text: str, *, fps: float = 2.0, min_frames: int = 4, max_frames: int = 768) -> list[int]:
    """The frame indices the sampling rule takes from the clip a caption describes."""
    from msdata_server.video import frame_count, sample_indices

    words = text.split()
    n, rate = int(words[3]), int(words[6])
    nf = frame_count(n / rate, n, fps=fps, min_frames=min_frames, max_frames=max_frames, temporal_patch=TP)
    return sample_indices(n, nf).tolist()


def clip_samples(tag: str, count: int, seed: int, *, rate: int = 10) -> list[tuple[bytes, str]]:
    """count (clip, caption) of 4 to 40 frames at ``rate`` fps, CLIP_SIDE square."""
    rng = np.random.default_rng(seed)
    out = []
    for k in range(count):
        n = int(rng.integers(4, 41))
        out.append((make_clip(n, width=CLIP_SIDE, height=CLIP_SIDE, rate=rate), caption(k, n, rate) + f" {tag}"))
    return out


def video_documents(batch, *, image_token: int = 258) -> list[dict]:
    """Each document of a micro-batch (full rows): its tokens, sample id, and clips with their frame indices;
    checks on the way that the video keys agree with the placeholders, in order, clip by clip."""
    toks = np.asarray(batch["tokens"]).reshape(-1)
    cu = np.asarray(batch["cu_seqlens"])
    pv = np.asarray(batch["pixel_values_videos"])
    grid = np.asarray(batch["video_grid_thw"])
    vcu = np.asarray(batch["video_cu_seqlens"])
    vsid = np.asarray(batch["video_sample_ids"])
    assert pv.dtype == np.uint8
    assert pv.shape[1] == 3 * TP * PATCH * PATCH
    assert grid.dtype == np.int64
    assert grid.shape[1] == 3
    assert vcu.dtype == np.int32
    assert vsid.dtype == np.int64
    assert pv.shape[0] == int(grid.prod(axis=1).sum())
    blocks = np.repeat(grid[:, 1] * grid[:, 2], grid[:, 0])  # every temporal patch's rows
    assert vcu.tolist() == [0, *np.cumsum(blocks).tolist()]
    segs = [toks[a:b] for a, b in zip(cu[:-1].tolist(), cu[1:].tolist())]
    segs = [s for s in segs if not (s == 257).all()]
    sids = np.asarray(batch["sample_ids"]).tolist()
    assert len(segs) == len(sids)
    out, k, at = [], 0, 0
    for seg, sid in zip(segs, sids):
        n_img = int(np.argmax(seg != image_token)) if (seg != image_token).any() else len(seg)
        rest = seg[n_img:]
        n_vid = int(np.argmax(rest != VIDEO_TOKEN)) if (rest != VIDEO_TOKEN).any() else len(rest)
        clips = []
        while n_vid and sum(int(np.prod(g)) // MERGE**2 for _, g in clips) < n_vid:
            assert vsid[k] == sid, "a clip went to another document"
            rows = int(np.prod(grid[k]))
            clips.append((pv[at : at + rows], grid[k]))
            at, k = at + rows, k + 1
        assert sum(int(np.prod(g)) // MERGE**2 for _, g in clips) == n_vid
        frames = [[index_of(f) for f in frames_of(v, g)] for v, g in clips]
        out.append({"sid": int(sid), "tokens": seg, "n_img": n_img, "n_vid": n_vid, "clips": clips, "frames": frames})
    assert k == len(grid)
    assert at == pv.shape[0]
    return out


def write_mixed(root: Path) -> None:
    """Four sources under root: clips in WebDataset shards (one clip broken), clips in a Parquet binary column,
    pictures in Parquet (captions), plain text."""
    from .vlm_util import pictures, write_parquet, write_shards

    shards = []
    for s in range(2):
        samples = clip_samples(f"w{s}", 6, s)
        shards.append([(f"s{s}/{i:04d}", {"mp4": c, "txt": t.encode()}) for i, (c, t) in enumerate(samples)])
    shards[1][2] = (shards[1][2][0], {"mp4": b"\x00\x00\x00\x18ftypmp42" + b"broken" * 40, "txt": b"clip broken"})
    write_shards(root / "wds", shards)
    (root / "pqv").mkdir()
    rows = clip_samples("p", 8, 7)
    pq.write_table(pa.table({"mp4": [c for c, _ in rows], "txt": [t for _, t in rows]}), root / "pqv" / "a.parquet")
    write_parquet(root / "pics", [pictures("i", 10, "PNG", 3)])
    (root / "txt").mkdir()
    texts = [f"plain text {i} " * (1 + i % 7) for i in range(300)]
    pq.write_table(pa.table({"text": texts}), root / "txt" / "t.parquet")


def mixed_job(root: Path, name: str = "mixed", *, dp=2, cp=1, pp=1, tp=1, micro=2, seq_len=512):
    """A job over write_mixed's sources: clips, pictures and text in one mixture, cost "vlm"."""
    from .vlm_util import VLM

    g = msd.DGraph(name, seed=5)
    g.source("wds", "webdataset", [str(root / "wds")], columns=["mp4", "txt"], transform=VIDEO_VLM)
    g.source("pqv", "parquet", [str(root / "pqv")], columns=["mp4", "txt"], transform=VIDEO_VLM)
    g.source("pics", "parquet", [str(root / "pics")], columns=["image", "caption"], transform=VLM)
    g.source("txt", "parquet", [str(root / "txt")])
    g.mix({"wds": 0.3, "pqv": 0.3, "pics": 0.2, "txt": 0.2}).cost("vlm", alpha_v=1.0, beta_v=2048.0)
    return g.pack(seq_len, micro_batches=micro).mesh(dp=dp, cp=cp, pp=pp, tp=tp).prefetch(2).plan()
