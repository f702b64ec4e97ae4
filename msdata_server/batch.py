"""Data constructors' batch-level work, as pure numpy: pack document pieces into rows, then derive labels,
loss mask, position ids and cu_seqlens, and slice rows for context parallelism (zig-zag).

``build_micro_batch`` writes straight into the arrays it is given (views of a ring slot), so a micro-batch
is built once, in place, and never copied again on its way to the ranks.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

__all__ = [
    "BATCH_FIELDS",
    "MicroBatchPieces",
    "ROW_FIELDS",
    "build_micro_batch",
    "count_segments",
    "field_specs",
    "zigzag_index",
]

# Every field of a token micro-batch (ARCHITECTURE §4.2), in the order ranks see them
BATCH_FIELDS = (
    "tokens",
    "labels",
    "loss_mask",
    "position_ids",
    "cu_seqlens",
    "sample_ids",
    "source_ids",
    "step",
    "micro",
)
# Fields shaped [rows, seq_len] (or the CP slice [rows, seq_len/cp]); the others are per document.
ROW_FIELDS = ("tokens", "labels", "loss_mask", "position_ids")
_DTYPES = {
    "tokens": np.int64,
    "labels": np.int64,
    "loss_mask": np.float32,
    "position_ids": np.int64,
    "cu_seqlens": np.int32,
    "sample_ids": np.int64,
    "source_ids": np.int64,
}


@dataclass(frozen=True, slots=True)
class MicroBatchPieces:
    """The document pieces of one micro-batch, in order: row, tokens of each piece, ids."""

    row: np.ndarray  # int32 [n] row index of each piece, non-decreasing
    tokens: list  # n int arrays: the piece's tokens (already sliced from its document)
    sample_ids: np.ndarray  # int64 [n]
    source_ids: np.ndarray  # int64 [n]


def zigzag_index(seq_len: int, cp: int) -> np.ndarray:
    """Column indices of each CP rank's zig-zag slice: [cp, seq_len/cp]; rank i takes chunks i, 2cp-1-i."""
    if seq_len % (2 * cp):
        raise ValueError(f"{seq_len=} must be divisible by 2*cp={2 * cp}")
    c = seq_len // (2 * cp)
    idx = np.empty((cp, 2 * c), dtype=np.int64)
    for i in range(cp):
        idx[i, :c] = np.arange(i * c, (i + 1) * c)
        j = 2 * cp - 1 - i
        idx[i, c:] = np.arange(j * c, (j + 1) * c)
    return idx


def field_specs(
    *, rows: int, seq_len: int, n_pieces: int, n_segments: int, cp: int = 1
) -> list[tuple[str, str, tuple]]:
    """(name, dtype, shape) of every array a micro-batch needs in its slot.

    With cp > 1 each row field is stored once per CP rank, as ``{name}@{i}`` of shape [rows, seq_len/cp],
    so every CP rank maps one contiguous array and nothing is copied on the reader's side.
    """
    specs: list[tuple[str, str, tuple]] = []
    for name in ROW_FIELDS:
        if cp == 1:
            specs.append((name, np.dtype(_DTYPES[name]).str, (rows, seq_len)))
        else:
            for i in range(cp):
                specs.append((f"{name}@{i}", np.dtype(_DTYPES[name]).str, (rows, seq_len // cp)))
    specs.append(("cu_seqlens", np.dtype(np.int32).str, (n_segments + 1,)))
    specs.append(("sample_ids", np.dtype(np.int64).str, (n_pieces,)))
    specs.append(("source_ids", np.dtype(np.int64).str, (n_pieces,)))
    specs.append(("step", np.dtype(np.int64).str, ()))
    specs.append(("micro", np.dtype(np.int64).str, ()))
    return specs


def count_segments(pieces: MicroBatchPieces, rows: int, seq_len: int) -> int:
    """Segments of cu_seqlens: one per piece plus one per row that has a padding tail."""
    used = np.zeros(rows, dtype=np.int64)
    if len(pieces.row):
        np.add.at(used, pieces.row.astype(np.int64), [len(t) for t in pieces.tokens])
    return len(pieces.row) + int(np.count_nonzero(used < seq_len))


def build_micro_batch(
    out: dict[str, np.ndarray],
    pieces: MicroBatchPieces,
    *,
    rows: int,
    seq_len: int,
    pad_id: int,
    cp: int = 1,
    step: int = 0,
    micro: int = 0,
    scratch: dict | None = None,
) -> None:
    """Fill ``out`` (arrays laid out by field_specs) from the pieces, in place.

    labels[i] = tokens[i+1] within the packed row (pad_id after the last); loss_mask is 1 where that label is
    the next token of the same piece; position_ids restart at 0 for every piece, 0 on padding; cu_seqlens
    covers the flattened rows*seq_len with each row's padding tail as its own segment.
    """
    if cp == 1:
        tok, lab, msk, pos = out["tokens"], out["labels"], out["loss_mask"], out["position_ids"]
    else:
        scratch = scratch if scratch is not None else {}
        tok = _scratch(scratch, "tokens", (rows, seq_len), np.int64)
        lab = _scratch(scratch, "labels", (rows, seq_len), np.int64)
        msk = _scratch(scratch, "loss_mask", (rows, seq_len), np.float32)
        pos = _scratch(scratch, "position_ids", (rows, seq_len), np.int64)
    tok.fill(pad_id)
    msk.fill(0)
    pos.fill(0)
    bounds = []
    fill = np.zeros(rows, dtype=np.int64)
    for r, t in zip(pieces.row.tolist(), pieces.tokens):
        n = len(t)
        at = fill[r]
        if at + n > seq_len:
            raise ValueError(f"pieces overflow row {r}: {at}+{n} > {seq_len=} (planner bug)")
        tok[r, at : at + n] = t
        pos[r, at : at + n] = np.arange(n)
        if n > 1:
            msk[r, at : at + n - 1] = 1
        fill[r] = at + n
        bounds.append(r * seq_len + at + n)
    lab[:, :-1] = tok[:, 1:]
    lab[:, -1] = pad_id
    # segment ends: every piece end, plus every row end (a row's padding tail, or a row that is full)
    ends = np.asarray(bounds, dtype=np.int64)
    row_ends = (np.arange(rows, dtype=np.int64) + 1) * seq_len
    cu = np.unique(np.concatenate([ends, row_ends]))
    cus = out["cu_seqlens"]
    if len(cus) != len(cu) + 1:
        raise ValueError(f"cu_seqlens has {len(cus)} entries, expected {len(cu) + 1} (layout mismatch)")
    cus[0] = 0
    cus[1:] = cu
    out["sample_ids"][:] = pieces.sample_ids
    out["source_ids"][:] = pieces.source_ids
    out["step"][...] = step
    out["micro"][...] = micro
    if cp > 1:
        idx = zigzag_index(seq_len, cp)
        for name, full in (("tokens", tok), ("labels", lab), ("loss_mask", msk), ("position_ids", pos)):
            for i in range(cp):
                np.take(full, idx[i], axis=1, out=out[f"{name}@{i}"])


def _scratch(scratch: dict, name: str, shape, dtype) -> np.ndarray:
    a = scratch.get(name)
    if a is None or a.shape != shape:
        a = scratch[name] = np.empty(shape, dtype=dtype)
    return a
