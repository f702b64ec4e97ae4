"""Data constructors' batch-level work, as pure numpy: pack document pieces into rows, then derive labels,
loss mask, position ids and cu_seqlens, and slice rows for context parallelism (zig-zag). A job with pictures
adds the image keys: every image of the micro-batch's pieces, in order of appearance (IMAGE_FIELDS); a job with
video the video keys likewise (VIDEO_FIELDS).

``build_micro_batch`` writes straight into the arrays it is given (views of a ring slot), so a micro-batch
is built once, in place, and never copied again on its way to the ranks.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

__all__ = [
    "BATCH_FIELDS",
    "IMAGE_FIELDS",
    "ImageShape",
    "MicroBatchPieces",
    "ROW_FIELDS",
    "VIDEO_FIELDS",
    "VideoShape",
    "build_micro_batch",
    "count_segments",
    "field_specs",
    "image_shape",
    "video_shape",
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
    "doc_counts",
    "step",
    "micro",
    "pixel_values",
    "image_grid_thw",
    "image_cu_seqlens",
    "image_sample_ids",
    "pixel_values_videos",
    "video_grid_thw",
    "video_cu_seqlens",
    "video_sample_ids",
)
# The image keys of a job with pictures: pixel_values uint8 [n_patches, 3*patch*patch] (all images in order of
# appearance), image_grid_thw int64 [n_images, 3] (t, h, w in patches), image_cu_seqlens int32 [n_images + 1]
# (patch boundaries per image, from 0), image_sample_ids int64 [n_images] (the sample of each image).
# Not row fields: every CP rank reads them whole; under PP only the first stage (mesh.default_stage_fields).
IMAGE_FIELDS = ("pixel_values", "image_grid_thw", "image_cu_seqlens", "image_sample_ids")
# The video keys of a job with video (Hugging Face Qwen2-VL naming): pixel_values_videos uint8
# [n_rows, 3*temporal_patch*patch*patch] (all clips in order of appearance; a clip's rows are its temporal patches in
# time order, h*w rows each), video_grid_thw int64 [n_videos, 3] (t in temporal patches, h, w in patches),
# video_cu_seqlens int32 [n_temporal_patches + 1] (row boundaries of every temporal patch: the encoder attends
# within each), video_sample_ids int64 [n_videos]. Routed as the image keys.
VIDEO_FIELDS = ("pixel_values_videos", "video_grid_thw", "video_cu_seqlens", "video_sample_ids")
# cu_seqlens has one segment per document piece, then one for each row's padding tail (a row that is not full):
# len(cu_seqlens) - 1 == len(sample_ids) + (rows with padding). doc_counts int64 [rows] says how many of each
# row's segments are document pieces (the row's padding tail, if any, follows them), so a trainer need not guess.
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
    "doc_counts": np.int64,
    "pixel_values": np.uint8,
    "image_grid_thw": np.int64,
    "image_cu_seqlens": np.int32,
    "image_sample_ids": np.int64,
    "pixel_values_videos": np.uint8,
    "video_grid_thw": np.int64,
    "video_cu_seqlens": np.int32,
    "video_sample_ids": np.int64,
}


@dataclass(frozen=True, slots=True)
class ImageShape:
    """How much a micro-batch's image keys hold: patches, images, and bytes per patch row."""

    patches: int
    images: int
    row: int


@dataclass(frozen=True, slots=True)
class VideoShape:
    """How much a micro-batch's video keys hold: rows, clips, temporal patches, and bytes per row."""

    rows: int
    videos: int
    blocks: int
    row: int


@dataclass(frozen=True, slots=True)
class MicroBatchPieces:
    """The document pieces of one micro-batch, in order: row, tokens of each piece, ids."""

    row: np.ndarray  # int32 [n] row index of each piece, non-decreasing
    tokens: list  # n int arrays: the piece's tokens (already sliced from its document)
    sample_ids: np.ndarray  # int64 [n]
    source_ids: np.ndarray  # int64 [n]
    # per piece (a job with pictures): its images' pixel_values uint8 [p, row] and image_grid_thw int64 [k, 3],
    # or None for a piece without images
    images: list | None = None
    # per piece (a job with video): its clips' pixel_values_videos uint8 [r, row] and video_grid_thw int64 [k, 3],
    # or None for a piece without clips
    videos: list | None = None


def image_shape(pieces: MicroBatchPieces, row: int) -> ImageShape:
    """The image keys' sizes for these pieces (row: bytes per patch row of the job's images)."""
    patches = images = 0
    for im in pieces.images or ():
        if im is not None:
            pv, grid = im
            if pv.ndim != 2 or pv.shape[1] != row:
                raise ValueError(f"a piece's pixel_values {pv.shape} do not have rows of {row} bytes (the job's patch)")
            patches += pv.shape[0]
            images += grid.shape[0]
    return ImageShape(patches, images, row)


def video_shape(pieces: MicroBatchPieces, row: int) -> VideoShape:
    """The video keys' sizes for these pieces (row: bytes per pixel_values_videos row of the job's clips)."""
    rows = videos = blocks = 0
    for v in pieces.videos or ():
        if v is not None:
            pv, grid = v
            if pv.ndim != 2 or pv.shape[1] != row:
                raise ValueError(
                    f"a piece's pixel_values_videos {pv.shape} do not have rows of {row} bytes (the job's)"
                )
            rows += pv.shape[0]
            videos += grid.shape[0]
            blocks += int(grid[:, 0].sum())
    return VideoShape(rows, videos, blocks, row)


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
    *,
    rows: int,
    seq_len: int,
    n_pieces: int,
    n_segments: int,
    cp: int = 1,
    images: ImageShape | None = None,
    videos: VideoShape | None = None,
) -> list[tuple[str, str, tuple]]:
    """(name, dtype, shape) of every array a micro-batch needs in its slot (the image keys with ``images``, the
    video keys with ``videos``).

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
    specs.append(("doc_counts", np.dtype(np.int64).str, (rows,)))
    specs.append(("step", np.dtype(np.int64).str, ()))
    specs.append(("micro", np.dtype(np.int64).str, ()))
    if images is not None:
        shapes = {
            "pixel_values": (images.patches, images.row),
            "image_grid_thw": (images.images, 3),
            "image_cu_seqlens": (images.images + 1,),
            "image_sample_ids": (images.images,),
        }
        specs += [(name, np.dtype(_DTYPES[name]).str, shapes[name]) for name in IMAGE_FIELDS]
    if videos is not None:
        shapes = {
            "pixel_values_videos": (videos.rows, videos.row),
            "video_grid_thw": (videos.videos, 3),
            "video_cu_seqlens": (videos.blocks + 1,),
            "video_sample_ids": (videos.videos,),
        }
        specs += [(name, np.dtype(_DTYPES[name]).str, shapes[name]) for name in VIDEO_FIELDS]
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
    covers the flattened rows*seq_len with each row's padding tail as its own segment; doc_counts[r] is the
    number of pieces in row r (its segments before that padding tail).
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
    out["doc_counts"][:] = np.bincount(pieces.row.astype(np.int64), minlength=rows)[:rows]
    out["step"][...] = step
    out["micro"][...] = micro
    if "pixel_values" in out:
        _fill_images(out, pieces)
    if "pixel_values_videos" in out:
        _fill_videos(out, pieces)
    if cp > 1:
        idx = zigzag_index(seq_len, cp)
        for name, full in (("tokens", tok), ("labels", lab), ("loss_mask", msk), ("position_ids", pos)):
            for i in range(cp):
                np.take(full, idx[i], axis=1, out=out[f"{name}@{i}"], mode="clip")  # in range; "raise" buffers


def _fill_images(out: dict[str, np.ndarray], pieces: MicroBatchPieces) -> None:
    """The image keys: each piece's images in order, their grids, patch boundaries and sample ids."""
    pv, grid, cus, ids = out["pixel_values"], out["image_grid_thw"], out["image_cu_seqlens"], out["image_sample_ids"]
    p = k = 0
    cus[0] = 0
    for im, sid in zip(pieces.images or (), pieces.sample_ids.tolist()):
        if im is None:
            continue
        values, thw = im
        n, m = values.shape[0], thw.shape[0]
        pv[p : p + n] = values
        grid[k : k + m] = thw
        cus[k + 1 : k + m + 1] = p + np.cumsum(thw.prod(axis=1))
        ids[k : k + m] = sid
        p, k = p + n, k + m
    if p != pv.shape[0] or k != grid.shape[0]:
        raise ValueError(f"images fill {p} of {pv.shape[0]} patch rows and {k} of {grid.shape[0]} images (layout)")
    if k and int(cus[k]) != p:
        raise ValueError(f"image_grid_thw covers {int(cus[k])} patches but pixel_values has {p} (a bad picture)")


def _fill_videos(out: dict[str, np.ndarray], pieces: MicroBatchPieces) -> None:
    """The video keys: each piece's clips in order, their grids, temporal-patch boundaries and sample ids."""
    pv, grid = out["pixel_values_videos"], out["video_grid_thw"]
    cus, ids = out["video_cu_seqlens"], out["video_sample_ids"]
    p = k = b = 0
    cus[0] = 0
    for v, sid in zip(pieces.videos or (), pieces.sample_ids.tolist()):
        if v is None:
            continue
        values, thw = v
        n, m = values.shape[0], thw.shape[0]
        pv[p : p + n] = values
        grid[k : k + m] = thw
        per = np.repeat(thw[:, 1] * thw[:, 2], thw[:, 0])  # rows of each temporal patch, clip by clip
        cus[b + 1 : b + 1 + len(per)] = p + np.cumsum(per)
        ids[k : k + m] = sid
        p, k, b = p + n, k + m, b + len(per)
    if p != pv.shape[0] or k != grid.shape[0] or b + 1 != len(cus):
        raise ValueError(
            f"clips fill {p} of {pv.shape[0]} rows, {k} of {grid.shape[0]} clips and {b} of {len(cus) - 1} "
            f"temporal patches (layout)"
        )
    if b and int(cus[b]) != p:
        raise ValueError(f"video_grid_thw covers {int(cus[b])} rows but pixel_values_videos has {p} (a bad clip)")


def _scratch(scratch: dict, name: str, shape, dtype) -> np.ndarray:
    a = scratch.get(name)
    if a is None or a.shape != shape:
        a = scratch[name] = np.empty(shape, dtype=dtype)
    return a
