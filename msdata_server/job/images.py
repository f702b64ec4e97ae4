"""The picture side of a job: whether its micro-batches carry the image batch keys, how wide a patch row is,
and each source's transform name with the job's ``image_token_id`` and ``seq_len`` bound (one rule for one node
and a cluster).

A vlm source that sets a max_pixels letting one image take more placeholder tokens than the job's seq_len is
refused wherever its arguments are read (``image_keys`` when a job starts, ``source_transform`` when a loader
opens): ConfigError from ``transforms.check_image_fits``. The default max_pixels is not refused (a job with a
short seq_len may well have only small images); any document whose placeholders exceed seq_len, one large image
or several together, is a bad sample of the transform (``image_tokens_exceed_seq_len``).

A job has pictures when a source's transform is the built-in ``vlm`` or its cost is ``"vlm"``; every micro-batch
of such a job carries the image keys (empty, with the right dtypes, when it holds text only), and those of
any other job carry none. A job has video when one of its vlm transforms sets ``video_key``: every micro-batch
then carries the video keys too (empty without a clip). Likewise a ``max_frames`` or ``video_max_pixels`` set
in a transform that lets one clip exceed seq_len is refused (``transforms.check_video_fits``).
"""

from __future__ import annotations

import inspect
from dataclasses import dataclass

from msdata_client.choices import CostKind
from msdata_client.spec import JobSpec, SourceSpec

from ..errors import ConfigError
from ..transforms import check_image_fits, check_video_fits, transform_call, vlm
from ..video import default_max_frames

__all__ = ["ImageKeys", "image_keys", "source_transform"]

_VLM = ("msdata_server.transforms", "vlm")
_VLM_DEFAULTS = {k: p.default for k, p in inspect.signature(vlm).parameters.items()}


@dataclass(frozen=True, slots=True, kw_only=True)
class ImageKeys:
    """The shape of a job's image keys: ``pixel_values`` rows are ``3 * patch * patch`` bytes; with ``video``
    (a temporal_patch), ``pixel_values_videos`` rows are ``3 * temporal_patch * patch * patch``."""

    patch: int
    merge: int
    video: int | None = None  # the temporal_patch of a job with video, else None

    @property
    def row(self) -> int:
        return 3 * self.patch * self.patch

    @property
    def video_row(self) -> int:
        """Bytes of a ``pixel_values_videos`` row (0 for a job without video)."""
        return 3 * (self.video or 0) * self.patch * self.patch


def _vlm_args(spec: JobSpec, source: SourceSpec) -> dict | None:
    """The vlm factory's arguments (defaults filled in) of a source whose transform is ``vlm(...)``, else None;
    ConfigError when one image at the max_pixels it sets cannot fit the job's seq_len."""
    if source.transform is None:
        return None
    module, name, pos, kw = transform_call(source.transform)
    if (module, name) != _VLM:
        return None
    try:
        bound = inspect.signature(vlm).bind(*pos, **kw)
    except TypeError as e:
        raise ConfigError(f"source {source.name!r}: transform {source.transform!r}: {e}") from None
    args = {**_VLM_DEFAULTS, **bound.arguments, "_given": set(bound.arguments)}
    _check_video(spec, source, args)
    if "max_pixels" not in args["_given"]:
        return args
    try:
        patch, merge, max_pixels = (int(args[k]) for k in ("patch", "merge", "max_pixels"))
    except (TypeError, ValueError):
        return args  # not integers: the factory names the bad value when the loader builds it
    if min(patch, merge, max_pixels) >= 1:
        check_image_fits(
            patch=patch, merge=merge, max_pixels=max_pixels, seq_len=spec.seq_len, where=f"source {source.name!r}"
        )
    return args


def _check_video(spec: JobSpec, source: SourceSpec, args: dict) -> None:
    """ConfigError when a max_frames or video_max_pixels the transform sets lets one clip exceed seq_len."""
    if args["video_key"] is None or not args["_given"] & {"max_frames", "video_max_pixels"}:
        return
    try:
        patch, merge, tp, vmax = (int(args[k]) for k in ("patch", "merge", "temporal_patch", "video_max_pixels"))
        frames = args["max_frames"]
        frames = int(frames) if frames is not None else None
    except (TypeError, ValueError):
        return  # not integers: the factory names the bad value when the loader builds it
    if min(patch, merge, tp, vmax) < 1:
        return
    if frames is None:
        frames = default_max_frames(
            seq_len=spec.seq_len, patch=patch, merge=merge, temporal_patch=tp, video_max_pixels=vmax
        )
    check_video_fits(
        patch=patch,
        merge=merge,
        temporal_patch=tp,
        max_frames=frames,
        video_max_pixels=vmax,
        seq_len=spec.seq_len,
        where=f"source {source.name!r}",
    )


def image_keys(spec: JobSpec) -> ImageKeys | None:
    """The job's image keys (see the module docstring), or None for a job without pictures. ConfigError when
    its vlm sources cut patches of different sizes (one ``pixel_values`` cannot hold both)."""
    args = [a for s in spec.sources if (a := _vlm_args(spec, s)) is not None]
    found = {(a["patch"], a["merge"]) for a in args}
    if len(found) > 1:
        raise ConfigError(
            f"job {spec.name!r}: its vlm sources cut images with different (patch, merge) {sorted(found)}; "
            f"pixel_values holds one patch size, so give every vlm transform the same patch and merge"
        )
    temporal = {a["temporal_patch"] for a in args if a["video_key"] is not None}
    if len(temporal) > 1:
        raise ConfigError(
            f"job {spec.name!r}: its vlm sources cut clips with different temporal_patch {sorted(temporal)}; "
            f"pixel_values_videos holds one row size, so give every vlm transform with video the same temporal_patch"
        )
    if found:
        patch, merge = found.pop()
        return ImageKeys(patch=int(patch), merge=int(merge), video=int(temporal.pop()) if temporal else None)
    if spec.balance.cost == CostKind.VLM:
        return ImageKeys(patch=int(_VLM_DEFAULTS["patch"]), merge=int(_VLM_DEFAULTS["merge"]))
    return None


def source_transform(spec: JobSpec, source: SourceSpec) -> str | None:
    """The transform name a source's loader runs: a ``vlm(...)`` transform gets the job's image_token_id,
    video_token_id and seq_len (ConfigError when it names other ones itself, or when one image or clip can exceed
    seq_len); any other transform as written."""
    args = _vlm_args(spec, source)
    if args is None or source.transform is None:
        return source.transform
    add = []
    for key, want in (
        ("image_token_id", spec.image_token_id),
        ("video_token_id", spec.video_token_id),
        ("seq_len", spec.seq_len),
    ):
        if key in args["_given"]:
            if args[key] != want:
                raise ConfigError(
                    f"source {source.name!r}: transform {source.transform!r} sets {key}={args[key]!r} but "
                    f"[job] {key} = {want}; remove it from the transform (the job's {key} is used)"
                )
        elif want != _VLM_DEFAULTS[key]:
            add.append(f"{key}={want}")
    if not add:
        return source.transform
    head, _, rest = source.transform.rstrip().partition("(")
    inner = rest[:-1].strip() if rest else ""
    return f"{head}({', '.join([inner, *add] if inner else add)})"
