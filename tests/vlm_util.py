"""Pictures for the VLM and WebDataset tests: images painted the colour their caption names, Parquet files and
WebDataset shards of them, VLM jobs over those, a micro-batch cut back into its documents, and ranks that read
a job and the server's status."""

from __future__ import annotations

import io
import tarfile
import threading
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

import msdata_client as msd

from .e2e_util import status_json

Image = pytest.importorskip("PIL.Image")

PATCH, MERGE = 14, 2
IMG, EOS = 258, 256
VLM = f"msdata_server.transforms:vlm(patch={PATCH}, merge={MERGE}, min_pixels=3136, max_pixels=40000)"
WDS_VLM = VLM[:-1] + ', image_key="png;jpg", text_key="txt")'  # a WebDataset sample is a dict by extension
COLOURS = {
    "red": (220, 30, 30),
    "green": (30, 200, 60),
    "blue": (40, 60, 220),
    "yellow": (230, 220, 40),
    "white": (250, 250, 250),
    "black": (8, 8, 8),
}
NAMES = list(COLOURS)


def encode(colour: str, size: tuple[int, int] = (64, 48), fmt: str = "PNG") -> bytes:
    """An image of ``size`` painted ``colour`` (a name in COLOURS), encoded as ``fmt``."""
    buf = io.BytesIO()
    Image.new("RGB", size, COLOURS[colour]).save(buf, fmt, **({"quality": 95} if fmt == "JPEG" else {}))
    return buf.getvalue()


def pictures(tag: str, n: int, fmt: str, seed: int) -> list[tuple[bytes, str]]:
    """n (image, caption): each image painted the colour its caption names, of varied size."""
    rng = np.random.default_rng(seed)
    out = []
    for i in range(n):
        colour = NAMES[int(rng.integers(len(NAMES)))]
        size = (int(rng.integers(30, 260)), int(rng.integers(30, 200)))
        out.append((encode(colour, size, fmt), f"a {colour} picture {tag}-{i}"))
    return out


def write_parquet(d: Path, files: list[list[tuple[bytes, str]]]) -> dict[int, str]:
    d.mkdir()
    truth = {}
    for f, rows in enumerate(files):
        table = pa.table({"image": [b for b, _ in rows], "caption": [c for _, c in rows]})
        pq.write_table(table, d / f"part-{f}.parquet", row_group_size=8)
        truth.update({(f << 32) | r: c for r, (_, c) in enumerate(rows)})
    return truth


def write_shards(d: Path, shards: list[list[tuple[str, dict[str, bytes]]]]) -> None:
    d.mkdir()
    for k, samples in enumerate(shards):
        with tarfile.open(d / f"shard-{k:03d}.tar", "w") as tf:
            for key, parts in samples:
                for ext, data in parts.items():
                    ti = tarfile.TarInfo(f"{key}.{ext}")
                    ti.size = len(data)
                    tf.addfile(ti, io.BytesIO(data))


def picture_job(name: str, sources, *, dp=2, tp=1, cp=1, pp=1, micro=2, seq_len=512, weights=None):
    g = msd.DGraph(name, seed=11)
    for src, fmt, d, columns in sources:
        g.source(src, fmt, [str(d)], columns=columns, transform=WDS_VLM if fmt == "webdataset" else VLM)
    g.mix(weights or {s[0]: 1.0 for s in sources}).cost("vlm", alpha_v=1.0, beta_v=2048.0)
    g.pack(seq_len, micro_batches=micro).mesh(dp=dp, tp=tp, cp=cp, pp=pp).prefetch(2)
    return g.plan()


def documents(batch) -> list[dict]:
    """Each picture or text document of a micro-batch, in order: its tokens, sample id and images (checks
    that image keys and placeholders agree on the way)."""
    toks = np.asarray(batch["tokens"]).reshape(-1)
    cu = np.asarray(batch["cu_seqlens"])
    grid = np.asarray(batch["image_grid_thw"])
    pv = np.asarray(batch["pixel_values"])
    icu = np.asarray(batch["image_cu_seqlens"])
    isid = np.asarray(batch["image_sample_ids"])
    assert pv.dtype == np.uint8
    assert pv.shape[1] == 3 * PATCH * PATCH
    assert grid.dtype == np.int64
    assert grid.shape[1] == 3
    assert icu.dtype == np.int32
    assert isid.dtype == np.int64
    assert pv.shape[0] == int(grid.prod(axis=1).sum())  # pixel_values rows == sum over image_grid_thw
    assert icu.tolist() == [0, *np.cumsum(grid.prod(axis=1)).tolist()]
    segs = [toks[a:b] for a, b in zip(cu[:-1].tolist(), cu[1:].tolist())]
    segs = [s for s in segs if not (s == 257).all()]
    sids = np.asarray(batch["sample_ids"]).tolist()
    assert len(segs) == len(sids)
    out, k = [], 0
    for seg, sid in zip(segs, sids):
        n_ph = int(np.argmax(seg != IMG)) if (seg != IMG).any() else len(seg)  # a piece may be placeholders only
        imgs = []
        while n_ph and sum(int(g.prod()) // MERGE**2 for _, g in imgs) < n_ph:
            assert isid[k] == sid, "an image went to another document"
            imgs.append((pv[icu[k] : icu[k + 1]], grid[k]))
            k += 1
        assert sum(int(g.prod()) // MERGE**2 for _, g in imgs) == n_ph  # placeholders == t*h*w / merge^2
        out.append({"sid": int(sid), "tokens": seg, "images": imgs, "n_ph": n_ph})
    assert k == len(grid)
    return out


def check_colours(doc: dict, caption: str, tol: float) -> None:
    """The document's text is its caption and its image is painted the colour the caption names."""
    text = bytes(doc["tokens"][doc["n_ph"] : -1].astype(np.uint8)).decode()
    assert text == caption
    assert doc["tokens"][-1] == EOS
    (pixels, thw), want = doc["images"][0], np.array(COLOURS[caption.split()[1]], dtype=np.float64)
    assert thw[0] == 1
    assert pixels.shape[0] == int(thw.prod())
    got = pixels.reshape(-1, 3, PATCH * PATCH).astype(np.float64).mean(axis=(0, 2))
    assert np.abs(got - want).max() <= tol, (caption, got)
    h, w = int(thw[1]) * PATCH, int(thw[2]) * PATCH
    assert h % (PATCH * MERGE) == 0
    assert w % (PATCH * MERGE) == 0
    assert 3136 <= h * w <= 40000


def read_with_status(spec, endpoint: str, n: int) -> tuple[dict[int, list], dict]:
    """Every rank reads n micro-batches (round robin, after a start from all at once), kept as numpy copies
    (a batch held keeps its ring slot); then the server's status while the ranks are still there."""
    world = spec.mesh.world_size
    clients = [
        msd.DataClient(spec, endpoint=endpoint, rank=r, world_size=world, connect_timeout=60) for r in range(world)
    ]
    got: dict[int, list] = {r: [] for r in range(world)}
    try:
        threads = [
            threading.Thread(target=lambda r=r: got[r].append(_copy(next(clients[r]))), daemon=True)
            for r in range(world)
        ]
        for t in threads:
            t.start()
        for t in threads:
            t.join(60)
        assert all(got.values()), "the job did not start"
        for _ in range(n - 1):
            for r, dc in enumerate(clients):
                got[r].append(_copy(next(dc)))
        return got, status(endpoint)
    finally:
        for dc in clients:
            dc.close()


def _copy(batch) -> dict[str, np.ndarray]:
    return {k: v.numpy().copy() for k, v in batch.items()}


status = status_json  # the one status helper (e2e_util)


def spec(path, name="wds", **kw):
    """A WebDataset source's spec as the loader reads it (the fields of a DGraph source), over ``path``."""
    base = dict(
        name=name,
        format="webdataset",
        paths=(str(path),),
        column="text",
        columns=None,
        max_sample_bytes=64 << 20,
        transform=None,
    )
    base.update(kw)
    return SimpleNamespace(**base)


def colour_of(pixels: np.ndarray, patch: int = 14) -> np.ndarray:
    """Mean colour per patch, [n, 3] (a patch row is channel, row, column)."""
    return pixels.reshape(len(pixels), 3, patch * patch).mean(axis=2)
