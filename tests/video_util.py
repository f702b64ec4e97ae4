"""Clips for the video tests, made with PyAV (libx264 is in its wheels): every frame shows its own index as eight
horizontal bands (bit b of the index: band b bright or dark), so which frames a sample holds, in which order,
can be read back exactly from its patches (``frames_of`` undoes the Qwen2-VL patch order)."""

from __future__ import annotations

import io

import numpy as np
import pytest

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
