"""The video batch keys built from picture pieces with clips (pure), clips over peer links as raw bytes
(docwire), a clip's piece when a document is split, and the encoder blocks the planner prices."""

from __future__ import annotations

import numpy as np
import pytest

from msdata_client.mesh import ClientPlaceTree
from msdata_server.batch import (
    BATCH_FIELDS,
    VIDEO_FIELDS,
    MicroBatchPieces,
    build_micro_batch,
    count_segments,
    field_specs,
    image_shape,
    video_shape,
)
from msdata_server.cluster.docwire import pack_docs, split_docs
from msdata_server.document import VlmSample, cut_piece
from msdata_server.errors import ProtocolError
from msdata_server.planner.lengths import moments

ROW, VROW = 3 * 14 * 14, 3 * 2 * 14 * 14


def clip_doc(sid: int, grids: list[tuple[int, int, int]], text: int = 3, images: int = 0) -> VlmSample:
    g = np.array(grids, dtype=np.int64).reshape(-1, 3)
    rows = int(g.prod(axis=1).sum())
    vv = (np.arange(rows * VROW, dtype=np.int64) % 251 + sid).astype(np.uint8).reshape(rows, VROW)
    ig = np.array([[1, 2, 2]] * images, dtype=np.int64).reshape(-1, 3)
    pv = np.full((4 * images, ROW), sid, np.uint8)
    n = images + rows // 4
    tokens = np.concatenate([np.full(images, 258), np.full(rows // 4, 259), np.arange(text), [256]]).astype(np.int32)
    assert len(tokens) == n + text + 1
    return VlmSample(tokens, pv, ig, vv, g) if len(g) else VlmSample(tokens, pv, ig)


def build(docs, sids, seq_len=256, rows=1):
    pieces = MicroBatchPieces(
        row=np.zeros(len(docs), np.int32),
        tokens=[d.tokens if isinstance(d, VlmSample) else d for d in docs],
        sample_ids=np.array(sids, np.int64),
        source_ids=np.zeros(len(docs), np.int64),
        images=[
            (d.pixel_values, d.image_grid_thw) if isinstance(d, VlmSample) and len(d.image_grid_thw) else None
            for d in docs
        ],
        videos=[
            (d.pixel_values_videos, d.video_grid_thw) if isinstance(d, VlmSample) and len(d.video_grid_thw) else None
            for d in docs
        ],
    )
    specs = field_specs(
        rows=rows,
        seq_len=seq_len,
        n_pieces=len(docs),
        n_segments=count_segments(pieces, rows, seq_len),
        images=image_shape(pieces, ROW),
        videos=video_shape(pieces, VROW),
    )
    out = {name: np.zeros(shape, np.dtype(dt)) for name, dt, shape in specs}
    build_micro_batch(out, pieces, rows=rows, seq_len=seq_len, pad_id=257)
    return out


def test_video_keys_in_order_with_temporal_patch_boundaries():
    a = clip_doc(5, [(2, 2, 4), (1, 4, 4)], images=1)
    text = np.arange(10, dtype=np.int32)
    b = clip_doc(9, [(3, 2, 2)])
    out = build([a, text, b], [5, 6, 9])
    assert out["video_grid_thw"].tolist() == [[2, 2, 4], [1, 4, 4], [3, 2, 2]]
    assert out["video_sample_ids"].tolist() == [5, 5, 9]
    # every temporal patch its own segment: 8, 8 rows (first clip), 16 (second), 4, 4, 4 (third)
    assert out["video_cu_seqlens"].tolist() == [0, 8, 16, 32, 36, 40, 44]
    assert out["video_cu_seqlens"].dtype == np.int32
    assert out["pixel_values_videos"].dtype == np.uint8
    assert np.array_equal(out["pixel_values_videos"], np.concatenate([a.pixel_values_videos, b.pixel_values_videos]))
    assert out["image_grid_thw"].tolist() == [[1, 2, 2]]
    assert out["image_sample_ids"].tolist() == [5]


def test_micro_batch_without_video_has_empty_keys_with_dtypes():
    out = build([np.arange(7, dtype=np.int32), clip_doc(3, [], images=1)], [1, 3])
    assert out["pixel_values_videos"].shape == (0, VROW)
    assert out["pixel_values_videos"].dtype == np.uint8
    assert out["video_grid_thw"].shape == (0, 3)
    assert out["video_grid_thw"].dtype == np.int64
    assert out["video_cu_seqlens"].tolist() == [0]
    assert out["video_cu_seqlens"].dtype == np.int32
    assert out["video_sample_ids"].shape == (0,)
    assert out["video_sample_ids"].dtype == np.int64


def test_video_keys_routed_as_inputs():
    mesh = ClientPlaceTree(dp=1, pp=2, cp=2, tp=1)
    for r in range(mesh.world_size):
        got = set(mesh.fields(r, BATCH_FIELDS))
        assert (set(VIDEO_FIELDS) <= got) == (mesh.coord(r).pp == 0)


def test_clip_pieces_and_docwire_round_trip():
    doc = clip_doc(4, [(2, 2, 2)], text=30, images=1)
    first, later = cut_piece(doc, 0, 8), cut_piece(doc, 8, 8)
    assert np.array_equal(first.pixel_values_videos, doc.pixel_values_videos)
    assert len(first.video_grid_thw) == 1
    assert len(later.video_grid_thw) == 0
    assert len(later.pixel_values) == 0
    docs = [doc, np.arange(5, dtype=np.int32), later, clip_doc(2, [(1, 2, 2)])]
    head, buf = pack_docs(docs)
    assert [len(p) if p else None for p in head["pics"]] == [6, None, 3, 6]
    back = split_docs(head, buf)
    for a, b in zip(docs, back):
        if isinstance(a, VlmSample):
            for k, v in a.arrays().items():
                assert np.array_equal(v, b.arrays()[k]), k
                assert v.dtype == b.arrays()[k].dtype, k
        else:
            assert np.array_equal(a, b)
    with pytest.raises(ProtocolError, match="malformed"):
        split_docs(head, buf[:-5])
    with pytest.raises(ProtocolError, match="3 or 6"):
        split_docs({**head, "pics": [[1, 2, 3, 4], None, None, None]}, buf)


def test_encoder_blocks_price_each_temporal_patch():
    doc = clip_doc(1, [(3, 2, 4), (1, 4, 4)], images=1)
    blocks = doc.encoder_blocks()
    assert blocks.tolist() == [4, 8, 8, 8, 16]
    p1, p2 = moments(np.array([len(blocks)]), blocks)
    # alpha_v * sum over temporal patches of (h*w)**2 + beta_v * t*h*w, and the image's p**2 + p
    assert p1.tolist() == [4 + 3 * 8 + 16]
    assert p2.tolist() == [16 + 3 * 64 + 256]
