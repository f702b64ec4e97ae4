"""Video end to end through a real `msdata-server serve`: clips in WebDataset shards (``.mp4`` + ``.txt``) and in
a Parquet binary column beside images and text in one job, decoded in the worker pool; every clip delivered
holds exactly the frames the sampling rule takes, in order, under its own placeholders; a broken clip is a bad
sample with its reason; CP ranks get the video keys whole and under PP the first stage only; a long clip
document split across steps keeps its clip with its first piece; a resume mid-epoch repeats the batches bit
for bit."""

from __future__ import annotations

from collections import Counter
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

import msdata_client as msd
from msdata_server.batch import VIDEO_FIELDS

from .e2e_util import batch_record, run_ranks
from .video_util import CLIP_SIDE, VIDEO_VLM, expected_frames, make_clip, mixed_job, video_documents, write_mixed
from .vlm_util import read_with_status

pytest.importorskip("PIL.Image")


@pytest.fixture
def mixed(tmp_path):
    write_mixed(tmp_path)
    return tmp_path


def _check_clip_docs(batches, *, video_sources=(0, 1)) -> Counter:
    seen: Counter = Counter()
    for b in batches:
        for doc, src in zip(video_documents(b), b["source_ids"].tolist()):
            if src in video_sources and doc["n_vid"]:
                text = bytes(doc["tokens"][doc["n_vid"] : -1].astype(np.uint8)).decode()
                assert text.startswith("clip ")
                assert "broken" not in text
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
    assert seen[0] >= 4
    assert seen[1] >= 4
    assert seen[2] >= 1
    assert seen[3] >= 1
    (job,) = st["jobs"]
    bad = job["sources"]["wds"]["bad_samples"]
    assert set(bad) == {"video_decode_error"}
    assert bad["video_decode_error"] >= 1
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
            assert a["pixel_values_videos"].shape == (0, 3 * 2 * 14 * 14)
            assert a["video_cu_seqlens"].tolist() == [0]
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
                assert doc["n_vid"] == 2 * 8 * 8 // 4
                assert doc["frames"] == [[0, 6, 13, 19]]
                firsts += 1
            else:  # a later piece: text only, no clip
                assert doc["n_vid"] == 0
                assert not doc["clips"]
                assert "long description" in text
                later += 1
    assert firsts >= 1
    assert later >= 2


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


def test_skip_and_lineage_with_video(server_factory, mixed):
    spec = mixed_job(mixed, "skip", dp=2, micro=1)
    srv = server_factory(workers=2).start()
    saved: dict = {}
    whole = run_ranks(spec, srv.socket, 6)
    run_ranks(spec, srv.socket, 2, saved=saved)

    def rank(r: int):
        with msd.DataClient(spec, endpoint=srv.socket, rank=r, world_size=2, connect_timeout=30) as dc:
            dc.load_state_dict(saved[r])
            dc.skip(steps=2)
            recs = [batch_record(next(dc)) for _ in range(2)]
            return recs, {s: _rows(dc, s) for s in range(2, 6)}

    with ThreadPoolExecutor(2) as ex:
        (recs0, lin0), (recs1, lin1) = ex.map(rank, (0, 1))
    assert recs0 == whole[0][4:6]
    assert recs1 == whole[1][4:6]
    for r, lin in ((0, lin0), (1, lin1)):
        for s in range(2, 6):
            assert [int(x["sample_id"]) for x in lin[s]] == [x[1] for x in whole[r][s]["ids"]]
            assert [x["skipped"] for x in lin[s]] == [s in (2, 3)] * len(lin[s])
    assert {"wds", "pqv"} <= {x["source"] for lin in (lin0, lin1) for rows in lin.values() for x in rows}


def _rows(dc, step):
    rows = dc.lineage(step)
    return rows.to_pylist() if hasattr(rows, "to_pylist") else rows


def test_reshard_with_video_continues_exactly(server_factory, mixed):
    """A state saved at dp=2 restores at dp=1: the job goes on from the same position, clips exact."""
    two = mixed_job(mixed, "reshard", dp=2, micro=1)
    one = mixed_job(mixed, "reshard", dp=1, micro=2)
    srv = server_factory(workers=2).start()
    saved: dict = {}
    run_ranks(two, srv.socket, 3, saved=saved)
    got = run_ranks(one, srv.socket, 4, states={0: saved[0]}, keep=True)[1][0]
    seen = _check_clip_docs([{k: v.numpy() for k, v in b.items()} for b in got])
    assert seen[0] + seen[1] >= 1
    assert int(got[0]["step"]) == 3  # it continues at the saved step
