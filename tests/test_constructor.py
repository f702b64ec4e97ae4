"""Batch-level construction: packing, labels, loss mask, positions, cu_seqlens, CP zig-zag slices."""

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from msdata_client.ring import layout_fields
from msdata_server.batch import MicroBatchPieces, build_micro_batch, count_segments, field_specs, zigzag_index

PAD = 257


def _alloc(rows, seq_len, pieces, cp=1):
    specs = field_specs(
        rows=rows, seq_len=seq_len, n_pieces=len(pieces.tokens), n_segments=count_segments(pieces, rows, seq_len), cp=cp
    )
    layouts, n = layout_fields(specs)
    buf = np.zeros(n, dtype=np.uint8)
    out = {f.name: buf[f.offset : f.offset + f.nbytes].view(f.dtype).reshape(f.shape) for f in layouts}
    return out


def _pieces(rows_tokens):
    row, toks = [], []
    for r, docs in enumerate(rows_tokens):
        for d in docs:
            row.append(r)
            toks.append(np.asarray(d, dtype=np.int32))
    n = len(toks)
    return MicroBatchPieces(
        row=np.asarray(row, dtype=np.int32),
        tokens=toks,
        sample_ids=np.arange(n, dtype=np.int64) + 100,
        source_ids=np.arange(n, dtype=np.int64) % 2,
    )


def test_keys_follow_the_contract():
    p = _pieces([[[1, 2, 256], [3, 4, 5, 256]], [[7, 256]]])
    out = _alloc(2, 8, p)
    build_micro_batch(out, p, rows=2, seq_len=8, pad_id=PAD)
    assert out["tokens"].tolist() == [[1, 2, 256, 3, 4, 5, 256, PAD], [7, 256, PAD, PAD, PAD, PAD, PAD, PAD]]
    assert out["labels"].tolist() == [[2, 256, 3, 4, 5, 256, PAD, PAD], [256, PAD, PAD, PAD, PAD, PAD, PAD, PAD]]
    # 1 where the label is the next token of the same document: the last token before EOS predicts EOS
    assert out["loss_mask"].tolist() == [[1, 1, 0, 1, 1, 1, 0, 0], [1, 0, 0, 0, 0, 0, 0, 0]]
    assert out["position_ids"].tolist() == [[0, 1, 2, 0, 1, 2, 3, 0], [0, 1, 0, 0, 0, 0, 0, 0]]
    # each row's padding tail is its own segment; ends at rows*seq_len
    assert out["cu_seqlens"].tolist() == [0, 3, 7, 8, 10, 16]
    assert out["cu_seqlens"].dtype == np.int32
    assert out["sample_ids"].tolist() == [100, 101, 102]
    assert out["tokens"].dtype == np.int64


def test_full_row_has_no_padding_segment():
    p = _pieces([[[1, 2], [3, 4]]])
    out = _alloc(1, 4, p)
    build_micro_batch(out, p, rows=1, seq_len=4, pad_id=PAD)
    assert out["cu_seqlens"].tolist() == [0, 2, 4]
    assert out["labels"].tolist() == [[2, 3, 4, PAD]]


def test_overflowing_row_is_refused():
    p = _pieces([[[1, 2, 3], [4, 5]]])
    out = _alloc(1, 8, p)
    with pytest.raises(ValueError, match="overflow row 0"):
        build_micro_batch(out, p, rows=1, seq_len=4, pad_id=PAD)


def test_zigzag_index():
    idx = zigzag_index(8, 2)
    assert idx.tolist() == [[0, 1, 6, 7], [2, 3, 4, 5]]
    with pytest.raises(ValueError, match="divisible by 2\\*cp"):
        zigzag_index(6, 2)


@settings(max_examples=40, deadline=None)
@given(st.lists(st.lists(st.integers(1, 12), max_size=4), min_size=1, max_size=3), st.sampled_from([1, 2, 4]))
def test_cp_slices_reassemble_into_the_row(doc_lens, cp):
    seq_len = 48
    rng = np.random.default_rng(0)
    rows = [[rng.integers(0, 256, n) for n in lens] for lens in doc_lens]
    p = _pieces(rows)
    full = _alloc(len(rows), seq_len, p)
    build_micro_batch(full, p, rows=len(rows), seq_len=seq_len, pad_id=PAD)
    sliced = _alloc(len(rows), seq_len, p, cp=cp)
    build_micro_batch(sliced, p, rows=len(rows), seq_len=seq_len, pad_id=PAD, cp=cp)
    idx = zigzag_index(seq_len, cp)
    for name in ("tokens", "labels", "loss_mask", "position_ids"):
        key = name if cp == 1 else None
        re = np.empty_like(full[name])
        for i in range(cp):
            re[:, idx[i]] = sliced[key or f"{name}@{i}"]
        np.testing.assert_array_equal(re, full[name])
    # invariants over the full batch
    assert full["cu_seqlens"][-1] == len(rows) * seq_len
    assert np.all(np.diff(full["cu_seqlens"]) > 0)
    assert int(full["loss_mask"].sum()) == sum(max(n - 1, 0) for lens in doc_lens for n in lens)
