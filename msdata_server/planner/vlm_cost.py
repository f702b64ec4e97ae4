"""The cost of vision-language documents in two stages, and how unevenly an assignment loads each stage.

The backbone costs ``alpha * L**2 + beta * L`` per sequence of L tokens (image placeholders and text alike);
the vision encoder ``alpha_v * p**2 + beta_v * p`` per block of p patches it attends within (an image; or one
temporal patch of a clip, so a clip of t temporal patches of h x w costs ``alpha_v * t * (h*w)**2 + beta_v *
t*h*w``), and a document costs the encoder the sum over its blocks. The two stages run one after the other
on every rank, so a rank that is light in one and heavy in the other still waits: balance wants both
imbalances (max / mean over ranks) near 1.
Pure numpy, vectorised; no Python loop per document.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from msdata_client.spec import VISION_ALPHA, VISION_BETA
from msdata_server.errors import ConfigError

from .cost import attention_cost

__all__ = [
    "StageImbalance",
    "VlmCost",
    "backbone_cost",
    "document_vision_cost",
    "image_patches",
    "image_placeholders",
    "load_imbalance",
    "stage_imbalance",
    "stage_loads",
    "vision_cost",
]


@dataclass(frozen=True, slots=True, kw_only=True)
class VlmCost:
    """The constants of both stages (defaults: the vlm4 workload's)."""

    alpha: float = 1.0
    beta: float = 4096.0
    alpha_v: float = VISION_ALPHA
    beta_v: float = VISION_BETA

    def __post_init__(self) -> None:
        for name in ("alpha", "beta", "alpha_v", "beta_v"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v) or v < 0:
                raise ConfigError(f"vlm cost {name}={v!r} must be a finite number >= 0")

    def from_moments(self, patches, patches_sq) -> np.ndarray:
        """float64 vision cost of documents from the sum of their images' patches and of their squares:
        ``alpha_v * sum(p**2) + beta_v * sum(p)``, the sum over images of vision_cost (how the planner prices)."""
        p1 = np.asarray(patches, dtype=np.float64)
        p2 = np.asarray(patches_sq, dtype=np.float64)
        return self.alpha_v * p2 + self.beta_v * p1

    def documents(self, lengths, patches, images_per_doc) -> np.ndarray:
        """float64 [2, n]: each document's backbone (row 0) and vision (row 1) cost; see document_vision_cost."""
        b = backbone_cost(lengths, alpha=self.alpha, beta=self.beta).reshape(-1)
        v = document_vision_cost(patches, images_per_doc, alpha_v=self.alpha_v, beta_v=self.beta_v)
        if b.size != v.size:
            raise ValueError(f"{b.size} lengths but {v.size} entries in images_per_doc; give one per document")
        return np.stack([b, v])


def backbone_cost(lengths, *, alpha: float = 1.0, beta: float = 4096.0) -> np.ndarray:
    """float64 ``alpha * L**2 + beta * L`` per sequence of L tokens (placeholders + text)."""
    return attention_cost(lengths, alpha=alpha, beta=beta)


def vision_cost(patches, *, alpha_v: float = 1.0, beta_v: float = 2048.0) -> np.ndarray:
    """float64 ``alpha_v * p**2 + beta_v * p`` per image of p patches."""
    return attention_cost(patches, alpha=alpha_v, beta=beta_v)


def image_patches(grid_thw) -> np.ndarray:
    """int64 patches per image, t * h * w, from an ``image_grid_thw`` array [n_images, 3]."""
    g = np.asarray(grid_thw, dtype=np.int64).reshape(-1, 3)
    return g.prod(axis=1)


def image_placeholders(grid_thw, *, merge: int = 2) -> np.ndarray:
    """int64 placeholder tokens per image, t * h * w / merge**2."""
    return image_patches(grid_thw) // (merge * merge)


def document_vision_cost(patches, images_per_doc, *, alpha_v: float = 1.0, beta_v: float = 2048.0) -> np.ndarray:
    """float64 vision cost per document: the sum over its images. ``patches`` lists every image's patch
    count, documents' images consecutive; ``images_per_doc`` says how many each document has (0 for text)."""
    counts = np.asarray(images_per_doc, dtype=np.int64).reshape(-1)
    per_image = vision_cost(patches, alpha_v=alpha_v, beta_v=beta_v).reshape(-1)
    if int(counts.sum()) != per_image.size or (counts < 0).any():
        raise ValueError(f"images_per_doc sums to {int(counts.sum())}, but {per_image.size} image patch counts given")
    doc = np.repeat(np.arange(counts.size), counts)
    return np.bincount(doc, weights=per_image, minlength=counts.size).astype(np.float64)


def stage_loads(rank, backbone, vision, dp: int) -> np.ndarray:
    """float64 [2, dp]: each rank's summed backbone (row 0) and vision (row 1) cost; rank -1 (carried) skipped."""
    r = np.asarray(rank, dtype=np.int64).reshape(-1)
    b = np.asarray(backbone, dtype=np.float64).reshape(-1)
    v = np.asarray(vision, dtype=np.float64).reshape(-1)
    if not (r.size == b.size == v.size):
        raise ValueError(f"rank, backbone and vision need one entry per document; got {r.size}, {b.size}, {v.size}")
    if r.size and int(r.max()) >= dp:
        raise ValueError(f"rank {int(r.max())} is not below {dp=}")
    keep = r >= 0
    return np.stack([np.bincount(r[keep], weights=x[keep], minlength=dp) for x in (b, v)]).astype(np.float64)


@dataclass(frozen=True, slots=True)
class StageImbalance:
    """max / mean load over ranks per stage: 1.0 is perfect, dp is everything on one rank (1.0 when idle)."""

    backbone: float
    vision: float


def load_imbalance(loads: np.ndarray) -> float:
    """max / mean of per-rank loads (1.0 when idle)."""
    mean = float(loads.mean()) if loads.size else 0.0
    return float(loads.max()) / mean if mean > 0 else 1.0


def stage_imbalance(rank, backbone, vision, dp: int) -> StageImbalance:
    """How unevenly an assignment (a rank per document, -1 = carried) loads the backbone and the encoder."""
    loads = stage_loads(rank, backbone, vision, dp)
    return StageImbalance(backbone=load_imbalance(loads[0]), vision=load_imbalance(loads[1]))
