"""A document's payload as loaders hold it and constructors build from it: a token array, or a picture document
(``VlmSample``: tokens with its images' and clips' patches); and the piece of one that a plan names (``cut_piece``).
The batch build (``batch.py``) packs these pieces into micro-batches."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field

import numpy as np

__all__ = ["Document", "VlmSample", "cut_piece"]


def _no_grid() -> np.ndarray:
    return np.zeros((0, 3), dtype=np.int64)


def _no_pixels() -> np.ndarray:
    return np.zeros((0, 0), dtype=np.uint8)


@dataclass(frozen=True, slots=True)
class VlmSample:
    """A picture document: ``tokens`` int32 (each image's placeholders, then each clip's, then the text, then
    EOS), ``pixel_values`` uint8 ``[n_patches, 3 * patch * patch]`` (images in order, patches in Qwen2-VL order)
    and ``image_grid_thw`` int64 ``[n_images, 3]`` (t, h, w in patches); with video, ``pixel_values_videos`` uint8
    ``[n_rows, 3 * temporal_patch * patch * patch]`` (clips in order, each its temporal patches in time order)
    and ``video_grid_thw`` int64 ``[n_videos, 3]`` (t in temporal patches). ``len()`` is the token count."""

    tokens: np.ndarray
    pixel_values: np.ndarray
    image_grid_thw: np.ndarray
    pixel_values_videos: np.ndarray = field(default_factory=_no_pixels)
    video_grid_thw: np.ndarray = field(default_factory=_no_grid)

    def __len__(self) -> int:
        return len(self.tokens)

    @property
    def nbytes(self) -> int:
        return (
            self.tokens.nbytes
            + self.pixel_values.nbytes
            + self.image_grid_thw.nbytes
            + self.pixel_values_videos.nbytes
            + self.video_grid_thw.nbytes
        )

    def arrays(self) -> dict[str, np.ndarray]:
        """The arrays by batch key (how a result buffer carries them; ``from_arrays`` rebuilds the sample)."""
        out = {"tokens": self.tokens, "pixel_values": self.pixel_values, "image_grid_thw": self.image_grid_thw}
        if len(self.video_grid_thw):
            out["pixel_values_videos"] = self.pixel_values_videos
            out["video_grid_thw"] = self.video_grid_thw
        return out

    @classmethod
    def from_arrays(cls, arrays: Mapping[str, np.ndarray]) -> VlmSample:
        return cls(
            arrays["tokens"],
            arrays["pixel_values"],
            arrays["image_grid_thw"],
            arrays.get("pixel_values_videos", _no_pixels()),
            arrays.get("video_grid_thw", _no_grid()),
        )

    def encoder_blocks(self) -> np.ndarray:
        """int64 patches of each block the vision encoder attends within, in order: every image (t * h * w), then
        every temporal patch of every clip (h * w each, t of them per clip). The encoder's cost is quadratic per
        block, so these are what the planner prices (``planner.lengths.moments``)."""
        img = np.asarray(self.image_grid_thw, dtype=np.int64).reshape(-1, 3)
        vid = np.asarray(self.video_grid_thw, dtype=np.int64).reshape(-1, 3)
        if not len(vid):
            return img.prod(axis=1)
        return np.concatenate([img.prod(axis=1), np.repeat(vid[:, 1] * vid[:, 2], vid[:, 0])])

    def piece(self, offset: int, length: int) -> VlmSample:
        """The piece of ``length`` tokens from ``offset`` (a document longer than seq_len is split): the images
        and clips go with the first piece (offset 0), which holds their placeholders; later pieces carry none.
        Pieces are cut at multiples of seq_len and the placeholders lead the tokens, so the first piece holds all
        of them whenever they number at most seq_len, which ``vlm(seq_len=...)`` makes sure of (a document with
        more is a bad sample, ``image_tokens_exceed_seq_len`` or ``video_tokens_exceed_seq_len``)."""
        if offset == 0:
            return VlmSample(
                self.tokens[:length],
                self.pixel_values,
                self.image_grid_thw,
                self.pixel_values_videos,
                self.video_grid_thw,
            )
        return VlmSample(
            self.tokens[offset : offset + length], self.pixel_values[:0], self.image_grid_thw[:0].reshape(0, 3)
        )


def cut_piece(doc: np.ndarray | VlmSample, offset: int, length: int) -> np.ndarray | VlmSample:
    """The piece of a document a plan names: a token slice, or for a picture document ``VlmSample.piece``."""
    if isinstance(doc, VlmSample):
        return doc.piece(offset, length)
    return doc[offset : offset + length]


Document = np.ndarray | VlmSample
