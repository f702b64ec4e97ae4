"""Video end to end through a real `msdata-server serve`: clips in WebDataset shards (``.mp4`` + ``.txt``) and in
a Parquet binary column beside images and text in one job, decoded in the worker pool; every clip delivered
holds exactly the frames the sampling rule takes, in order, under its own placeholders; a broken clip is a bad
sample with its reason; CP ranks get the video keys whole and under PP the first stage only; a long clip
document split across steps keeps its clip with its first piece; a resume mid-epoch repeats the batches bit
for bit."""

from __future__ import annotations

from collections import Counter

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

import msdata_client as msd
from msdata_server.batch import VIDEO_FIELDS

from .e2e_util import run_ranks
from .video_util import CLIP_SIDE, VIDEO_VLM, clip_samples, expected_frames, make_clip, video_documents
from .vlm_util import VLM, pictures, read_with_status, write_parquet, write_shards

pytest.importorskip("PIL.Image")


@pytest.fixture
def mixed(tmp_path):
    """Four sources: clips in WebDataset shards (one clip broken), clips in a Parquet binary column, pictures in
    Parquet (captions), plain text."""
    shards = []
    for s in range(2):
        shards.append(
            [(f"s{s}/{i:04d}", {"mp4": c, "txt": t.encode()}) for i, (c, t) in enumerate(clip_samples(f"w{s}", 6, s))]
        )
    shards[1][2] = (shards[1][2][0], {"mp4": b"\x00\x00\x00\x18ftypmp42" + b"broken" * 40, "txt": b"clip broken"})
    write_shards(tmp_path / "wds", shards)
    (tmp_path / "pqv").mkdir()
    rows = clip_samples("p", 8, 7)
    pq.write_table(pa.table({"mp4": [c for c, _ in rows], "txt": [t for _, t in rows]}), tmp_path / "pqv" / "a.parquet")
    write_parquet(tmp_path / "pics", [pictures("i", 10, "PNG", 3)])
    (tmp_path / "txt").mkdir()
    pq.write_table(
        pa.table({"text": [f"plain text {i} " * (1 + i % 7) for i in range(300)]}), tmp_path / "txt" / "t.parquet"
    )
    return tmp_path


def mixed_job(root, name="mixed", *, dp=2, cp=1, pp=1, tp=1, micro=2, seq_len=512):
    g = msd.DGraph(name, seed=5)
    g.source("wds", "webdataset", [str(root / "wds")], columns=["mp4", "txt"], transform=VIDEO_VLM)
    g.source("pqv", "parquet", [str(root / "pqv")], columns=["mp4", "txt"], transform=VIDEO_VLM)
    g.source("pics", "parquet", [str(root / "pics")], columns=["image", "caption"], transform=VLM)
    g.source("txt", "parquet", [str(root / "txt")])
    g.mix({"wds": 0.3, "pqv": 0.3, "pics": 0.2, "txt": 0.2}).cost("vlm", alpha_v=1.0, beta_v=2048.0)
    return g.pack(seq_len, micro_batches=micro).mesh(dp=dp, cp=cp, pp=pp, tp=tp).prefetch(2).plan()


def _check_clip_docs(batches, *, video_sources=(0, 1)) -> Counter:
    seen: Counter = Counter()
    for b in batches:
        for doc, src in zip(video_documents(b), b["source_ids"].tolist()):
            if src in video_sources and doc["n_vid"]:
                text = bytes(doc["tokens"][doc["n_vid"] : -1].astype(np.uint8)).decode()
                assert text.startswith("clip ") and "broken" not in text
                assert doc["frames"] == [[i % 256 for i in expected_frames(text)]], text
                seen[src] += 1
            else:
                assert not doc["clips"]
                seen[src] += 1
    return seen


def test_mixed_job_delivers_exact_clips_and_counts_the_broken_one(server_factory, mixed):
    spec = mixed_job(mixed)
    srv = server_factory(workers=2).start()
    got, st = read_with_status(spec, srv.socket, 10)
    seen = _check_clip_docs([b for bs in got.values() for b in bs])
    assert seen[0] >= 4 and seen[1] >= 4 and seen[2] >= 1 and seen[3] >= 1
    (job,) = st["jobs"]
    bad = job["sources"]["wds"]["bad_samples"]
    assert set(bad) == {"video_decode_error"} and bad["video_decode_error"] >= 1
    assert job["encoder_imbalance"] >= 1.0


def test_video_keys_whole_on_cp_ranks_first_pp_stage_only(server_factory, mixed):
    spec = mixed_job(mixed, "route", dp=1, cp=2, pp=2, micro=4, seq_len=256)
    srv = server_factory(workers=2).start()
    got = run_ranks(spec, srv.socket, 6, keep=True)[1]
    mesh = spec.mesh
    first = [r for r in range(mesh.world_size) if mesh.coord(r).pp == 0]
    last = [r for r in range(mesh.world_size) if mesh.coord(r).pp == 1]
    empty = clips = 0
    for i in range(6):
        a, b = (got[r][i] for r in first)
        for k in VIDEO_FIELDS:
            assert np.array_equal(a[k].numpy(), b[k].numpy())
        for r in last:
            assert not set(VIDEO_FIELDS) & set(got[r][i])
        if a["video_grid_thw"].shape[0] == 0:
            empty += 1
            assert a["pixel_values_videos"].shape == (0, 3 * 2 * 14 * 14) and a["video_cu_seqlens"].tolist() == [0]
            assert str(a["pixel_values_videos"].dtype) == "torch.uint8"
            assert str(a["video_grid_thw"].dtype) == str(a["video_sample_ids"].dtype) == "torch.int64"
            assert str(a["video_cu_seqlens"].dtype) == "torch.int32"
        else:
            clips += 1
    assert clips >= 1


def test_long_clip_document_split_keeps_the_clip_with_its_first_piece(server_factory, tmp_path):
    (tmp_path / "pqv").mkdir()
    long_text = "a long description " * 40  # 760 bytes: with its 64 placeholders, three pieces of 320
    clips = [make_clip(20, width=CLIP_SIDE, height=CLIP_SIDE, rate=10) for _ in range(6)]
    texts = [f"clip {k} of 20 frames at 10 " + long_text for k in range(6)]
    pq.write_table(pa.table({"mp4": clips, "txt": texts}), tmp_path / "pqv" / "a.parquet")
    g = msd.DGraph("split", seed=1)
    g.source("pqv", "parquet", [str(tmp_path / "pqv")], columns=["mp4", "txt"], transform=VIDEO_VLM)
    spec = g.mix({"pqv": 1.0}).cost("vlm").pack(320, micro_batches=1).mesh(dp=1).plan()
    srv = server_factory(workers=1).start()
    got = run_ranks(spec, srv.socket, 8, keep=True)[1][0]
    firsts = later = 0
    for b in got:
        for doc in video_documents({k: v.numpy() for k, v in b.items()}):
            text = bytes(doc["tokens"][doc["n_vid"] :].astype(np.uint8)).decode(errors="replace")
            if text.startswith("clip "):  # a first piece: the clip's placeholders, then the text's start
                assert doc["n_vid"] == 2 * 8 * 8 // 4 and doc["frames"] == [[0, 6, 13, 19]]
                firsts += 1
            else:  # a later piece: text only, no clip
                assert doc["n_vid"] == 0 and not doc["clips"] and "long description" in text
                later += 1
    assert firsts >= 1 and later >= 2


def test_resume_mid_epoch_with_video_is_bit_identical(server_factory, mixed):
    spec = mixed_job(mixed, "resume", dp=2, micro=1)
    srv = server_factory(workers=2).start()
    saved: dict = {}
    whole = run_ranks(spec, srv.socket, 6)
    run_ranks(spec, srv.socket, 3, saved=saved)
    rest = run_ranks(spec, srv.socket, 3, states=saved)
    for r in whole:
        assert rest[r] == whole[r][3:]  # every field hashed, pixel_values_videos included
        assert any("pixel_values_videos" in rec for rec in whole[r])
