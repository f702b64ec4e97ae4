"""A SourceLoader's buffer: the batches it read (or is reading), their payloads held until released.

Kept apart from the loader, which decides what to read and when; this module only accounts for what is held.
Invariants: ``ready`` is the number of payloads present and not released over the batches in the buffer and
``memory`` their bytes; a batch is dropped once it is filled, holds nothing and all its samples are released.
A batch may be filled in two parts, its first ``filled`` samples then the rest (the loader's first reads at
many sources: ``SourceLoader`` module doc); what is filled is final.
"""

from __future__ import annotations

import asyncio
import dataclasses

import numpy as np

from ..document import VlmSample
from ..sources.base import BadSample
from .ordinals import Partition

__all__ = ["ReadBatch", "ReadBuffer", "compact"]


def _held(p: object) -> bool:
    """Whether a payload slot holds a sample (a token array or a picture document), not a bad sample."""
    return p is not None and not isinstance(p, BadSample)


def compact(a):
    """Token ids held in the read-ahead as uint16 when they fit (byte tokens and vocabularies up to 65536):
    half the memory of int32 for every sample waiting to be built; constructors widen them anyway. A picture
    document (``transforms.VlmSample``) keeps its pixels as they are and compacts its tokens."""
    if isinstance(a, VlmSample):
        return dataclasses.replace(a, tokens=compact(a.tokens))
    if a.dtype.kind in "iu" and a.dtype.itemsize > 2 and a.size and int(a.min()) >= 0 and int(a.max()) <= 0xFFFF:
        return a.astype(np.uint16)
    return a


class ReadBatch:
    """One batch of ``batch`` consecutive ordinals: filled by its tasks (all at once, or its first ``filled``
    samples then the rest), then released sample by sample. ``event`` is set while no read of it is in flight."""

    __slots__ = (
        "error",
        "event",
        "filled",
        "held",
        "images",
        "index",
        "lengths",
        "nbytes",
        "patches",
        "payloads",
        "reading",
        "released",
        "start",
    )

    def __init__(self, index: int, start: int, size: int):
        self.index = index
        self.start = start
        self.event = asyncio.Event()
        self.lengths: np.ndarray | None = None
        # the vision figures, kept like the lengths: encoder blocks per sample, and the patches of every block (an
        # image's t*h*w, or h*w for each temporal patch of a clip: the encoder attends within each)
        self.images: np.ndarray | None = None
        self.patches: np.ndarray | None = None
        self.payloads: list | None = None
        self.released = np.zeros(size, dtype=bool)
        self.held = 0  # payloads present and not released
        self.nbytes = 0
        self.error: BaseException | None = None
        self.filled = 0  # samples [0, filled) are read (their lengths and payloads final)
        self.reading = False  # a read of samples from ``filled`` on is in flight

    @property
    def size(self) -> int:
        return self.released.size


class ReadBuffer:
    """The batches of one partition by global batch index, and what their payloads hold."""

    def __init__(self, part: Partition):
        self._part = part
        self.batches: dict[int, ReadBatch] = {}
        self.ready = 0
        self.memory = 0

    def get(self, b: int) -> ReadBatch | None:
        return self.batches.get(b)

    def __contains__(self, b: int) -> bool:
        return b in self.batches

    def add(self, b: int) -> ReadBatch:
        """A new, empty batch of global index b (replacing none: the caller checked)."""
        bs = ReadBatch(b, b * self._part.batch, self._part.batch)
        self.batches[b] = bs
        return bs

    def discard(self, bs: ReadBatch) -> None:
        """Forget a batch (a read of it failed) unless another has taken its place, and what its first part held."""
        if self.batches.get(bs.index) is bs:
            del self.batches[bs.index]
            self.ready -= bs.held
            self.memory -= bs.nbytes

    def fill(self, bs: ReadBatch, results: list, keep_below: int | None = None, at: int = 0) -> None:
        """Store the transformed samples [at, at+len(results)) of a batch (``at`` is what it has filled): lengths
        of all, payloads of those not released yet whose local sample index is below ``keep_below`` (None: all);
        the others' slots stay None, not released (``refill``)."""
        size = bs.size
        first = self._part.local_batch(bs.index) * self._part.batch
        keep = size if keep_below is None else max(0, keep_below - first)
        if bs.lengths is None:
            bs.lengths = np.zeros(size, dtype=np.int64)
            bs.images = np.zeros(size, dtype=np.int64)
            bs.payloads = [None] * size
        lengths, images, payloads = bs.lengths, bs.images, bs.payloads
        assert images is not None
        assert payloads is not None
        patches: list[np.ndarray] = [] if bs.patches is None else [bs.patches]
        held = mem = 0
        for i, r in enumerate(results, at):
            if isinstance(r, BadSample):
                payloads[i] = r  # kept so tokens() can say why; needs no release
                bs.released[i] = True
                continue
            lengths[i] = len(r)
            if isinstance(r, VlmSample) and (len(r.image_grid_thw) or len(r.video_grid_thw)):
                blocks = r.encoder_blocks()  # each image, and each temporal patch of each clip
                images[i] = len(blocks)
                patches.append(blocks)
            if not bs.released[i] and i < keep:
                payloads[i] = r = compact(r)
                held += 1
                mem += r.nbytes
        bs.held += held
        bs.nbytes += mem
        bs.filled = at + len(results)
        bs.patches = (
            (np.concatenate(patches) if len(patches) > 1 else patches[0]) if patches else np.zeros(0, dtype=np.int64)
        )
        if self.batches.get(bs.index) is bs:
            self.ready += held
            self.memory += mem
            if bs.filled == size and bs.held == 0 and bs.released.all():
                del self.batches[bs.index]

    def refill(self, bs: ReadBatch, idx: list[int], results: list) -> None:
        """Hold the payloads of samples ``idx`` of a filled batch, read again (slots still empty and not
        released; a bad sample is recorded as at ``fill``)."""
        assert bs.payloads is not None
        mine = self.batches.get(bs.index) is bs
        for i, r in zip(idx, results):
            if bs.payloads[i] is not None or bs.released[i]:
                continue
            if not _held(r):
                bs.payloads[i] = r
                bs.released[i] = True
                continue
            bs.payloads[i] = r = compact(r)
            bs.held += 1
            bs.nbytes += r.nbytes
            if mine:
                self.ready += 1
                self.memory += r.nbytes

    def release(self, ords: np.ndarray) -> None:
        """Free the payloads of ordinals; drop each batch left with none."""
        blist = ords // self._part.batch
        for b in np.unique(blist).tolist():
            bs = self.batches.get(b)
            if bs is None:
                continue
            idx = ords[blist == b] - bs.start
            idx = idx[~bs.released[idx]]
            if len(idx) == 0:
                continue
            bs.released[idx] = True
            if bs.payloads is not None:
                for i in idx.tolist():
                    p = bs.payloads[i]
                    if _held(p):
                        bs.held -= 1
                        bs.nbytes -= p.nbytes
                        self.ready -= 1
                        self.memory -= p.nbytes
                    bs.payloads[i] = None
                if bs.held == 0 and bs.filled == bs.size and bs.released.all():
                    del self.batches[b]

    def drop_before(self, j: int) -> None:
        """Drop the batches before local batch j (a seek past them)."""
        for gb in [gb for gb in self.batches if self._part.local_batch(gb) < j]:
            bs = self.batches.pop(gb)
            self.ready -= bs.held
            self.memory -= bs.nbytes

    def drop_from(self, b: int) -> None:
        """Drop the batches at or past global batch b (read ahead into another partitioning's batches)."""
        for gb in [gb for gb in self.batches if gb >= b]:
            bs = self.batches.pop(gb)
            self.ready -= bs.held
            self.memory -= bs.nbytes

    def held_ahead(self, high: int) -> int:
        """Payloads held beyond local sample index ``high`` (the highest asked for)."""
        n = 0
        for bs in self.batches.values():
            if bs.payloads is None or bs.held == 0:
                continue
            first = self._part.local_batch(bs.index) * self._part.batch
            i0 = max(0, high + 1 - first)
            n += sum(1 for p in bs.payloads[i0:] if _held(p))
        return n

    def close(self) -> None:
        """Wake every waiter and drop everything."""
        for bs in self.batches.values():
            bs.event.set()
        self.batches.clear()
        self.ready = self.memory = 0
