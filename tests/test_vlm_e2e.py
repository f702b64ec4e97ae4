"""Picture documents end to end through a real `msdata-server serve`: Parquet (an image column and a caption
column) and WebDataset tar shards written here as PNG and JPEG, the vlm transform in the worker pool, the
two-stage "vlm" cost, and the image batch keys the ranks receive."""

from __future__ import annotations

from collections import Counter

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

import msdata_client as msd

from .e2e_util import run_ranks
from .vlm_util import (
    PATCH,
    VLM,
    check_colours,
    documents,
    encode,
    picture_job,
    pictures,
    read_with_status,
    write_parquet,
    write_shards,
)

Image = pytest.importorskip("PIL.Image")


@pytest.fixture
def parquet_and_shards(tmp_path):
    """A Parquet source (PNG and JPEG files) and a WebDataset source (PNG and JPEG shards) whose bad samples
    are one corrupt image, one sample without its image, and a shard cut in the middle."""
    pq_truth = write_parquet(tmp_path / "pq", [pictures("p0", 14, "PNG", 1), pictures("p1", 12, "JPEG", 2)])
    shards, wds_truth = [], {}
    for k, fmt in enumerate(("PNG", "JPEG", "PNG")):
        samples = []
        for i, (img, cap) in enumerate(pictures(f"w{k}", 10, fmt, 10 + k)):
            ext = "png" if fmt == "PNG" else "jpg"
            samples.append((f"s{k}/{i:04d}", {ext: img, "txt": cap.encode()}))
            wds_truth[(k << 32) | i] = cap
        shards.append(samples)
    shards[0][3] = (shards[0][3][0], {"png": b"\x89PNG\r\n\x1a\n" + b"not an image" * 20, "txt": b"a red corrupt"})
    shards[1][5] = (shards[1][5][0], {"txt": b"a blue picture without its image"})
    del wds_truth[0 << 32 | 3], wds_truth[1 << 32 | 5]
    write_shards(tmp_path / "wds", shards)
    cut = tmp_path / "wds" / "shard-002.tar"
    data = cut.read_bytes()
    cut.write_bytes(data[: len(data) * 6 // 10])  # the samples the cut touches are bad, those before it fine
    return tmp_path, pq_truth, wds_truth


def test_both_formats_deliver_each_image_with_its_caption(server_factory, parquet_and_shards):
    root, pq_truth, wds_truth = parquet_and_shards
    spec = picture_job(
        "pictures",
        [("pq", "parquet", root / "pq", ["image", "caption"]), ("wds", "webdataset", root / "wds", ["png;jpg", "txt"])],
    )
    srv = server_factory(workers=2).start()
    got, st = read_with_status(spec, srv.socket, 14)
    seen: Counter = Counter()
    for batches in got.values():
        for b in batches:
            for doc, src in zip(documents(b), b["source_ids"].tolist()):  # (numpy copies)
                truth = pq_truth if src == 0 else wds_truth
                assert doc["sid"] in truth, f"a bad or unknown sample was delivered: {src} {doc['sid']:#x}"
                check_colours(doc, truth[doc["sid"]], tol=3.0 if src == 0 and doc["sid"] >> 32 == 0 else 12.0)
                seen[src] += 1
    assert seen[0] >= 20
    assert seen[1] >= 15
    (job,) = st["jobs"]
    bad = job["sources"]["wds"]["bad_samples"]
    # counted at every read (the small source goes round several epochs): the corrupt image and the samples
    # the cut shard loses are "corrupt", the sample without its image "missing_field"; none was delivered
    assert bad.get("corrupt", 0) >= 2
    assert bad.get("missing_field", 0) >= 1
    assert set(bad) <= {"corrupt", "missing_field"}
    assert not job["sources"]["pq"]["bad_samples"]
    assert job["encoder_imbalance"] >= 1.0
    assert job["backbone_imbalance"] >= 1.0
    assert job["last_step"]["encoder_imbalance"] is not None


def test_text_micro_batches_carry_empty_image_keys_and_pp_cp_rules(server_factory, tmp_path):
    """A picture source beside a text source, dp=1 x pp=2 x cp=2: both CP ranks of the first stage receive
    the full image keys (equal), the last stage none; a micro-batch without pictures has empty keys."""
    write_parquet(tmp_path / "pq", [pictures("p", 6, "PNG", 3)])
    (tmp_path / "txt").mkdir()
    texts = [f"plain text {i} " * (1 + i % 5) for i in range(200)]
    pq.write_table(pa.table({"text": texts}), tmp_path / "txt" / "t.parquet")
    g = msd.DGraph("mixed", seed=3)
    g.source("pq", "parquet", [str(tmp_path / "pq")], columns=["image", "caption"], transform=VLM)
    g.source("txt", "parquet", [str(tmp_path / "txt")])
    spec = g.mix({"pq": 0.05, "txt": 0.95}).cost("vlm").pack(256, micro_batches=4).mesh(dp=1, pp=2, cp=2).plan()
    srv = server_factory(workers=1).start()
    got = run_ranks(spec, srv.socket, 8, keep=True)[1]
    mesh = spec.mesh
    first = [r for r in range(mesh.world_size) if mesh.coord(r).pp == 0]
    last = [r for r in range(mesh.world_size) if mesh.coord(r).pp == 1]
    keys = ("pixel_values", "image_grid_thw", "image_cu_seqlens", "image_sample_ids")
    empty = 0
    for i in range(8):
        a, b = (got[r][i] for r in first)
        for k in keys:
            assert np.array_equal(a[k].numpy(), b[k].numpy())  # every CP rank: the micro-batch's full keys
        for r in last:
            assert not set(keys) & set(got[r][i])
        documents({**a, "tokens": _full_tokens(spec, [got[r][i] for r in first])})
        if a["image_grid_thw"].shape[0] == 0:
            empty += 1
            assert a["pixel_values"].shape == (0, 3 * PATCH * PATCH)
            assert a["image_cu_seqlens"].tolist() == [0]
            assert str(a["pixel_values"].dtype) == "torch.uint8"
            assert str(a["image_grid_thw"].dtype) == "torch.int64"
    assert empty >= 1


def _full_tokens(spec, parts):
    """The full rows of a micro-batch from its CP ranks' zig-zag slices."""
    import torch

    from msdata_server.batch import zigzag_index

    idx = zigzag_index(spec.seq_len, 2)
    full = torch.empty((spec.rows, spec.seq_len), dtype=parts[0]["tokens"].dtype)
    for c, p in enumerate(parts):
        full[:, torch.from_numpy(idx[c])] = p["tokens"]
    return full


def test_resume_reshard_and_tp_with_images(server_factory, tmp_path):
    """dp=2 x tp=2: TP pairs read one slot (identical bytes, pixels too); a resume on the same layout repeats
    the batches bit for bit, pixels included; a reshard onto dp=1 continues the order: every picture sample
    of the epoch arrives exactly once, with its own image."""
    truth = write_parquet(tmp_path / "pq", [pictures("a", 40, "PNG", 4), pictures("b", 36, "JPEG", 5)])
    spec = picture_job("resume", [("pq", "parquet", tmp_path / "pq", ["image", "caption"])], dp=2, tp=2, micro=1)
    srv = server_factory(workers=2).start()
    saved: dict = {}
    whole = run_ranks(spec, srv.socket, 6)
    first = run_ranks(spec, srv.socket, 3, saved=saved)
    mesh = spec.mesh
    for r in range(mesh.world_size):
        for q in mesh.readers(mesh.group_of(r)):
            assert whole[q] == whole[r]  # TP peers: the same slot, field by field (pixel_values hashed too)
        assert first[r] == whole[r][:3]
    rest = run_ranks(spec, srv.socket, 3, states={r: saved[r] for r in range(mesh.world_size)})
    for r in range(mesh.world_size):
        assert rest[r] == whole[r][3:]  # exact: every field's bytes
    # reshard: the state of step 3 into dp=1 (two micro-batches per step: the same tokens per step)
    one = picture_job("resume", [("pq", "parquet", tmp_path / "pq", ["image", "caption"])], dp=1, micro=2)
    assert one.data_digest() == spec.data_digest()
    _, early = run_ranks(spec, srv.socket, 3, keep=True)
    after: dict = {}
    _, late = run_ranks(one, srv.socket, 14, states={0: saved[0]}, saved=after, keep=True)
    counts: Counter = Counter()
    dp_ranks = [r for r in range(mesh.world_size) if mesh.coord(r).tp == 0]
    for b in [*(b for r in dp_ranks for b in early[r]), *late[0]]:
        for doc in documents(b):
            check_colours(doc, truth[doc["sid"]], tol=3.0 if doc["sid"] >> 32 == 0 else 12.0)
            counts[doc["sid"]] += 1
    # every sample of the epoch exactly once; the only repeats are second-epoch samples, as the state counts them
    state = after[0]["planner"]
    n, carried = len(truth), len(state["carry"]["source"])
    assert state["cursor"][0] >= n
    assert all(o >= n for o in state["carry"]["ordinal"])
    assert set(counts) == set(truth)
    assert sum(counts.values()) == state["cursor"][0] - carried


def test_node_max_image_pixels_reaches_the_workers(server_factory, tmp_path):
    """node.toml's [node] max_image_pixels bounds what the worker processes decode: an image over it is an
    oversize bad sample of its source (counted, never delivered), the smaller ones arrive with their captions."""
    small = pictures("s", 16, "PNG", 5)  # at most 259 x 199 pixels: under the limit
    big = [(encode(c, (400, 300)), f"a {c} picture big-{i}") for i, c in enumerate(("red", "green", "blue"))]
    rows = small[:5] + big[:1] + small[5:10] + big[1:] + small[10:]
    truth = write_parquet(tmp_path / "pq", [rows])
    spec = picture_job("bounded", [("pq", "parquet", tmp_path / "pq", ["image", "caption"])])
    srv = server_factory(workers=2, extra="max_image_pixels = 65536\n").start()  # 400 x 300 = 120,000 over it
    got, st = read_with_status(spec, srv.socket, 6)
    seen = set()
    for batches in got.values():
        for b in batches:
            for doc in documents(b):
                assert "big" not in truth[doc["sid"]], f"an image over max_image_pixels was delivered: {doc['sid']}"
                check_colours(doc, truth[doc["sid"]], tol=3.0)
                seen.add(doc["sid"])
    assert len(seen) >= 10
    (job,) = st["jobs"]
    assert set(job["sources"]["pq"]["bad_samples"]) == {"oversize"}, job["sources"]["pq"]["bad_samples"]
