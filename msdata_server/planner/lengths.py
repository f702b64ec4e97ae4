"""What the planner reads of the data: sample lengths by ordinal, through a MetadataView.

`LengthReader` draws each source's next documents in order until a token deficit is covered, in
chunks sized by a running mean length, keeping what it read beyond as a look-ahead, and checks what
the view returns. Neither is planner state: both are pure values of the view, safe to drop.

With the two-stage cost ("vlm") the reader also asks a view that has it for `vision`: the patches
of each document's encoder blocks (an image; or one temporal patch of a clip, h*w patches each, since the
encoder attends within it), as a flat per-block list with a count per document (the encoder cost is
quadratic per block, so a document's total alone would price two 500-patch images like one of
1000). It keeps each document's first two moments, patches and patches squared, which is all
``alpha_v * p**2 + beta_v * p`` summed over images needs, in two int64 columns beside the lengths.
A view without `vision` (text only) has 0 patches everywhere.
"""

from __future__ import annotations

import math
import time
from typing import Protocol

import numpy as np

from msdata_server.errors import BadSourceError, ProtocolError

from .pack import LongDocs

__all__ = ["BAD_WINDOW", "LengthReader", "MetadataView", "VisionView", "moments"]

MIN_CHUNK, MAX_CHUNK = 64, 1 << 16  # ordinals per MetadataView.lengths call (the loaders hold what was asked)
FIRST_CHUNK = 4  # ...at least in a source's first call (1,024 sources' first step takes 1 of each; its loader reads
# that part of a batch, loader/loader.py HEAD, where a batch of 64 over 16 files would decode ~58 row groups)
# A source is broken when no good sample is among its last BAD_WINDOW reads: that many consecutive empty (bad)
# samples in its order, counted across epochs (ordinals run on through them), so a source of
# 20 samples that are all bad fails after some 200 epochs, within a second or so, and a large one after reading
# BAD_WINDOW samples. A run of bad samples shorter than this (a corrupt row group, a damaged file) is skipped
# and counted. The window is a pure function of the lengths: every planner of the job fails at the same read.
BAD_WINDOW = 4096


class MetadataView(Protocol):
    """Lengths of samples by ordinal; what the planner reads (the node server implements it)."""

    def lengths(self, source: int, start: int, count: int) -> np.ndarray:
        """int64 token lengths of ordinals [start, start+count) of `source`; 0 = a skipped bad sample."""
        ...


class VisionView(MetadataView, Protocol):
    """A MetadataView that also knows the images of its samples (needed by the "vlm" cost only)."""

    def vision(self, source: int, start: int, count: int) -> tuple[np.ndarray, np.ndarray]:
        """(images, patches) of ordinals [start, start+count) of `source`: int64 encoder blocks per sample
        ([count]; 0 for text and bad samples) and int64 patches of every block (an image's t*h*w, a clip's h*w
        per temporal patch), samples in order."""
        ...


def moments(images: np.ndarray, patches: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """int64 per document: the sum of its images' patches and the sum of their squares."""
    doc = np.repeat(np.arange(images.size), images)
    p = patches.astype(np.int64)
    return (
        np.bincount(doc, weights=p, minlength=images.size).astype(np.int64),
        np.bincount(doc, weights=p * p, minlength=images.size).astype(np.int64),
    )


class LengthReader:
    """Reads the sources' lengths in order for a planner; see the module docstring.

    With `vision`, `draw` returns int64 [3, n]: lengths, patches, patches squared per document;
    without, int64 [n] lengths."""

    def __init__(self, sources: tuple[str, ...], seq_len: int, mode: LongDocs, *, vision: bool = False):
        n = len(sources)
        self._sources, self._seq_len, self._mode, self._vision = sources, seq_len, mode, vision
        empty = np.zeros((3, 0) if vision else 0, np.int64)
        self._ahead: list[tuple[int, np.ndarray]] = [(0, empty) for _ in range(n)]
        self._mean_len = np.full(n, max(1.0, seq_len / 8))  # only sizes the read chunks

    def draw(self, view: MetadataView, s: int, start: int, deficit: float, ingest: list[float]) -> np.ndarray:
        """Lengths of source s's next documents from `start`, in order, until `deficit` tokens are covered.

        The last one crosses the deficit (never short of it); empty (bad) samples are passed over.
        Milliseconds spent in the view are added to ingest[0]. (With `vision`, [3, n]; see the class.)
        """
        cur = start
        got: list[np.ndarray] = []
        have = 0
        run = 0  # empty samples in a row up to cur (a draw ends on a good one: runs never span draws)
        while True:
            first = self._ahead[s][0] == 0 and not got  # a source's first call: FIRST_CHUNK, not MIN_CHUNK, and slack
            floor, slack = (FIRST_CHUNK, FIRST_CHUNK) if first else (MIN_CHUNK, 16)
            count = int(min(MAX_CHUNK, max(floor, 1.1 * (deficit - have) / self._mean_len[s] + slack)))
            if run:  # reading through bad samples: check the window before reading far on
                count = min(count, max(MIN_CHUNK, BAD_WINDOW - run))
            cols = self._read(view, s, cur, count, ingest)
            arr = cols[0] if self._vision else cols
            used = np.minimum(arr, self._seq_len) if self._mode is LongDocs.TRUNCATE else arr
            ends = np.cumsum(used)
            # (an int key: a float key converts all of `ends` to floats first; ends >= x iff ends >= ceil(x))
            j = int(np.searchsorted(ends, math.ceil(deficit - have), side="left"))
            nonzero = int(np.count_nonzero(arr))
            if nonzero:
                self._mean_len[s] = max(1.0, float(ends[-1]) / nonzero)
            run = self._bad_run(s, cur, arr[: j + 1], run)
            if j < arr.size:
                got.append(cols[..., : j + 1])
                self._ahead[s] = (cur + j + 1, cols[..., j + 1 :])
                return np.concatenate(got, axis=-1) if len(got) > 1 else got[0]
            got.append(cols)
            have += int(ends[-1])
            cur += arr.size

    def _bad_run(self, s: int, start: int, lens: np.ndarray, run: int) -> int:
        """Lengths of ordinals [start, start+len) of source s were taken after ``run`` empty ones: the empty ones in
        a row at their end, or BadSourceError if BAD_WINDOW of them are empty in a row (the window rule)."""
        good = np.flatnonzero(lens)
        gaps = np.diff(np.concatenate([[-1 - run], good, [lens.size]])) - 1  # empty runs between good samples
        worst = int(gaps.max())
        if worst >= BAD_WINDOW:
            at = int(np.argmax(gaps >= BAD_WINDOW))
            bad, last = int(gaps[at]), start + (int(good[at]) if at < good.size else lens.size) - 1
            raise BadSourceError(
                f"source {self._sources[s]!r} has no good sample among its last {bad} reads (ordinals"
                f" {last - bad + 1}..{last}, epochs included; the limit is {BAD_WINDOW}): its data is all bad;"
                f" check its files, column and transform (`msdata-server validate --job` reads a few)",
                source=self._sources[s],
            )
        return int(gaps[-1])

    def _read(self, view: MetadataView, s: int, start: int, count: int, ingest: list[float]) -> np.ndarray:
        """Lengths of [start, start+count) of source s, from the look-ahead or the view."""
        a_start, ahead = self._ahead[s]
        if a_start == start and ahead.size:
            return ahead
        t = time.perf_counter()
        raw = view.lengths(s, start, count)
        ingest[0] += (time.perf_counter() - t) * 1e3
        arr = np.asarray(raw)
        if arr.shape != (count,) or not (np.issubdtype(arr.dtype, np.integer) or arr.size == 0):
            raise ProtocolError(
                f"MetadataView.lengths({s}, {start}, {count}) returned {arr.dtype} shape {arr.shape};"
                f" it must return {count} integer lengths"
            )
        arr = arr.astype(np.int64, copy=False)
        if arr.size and int(arr.min()) < 0:
            raise ProtocolError(f"MetadataView.lengths({s}, {start}, {count}) returned a negative length")
        if not self._vision:
            return arr
        vision = getattr(view, "vision", None)
        if vision is None:  # a text-only view: no images anywhere
            return np.stack([arr, np.zeros_like(arr), np.zeros_like(arr)])
        t = time.perf_counter()
        images, patches = (np.asarray(x) for x in vision(s, start, count))
        ingest[0] += (time.perf_counter() - t) * 1e3
        where = f"MetadataView.vision({s}, {start}, {count})"
        for name, x in (("images", images), ("patches", patches)):
            if x.ndim != 1 or not (np.issubdtype(x.dtype, np.integer) or x.size == 0) or (x.size and int(x.min()) < 0):
                raise ProtocolError(
                    f"{where} returned {name} of {x.dtype} shape {x.shape}; it must be non-negative ints"
                )
        if images.size != count or int(images.sum()) != patches.size:
            raise ProtocolError(
                f"{where} returned {images.size} image counts summing to {int(images.sum())} for {patches.size}"
                f" patch counts; it must give one count per sample and one patch count per image"
            )
        return np.stack([arr, *moments(images.astype(np.int64), patches.astype(np.int64))])
