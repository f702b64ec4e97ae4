"""The standard benchmark workloads (a copy of ../shared/workloads.toml, so benchmarks run without it).

Document lengths in tokens are lognormal(median, sigma) clipped to [min, seq_len], drawn with a
numpy Generator seeded from (seed, workload, source, block): the length of an ordinal is a pure
function of those, so any range of ordinals can be generated in any order.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass

import numpy as np

__all__ = [
    "COST",
    "MANYSOURCES",
    "TEXT4",
    "VLM4",
    "VLM_VIDEO",
    "ClipDist",
    "ImageDist",
    "LengthDist",
    "SyntheticLengths",
    "SyntheticVideo",
    "SyntheticVlm",
    "VideoWorkload",
    "VlmWorkload",
    "Workload",
    "doc_moments",
    "image_sizes",
    "lengths",
    "video_docs",
    "vlm_docs",
]


@dataclass(frozen=True, slots=True, kw_only=True)
class LengthDist:
    """lognormal(log(median), sigma) rounded and clipped to [min, seq_len]."""

    median: float
    sigma: float
    min: int


@dataclass(frozen=True, slots=True, kw_only=True)
class Workload:
    name: str
    description: str
    seq_lens: tuple[int, ...]
    weights: dict[str, float]
    sources: dict[str, LengthDist]


TEXT4 = Workload(
    name="text4",
    description="four text sources, the default for balance, memory and end-to-end benchmarks",
    seq_lens=(4096, 8192, 16384),
    weights={"chat": 0.3, "web": 0.4, "code": 0.2, "books": 0.1},
    sources={
        "chat": LengthDist(median=300, sigma=0.8, min=16),
        "web": LengthDist(median=900, sigma=1.0, min=16),
        "code": LengthDist(median=2000, sigma=1.0, min=16),
        "books": LengthDist(median=8000, sigma=1.0, min=64),
    },
)

# per document: alpha * len**2 + beta * len (attention plus the linear layers)
COST = {"alpha": 1.0, "beta": 4096.0}

MANYSOURCES = {
    "description": "the memory benchmark: many Parquet sources shaped like real corpora",
    "sources": (8, 32, 64, 128),  # S; the headline figure is S = 64
    "ranks": 8,
    "workers_per_rank": 4,
    "files_per_source": 16,
    "row_groups_per_file": 8,
    "rows_per_row_group": 128,
    "text_median_bytes": 400,
    "text_sigma": 1.0,
    "seq_len": 4096,
}

BLOCK = 4096  # ordinals per independently seeded block


def _seed(*parts: object) -> int:
    return int.from_bytes(hashlib.blake2b(repr(parts).encode(), digest_size=8).digest(), "little")


def lengths(dist: LengthDist, n: int, seq_len: int, rng: np.random.Generator) -> np.ndarray:
    """n int64 lengths drawn from `dist`, clipped to [dist.min, seq_len]."""
    x = rng.lognormal(np.log(dist.median), dist.sigma, n)
    return np.clip(np.rint(x), dist.min, seq_len).astype(np.int64)


class SyntheticLengths:
    """A MetadataView over a workload: lengths(source, start, count), a pure function of the ordinals."""

    def __init__(self, workload: Workload, seq_len: int, *, seed: int = 0):
        self.workload, self.seq_len, self.seed = workload, seq_len, seed
        self.names = tuple(workload.sources)
        self._blocks: dict[tuple[int, int], np.ndarray] = {}

    def _block(self, source: int, block: int) -> np.ndarray:
        got = self._blocks.get((source, block))
        if got is None:
            name = self.names[source]
            rng = np.random.Generator(np.random.PCG64(_seed(self.seed, self.workload.name, name, block)))
            got = self._draw(name, rng)
            if len(self._blocks) > 4096:
                self._blocks.clear()
            self._blocks[(source, block)] = got
        return got

    def _draw(self, name: str, rng: np.random.Generator) -> np.ndarray:
        """One block of BLOCK documents of source ``name`` (the last axis indexes the documents)."""
        return lengths(self.workload.sources[name], BLOCK, self.seq_len, rng)

    def _range(self, source: int, start: int, count: int) -> np.ndarray:
        first, last = start // BLOCK, (start + count - 1) // BLOCK if count else start // BLOCK
        parts = [self._block(source, b) for b in range(first, last + 1)]
        flat = np.concatenate(parts, axis=-1) if len(parts) > 1 else parts[0]
        lo = start - first * BLOCK
        return flat[..., lo : lo + count]

    def lengths(self, source: int, start: int, count: int) -> np.ndarray:
        return self._range(source, start, count).copy()


# -- vlm4: vision-language (bench/vlm.py) -------------------------------------------------------------


@dataclass(frozen=True, slots=True, kw_only=True)
class ImageDist:
    """A picture document: one image whose side (sqrt of its area) is lognormal(median, sigma) clipped to
    [64, 4096] pixels, aspect ratio (width / height) exp(normal(0, aspect_sigma)); then text tokens
    lognormal(text_median, text_sigma), at least 4. Its length: the placeholders, then the text."""

    image_side_median: float
    image_side_sigma: float
    aspect_sigma: float
    text_median: float
    text_sigma: float


@dataclass(frozen=True, slots=True, kw_only=True)
class VlmWorkload:
    name: str
    description: str
    seq_lens: tuple[int, ...]
    weights: dict[str, float]  # share of tokens
    sources: dict[str, ImageDist | LengthDist]
    patch: int
    merge: int  # merge x merge patches -> one placeholder token
    min_pixels: int
    max_pixels: int  # larger images are resized down, aspect kept (smart_resize)
    cost: dict[str, float]  # backbone alpha, beta over the whole sequence; encoder alpha_v, beta_v per image


VLM4 = VlmWorkload(
    name="vlm4",
    description="vision-language: image-caption pairs, document images, two text sources (bench/vlm.py)",
    seq_lens=(8192, 16384),
    weights={"caption": 0.35, "docimg": 0.15, "web": 0.35, "code": 0.15},
    sources={
        "caption": ImageDist(
            image_side_median=512, image_side_sigma=0.5, aspect_sigma=0.35, text_median=40, text_sigma=0.6
        ),
        "docimg": ImageDist(
            image_side_median=1280, image_side_sigma=0.4, aspect_sigma=0.35, text_median=400, text_sigma=0.8
        ),
        "web": LengthDist(median=900, sigma=1.0, min=16),
        "code": LengthDist(median=2000, sigma=1.0, min=16),
    },
    patch=14,
    merge=2,
    min_pixels=3136,  # 56 x 56
    max_pixels=1048576,  # 1024 x 1024
    cost={"alpha": 1.0, "beta": 4096.0, "alpha_v": 1.0, "beta_v": 2048.0},
)

SIDE_MIN, SIDE_MAX = 64, 4096


def image_sizes(dist: ImageDist, n: int, rng: np.random.Generator) -> tuple[np.ndarray, np.ndarray]:
    """(height, width) in pixels of n images drawn from `dist`."""
    side = np.clip(rng.lognormal(np.log(dist.image_side_median), dist.image_side_sigma, n), SIDE_MIN, SIDE_MAX)
    aspect = np.exp(rng.normal(0.0, dist.aspect_sigma, n))
    h = np.maximum(1, np.rint(side / np.sqrt(aspect))).astype(np.int64)
    w = np.maximum(1, np.rint(side * np.sqrt(aspect))).astype(np.int64)
    return h, w


def vlm_docs(workload: VlmWorkload, name: str, n: int, seq_len: int, rng: np.random.Generator) -> np.ndarray:
    """int64 [2, n]: each document's length in tokens and its image's patches (0: text), as the vlm transform
    would make them (smart_resize with factor patch * merge; placeholders = patches / merge**2)."""
    from msdata_server.transforms import smart_resize

    dist = workload.sources[name]
    if isinstance(dist, LengthDist):
        return np.stack([lengths(dist, n, seq_len, rng), np.zeros(n, np.int64)])
    h, w = image_sizes(dist, n, rng)
    text = np.maximum(4, np.rint(rng.lognormal(np.log(dist.text_median), dist.text_sigma, n))).astype(np.int64)
    f = workload.patch * workload.merge
    patches = np.empty(n, np.int64)
    for i, (hh, ww) in enumerate(zip(h.tolist(), w.tolist())):
        th, tw = smart_resize(hh, ww, factor=f, min_pixels=workload.min_pixels, max_pixels=workload.max_pixels)
        patches[i] = (th // workload.patch) * (tw // workload.patch)
    return np.stack([patches // (workload.merge**2) + text, patches])


class SyntheticVlm(SyntheticLengths):
    """A MetadataView with `vision` over a VlmWorkload: a pure function of (seed, source, ordinal)."""

    def __init__(self, workload: VlmWorkload, seq_len: int, *, seed: int = 0):
        super().__init__(workload, seq_len, seed=seed)  # the same shape: name, sources

    def _draw(self, name: str, rng: np.random.Generator) -> np.ndarray:
        return vlm_docs(self.workload, name, BLOCK, self.seq_len, rng)

    def lengths(self, source: int, start: int, count: int) -> np.ndarray:
        return self._range(source, start, count)[0].copy()

    def vision(self, source: int, start: int, count: int) -> tuple[np.ndarray, np.ndarray]:
        """(images per sample, patches per image): one image per picture document, none for text."""
        patches = self._range(source, start, count)[1]
        images = (patches > 0).astype(np.int64)
        return images, patches[patches > 0].copy()


# -- vlm_video: vision-language with video (bench/vlm.py) -----------------------------------------------


@dataclass(frozen=True, slots=True, kw_only=True)
class ClipDist:
    """A clip document: duration seconds lognormal(median, sigma) clipped to [1, max], frame side lognormal(median,
    sigma) clipped to [64, 1920], aspect exp(normal(0, 0.2)); then text tokens lognormal(text_median, text_sigma),
    at least 4. Frames from the sampling rule; its length: the placeholders, then the text."""

    duration_median_s: float
    duration_sigma: float
    duration_max_s: float
    frame_side_median: float
    frame_side_sigma: float
    text_median: float
    text_sigma: float


@dataclass(frozen=True, slots=True, kw_only=True)
class VideoWorkload(VlmWorkload):
    temporal_patch: int
    fps: float
    video_min_pixels: int  # per frame
    video_max_pixels: int
    max_frames: dict[int, int]  # per seq_len: one clip's placeholders fit it


VLM_VIDEO = VideoWorkload(
    name="vlm_video",
    description="vision-language with video: captions, document images, short and long clips, web text",
    seq_lens=(8192, 16384),
    weights={"caption": 0.25, "docimg": 0.10, "clip": 0.20, "longclip": 0.15, "web": 0.30},
    sources={
        "caption": ImageDist(
            image_side_median=512, image_side_sigma=0.5, aspect_sigma=0.35, text_median=40, text_sigma=0.6
        ),
        "docimg": ImageDist(
            image_side_median=1280, image_side_sigma=0.4, aspect_sigma=0.35, text_median=400, text_sigma=0.8
        ),
        "clip": ClipDist(
            duration_median_s=6,
            duration_sigma=0.5,
            duration_max_s=30,
            frame_side_median=480,
            frame_side_sigma=0.3,
            text_median=60,
            text_sigma=0.6,
        ),
        "longclip": ClipDist(
            duration_median_s=60,
            duration_sigma=0.8,
            duration_max_s=600,
            frame_side_median=720,
            frame_side_sigma=0.3,
            text_median=200,
            text_sigma=0.8,
        ),
        "web": LengthDist(median=900, sigma=1.0, min=16),
    },
    patch=14,
    merge=2,
    min_pixels=3136,
    max_pixels=1048576,
    cost={"alpha": 1.0, "beta": 4096.0, "alpha_v": 1.0, "beta_v": 2048.0},
    temporal_patch=2,
    fps=2.0,
    video_min_pixels=3136,
    video_max_pixels=100352,  # 128 x 28 x 28 per frame: long clips fit 16k
    max_frames={8192: 96, 16384: 224},
)

FRAME_SIDE_MIN, FRAME_SIDE_MAX = 64, 1920


def video_docs(workload: VideoWorkload, name: str, n: int, seq_len: int, rng: np.random.Generator) -> np.ndarray:
    """int64 [3, n]: each document's length in tokens, its encoder blocks (an image: 1; a clip: its temporal
    patches; text: 0) and the patches of each block (a clip's h * w), as the vlm transform would make them."""
    from msdata_server.transforms import smart_resize
    from msdata_server.video import frame_count

    dist = workload.sources[name]
    if not isinstance(dist, ClipDist):
        length, patches = vlm_docs(workload, name, n, seq_len, rng)
        return np.stack([length, (patches > 0).astype(np.int64), patches])
    dur = np.clip(rng.lognormal(np.log(dist.duration_median_s), dist.duration_sigma, n), 1.0, dist.duration_max_s)
    side = np.clip(rng.lognormal(np.log(dist.frame_side_median), dist.frame_side_sigma, n), 64, 1920)
    aspect = np.exp(rng.normal(0.0, 0.2, n))
    h = np.maximum(1, np.rint(side / np.sqrt(aspect))).astype(np.int64)
    w = np.maximum(1, np.rint(side * np.sqrt(aspect))).astype(np.int64)
    text = np.maximum(4, np.rint(rng.lognormal(np.log(dist.text_median), dist.text_sigma, n))).astype(np.int64)
    f, tp = workload.patch * workload.merge, workload.temporal_patch
    max_frames = workload.max_frames[seq_len]
    blocks, per = np.empty(n, np.int64), np.empty(n, np.int64)
    for i, (d, hh, ww) in enumerate(zip(dur.tolist(), h.tolist(), w.tolist())):
        frames = frame_count(d, round(d * 30), fps=workload.fps, min_frames=4, max_frames=max_frames, temporal_patch=tp)
        th, tw = smart_resize(
            hh, ww, factor=f, min_pixels=workload.video_min_pixels, max_pixels=workload.video_max_pixels
        )
        blocks[i], per[i] = frames // tp, (th // workload.patch) * (tw // workload.patch)
    return np.stack([blocks * per // workload.merge**2 + text, blocks, per])


def doc_moments(workload: VlmWorkload, name: str, n: int, seq_len: int, rng: np.random.Generator) -> np.ndarray:
    """int64 [3, n]: each document's length, and the sum over its encoder blocks of their patches and of their
    squares (what the two-stage cost needs)."""
    if isinstance(workload, VideoWorkload):
        length, blocks, per = video_docs(workload, name, n, seq_len, rng)
        return np.stack([length, blocks * per, blocks * per * per])
    length, patches = vlm_docs(workload, name, n, seq_len, rng)
    return np.stack([length, patches, patches * patches])


class SyntheticVideo(SyntheticLengths):
    """A MetadataView with `vision` over a VideoWorkload: a pure function of (seed, source, ordinal)."""

    def __init__(self, workload: VideoWorkload, seq_len: int, *, seed: int = 0):
        super().__init__(workload, seq_len, seed=seed)  # type: ignore[arg-type]  # the same shape: name, sources

    def _draw(self, name: str, rng: np.random.Generator) -> np.ndarray:
        assert isinstance(self.workload, VideoWorkload)
        return video_docs(self.workload, name, BLOCK, self.seq_len, rng)

    def lengths(self, source: int, start: int, count: int) -> np.ndarray:
        return self._range(source, start, count)[0].copy()

    def vision(self, source: int, start: int, count: int) -> tuple[np.ndarray, np.ndarray]:
        """(encoder blocks per sample, patches per block): an image is one block, a clip one per temporal patch."""
        _, blocks, per = self._range(source, start, count)
        return blocks.copy(), np.repeat(per, blocks)
