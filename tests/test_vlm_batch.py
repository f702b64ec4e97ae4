"""The image keys of a micro-batch (pure construction), picture pieces, their codec between nodes, and what a
loader tells the planner of its pictures (images and patches per sample) under a read-ahead bound in bytes."""

from __future__ import annotations

import io
from types import SimpleNamespace

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from msdata_client.ring import layout_fields
from msdata_server.batch import (
    IMAGE_FIELDS,
    MicroBatchPieces,
    build_micro_batch,
    count_segments,
    field_specs,
    image_shape,
)
from msdata_server.cluster.docwire import pack_docs, split_docs
from msdata_server.cluster.shardmeta import _in_order
from msdata_server.document import VlmSample, cut_piece
from msdata_server.errors import ProtocolError
from msdata_server.loader import SourceLoader
from msdata_server.sources import open_source

from .aio import run

Image = pytest.importorskip("PIL.Image")

ROW = 3 * 4 * 4  # patch 4
PAD = 257


def picture(n_ph: int, text: list[int], grids: list[tuple[int, int, int]], fill: int) -> VlmSample:
    """A picture document with images of these grids (merge 2: t*h*w/4 placeholders each), pixels = fill + i."""
    g = np.array(grids, dtype=np.int64).reshape(-1, 3)
    pv = np.concatenate([np.full((int(t * h * w), ROW), fill + i, np.uint8) for i, (t, h, w) in enumerate(grids)])
    assert int(g.prod(axis=1).sum()) // 4 == n_ph
    return VlmSample(np.array([258] * n_ph + text + [256], dtype=np.int32), pv, g)


def build(docs, rows=1, seq_len=64, row_of=None):
    toks, images = [], []
    for d in docs:
        toks.append(d.tokens if isinstance(d, VlmSample) else d)
        images.append(
            (d.pixel_values, d.image_grid_thw) if isinstance(d, VlmSample) and len(d.image_grid_thw) else None
        )
    pieces = MicroBatchPieces(
        row=np.asarray(row_of or [0] * len(docs), dtype=np.int32),
        tokens=toks,
        sample_ids=np.arange(len(docs), dtype=np.int64) + 10,
        source_ids=np.zeros(len(docs), dtype=np.int64),
        images=images,
    )
    specs = field_specs(
        rows=rows,
        seq_len=seq_len,
        n_pieces=len(toks),
        n_segments=count_segments(pieces, rows, seq_len),
        images=image_shape(pieces, ROW),
    )
    layouts, n = layout_fields(specs)
    buf = np.full(n, 0xAB, dtype=np.uint8)  # garbage: everything must be written
    out = {f.name: buf[f.offset : f.offset + f.nbytes].view(f.dtype).reshape(f.shape) for f in layouts}
    build_micro_batch(out, pieces, rows=rows, seq_len=seq_len, pad_id=PAD)
    return out


def test_image_keys_in_order_of_appearance():
    a = picture(2, [65, 66], [(1, 2, 4)], fill=1)  # 8 patches, 2 placeholders
    b = np.array([70, 71, 256], dtype=np.int32)  # text between them
    c = picture(3, [67], [(1, 2, 2), (1, 2, 4)], fill=5)  # two images: 4 + 8 patches
    out = build([a, b, c])
    assert out["pixel_values"].dtype == np.uint8
    assert out["pixel_values"].shape == (20, ROW)
    assert out["pixel_values"][:, 0].tolist() == [1] * 8 + [5] * 4 + [6] * 8
    assert out["image_grid_thw"].tolist() == [[1, 2, 4], [1, 2, 2], [1, 2, 4]]
    assert out["image_cu_seqlens"].dtype == np.int32
    assert out["image_cu_seqlens"].tolist() == [0, 8, 12, 20]
    assert out["image_sample_ids"].tolist() == [10, 12, 12]
    # each image's placeholders are where its document starts, t*h*w / merge**2 of them
    assert int((out["tokens"] == 258).sum()) == int(out["image_grid_thw"].prod(axis=1).sum()) // 4
    assert out["tokens"][0, :6].tolist() == [258, 258, 65, 66, 256, 70]


def test_a_text_micro_batch_has_empty_image_keys_with_their_dtypes():
    out = build([np.array([1, 2, 256], dtype=np.int32)])
    assert [out[k].shape for k in IMAGE_FIELDS] == [(0, ROW), (0, 3), (1,), (0,)]
    assert [out[k].dtype for k in IMAGE_FIELDS] == [np.uint8, np.int64, np.int32, np.int64]
    assert out["image_cu_seqlens"].tolist() == [0]


def test_without_images_the_keys_are_absent():
    specs = field_specs(rows=1, seq_len=8, n_pieces=1, n_segments=2)
    assert not {n for n, _, _ in specs} & set(IMAGE_FIELDS)


def test_a_split_picture_document_takes_its_images_with_its_first_piece():
    doc = picture(2, list(range(60, 90)), [(1, 2, 4)], fill=3)
    first, second = cut_piece(doc, 0, 16), cut_piece(doc, 16, 17)
    assert isinstance(first, VlmSample)
    assert len(first) == 16
    assert first.pixel_values.shape == (8, ROW)
    assert isinstance(second, VlmSample)
    assert second.pixel_values.shape == (0, ROW)
    assert second.image_grid_thw.shape == (0, 3)
    assert np.array_equal(np.concatenate([first.tokens, second.tokens]), doc.tokens)
    out = build([first, second], rows=2, seq_len=20, row_of=[0, 1])
    assert out["image_grid_thw"].tolist() == [[1, 2, 4]]
    assert out["image_sample_ids"].tolist() == [10]
    assert np.array_equal(cut_piece(np.arange(10), 2, 3), [2, 3, 4])


def test_the_fetch_codec_carries_pictures_without_pickle():
    docs = [np.arange(5, dtype=np.uint16), picture(3, [1], [(1, 2, 2), (1, 2, 4)], fill=9), np.zeros(0, np.int64)]
    head, buf = pack_docs(docs)
    assert isinstance(buf, bytes)
    assert head["pics"] == [None, [12, 2, ROW], None]
    back = split_docs(head, memoryview(buf))
    assert back[0].tolist() == [0, 1, 2, 3, 4]
    assert back[2].size == 0
    assert isinstance(back[1], VlmSample)
    for k in ("tokens", "pixel_values", "image_grid_thw"):
        assert np.array_equal(getattr(back[1], k), getattr(docs[1], k))
    with pytest.raises(ProtocolError, match="malformed fetch reply"):
        split_docs(head, memoryview(buf[:-8]))  # a grid short
    with pytest.raises(ProtocolError, match="left over"):
        split_docs({**head, "pics": [None, None, None]}, memoryview(buf))


def test_vision_answers_of_several_owners_go_back_in_order():
    # ordinals 0..5 over two owners: spans [0,2) and [4,6) from one, [2,4) from the other
    spans = [[[0, 2], [4, 2]], [[2, 2]]]
    res = [
        (np.array([1, 0, 2, 1]), np.array([10, 20, 30, 40])),  # images of 0,1,4,5; patches of 0 | 4,4 | 5
        (np.array([0, 1]), np.array([50])),
    ]
    images, patches = _in_order(0, 6, spans, res, vision=True)
    assert images.tolist() == [1, 0, 0, 1, 2, 1]
    assert patches.tolist() == [10, 50, 20, 30, 40]
    (lengths,) = _in_order(0, 6, spans, [(np.array([1, 2, 5, 6]),), (np.array([3, 4]),)], vision=False)
    assert lengths.tolist() == [1, 2, 3, 4, 5, 6]


def _png(colour: tuple[int, int, int], size: tuple[int, int]) -> bytes:
    buf = io.BytesIO()
    Image.new("RGB", size, colour).save(buf, "PNG")
    return buf.getvalue()


def test_a_loader_tells_images_and_patches_and_bounds_its_bytes(tmp_path):
    sizes = [(56, 56), (112, 56), (28, 200), (300, 120)] * 8
    rows = [{"image": _png((9 * i % 256, 20, 30), s), "caption": f"c{i}"} for i, s in enumerate(sizes)]
    rows[5]["image"] = b"\x89PNG broken"
    pq.write_table(pa.Table.from_pylist(rows), tmp_path / "p.parquet", row_group_size=4)
    spec = SimpleNamespace(
        name="p", format="parquet", paths=(str(tmp_path),), column="text", columns=("image", "caption"),
        max_sample_bytes=1 << 20, transform=None,
    )  # fmt: skip
    vlm = "msdata_server.transforms:vlm(patch=14, merge=2, min_pixels=3136, max_pixels=50176)"

    async def main():
        src = open_source(spec, seed=0)
        try:
            async with SourceLoader(src, None, transform=vlm, seed=0, batch=4, readahead=32) as ld:
                lengths = await ld.lengths(0, 32)
                bad = int(np.flatnonzero(ld.sample_ids(np.arange(32)) == 5)[0])  # row 5: the corrupt image
                images, patches = await ld.vision(0, 32)
                whole = [await ld.tokens(o) for o in range(32) if o != bad]
            async with SourceLoader(src, None, transform=vlm, seed=0, batch=4, readahead=32, readahead_bytes=1) as ld:
                await ld.lengths(0, 4)
                await ld.wait_idle()
                held_small = ld.statistics()
            return lengths, bad, images, patches, whole, held_small
        finally:
            src.close()

    lengths, bad, images, patches, whole, held_small = run(main())
    assert lengths[bad] == 0
    assert images[bad] == 0
    assert images.sum() == 31
    assert set(images.tolist()) == {0, 1}
    assert patches.tolist() == [int(t.image_grid_thw.prod()) for t in whole]
    assert [len(t) for t in whole] == [int(n) for o, n in enumerate(lengths) if o != bad]
    # the bytes bound: once a byte is held nothing more is scheduled past what was asked (batch 0): only the batch
    # that was in flight before anything was held came; the sample bound alone would have read up to 36
    assert held_small.held_ahead <= 4
    assert held_small.cursor <= 8


class _PictureView:
    """A MetadataView with vision: every third sample a picture of 2 images."""

    def lengths(self, source: int, start: int, count: int) -> np.ndarray:
        return 40 + (np.arange(start, start + count, dtype=np.int64) * 37) % 300

    def vision(self, source: int, start: int, count: int) -> tuple[np.ndarray, np.ndarray]:
        images = np.where(np.arange(start, start + count) % 3 == 0, 2, 0).astype(np.int64)
        return images, 16 + (np.arange(int(images.sum()), dtype=np.int64) * 13) % 200


def test_the_plan_wire_carries_both_stages_figures():
    from msdata_server.cluster.planwire import decode_plan, encode_plan
    from msdata_server.job.status import PlanLog
    from msdata_server.planner import Mixture, Planner, PlannerConfig

    cfg = PlannerConfig(
        sources=("p",), seq_len=512, dp=4, micro_batches=2, cost="vlm", mixture=Mixture.constant({"p": 1})
    )
    plan = Planner(cfg).plan_step(_PictureView())
    assert plan.stats.encoder_imbalance is not None
    assert plan.stats.backbone_imbalance is not None
    head, buf = encode_plan(plan, job="j", digest="d", token=1)
    back = decode_plan(head, buf)
    assert back.stats.encoder_imbalance == plan.stats.encoder_imbalance
    assert back.stats.backbone_imbalance == plan.stats.backbone_imbalance
    log = PlanLog()
    log.record(back.stats)
    summary = log.summary()
    assert summary["encoder_imbalance"] == plan.stats.encoder_imbalance
    assert summary["last_step"]["backbone_imbalance"] == plan.stats.backbone_imbalance
    text = Planner(PlannerConfig(sources=("p",), seq_len=512, dp=4, mixture=Mixture.constant({"p": 1})))
    head, buf = encode_plan(text.plan_step(_PictureView()), job="j", digest="d", token=1)
    assert "encoder_imbalance" not in head
    assert decode_plan(head, buf).stats.encoder_imbalance is None
