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
any other job carry none.
"""

from __future__ import annotations

import inspect
from dataclasses import dataclass

from msdata_client.choices import CostKind
from msdata_client.spec import JobSpec, SourceSpec

from ..errors import ConfigError
from ..transforms import check_image_fits, transform_call, vlm

__all__ = ["ImageKeys", "image_keys", "source_transform"]

_VLM = ("msdata_server.transforms", "vlm")
_VLM_DEFAULTS = {k: p.default for k, p in inspect.signature(vlm).parameters.items()}


@dataclass(frozen=True, slots=True, kw_only=True)
class ImageKeys:
    """The shape of a job's image keys: ``pixel_values`` rows are ``3 * patch * patch`` bytes."""

    patch: int
    merge: int

    @property
    def row(self) -> int:
        return 3 * self.patch * self.patch


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


def image_keys(spec: JobSpec) -> ImageKeys | None:
    """The job's image keys (see the module docstring), or None for a job without pictures. ConfigError when
    its vlm sources cut patches of different sizes (one ``pixel_values`` cannot hold both)."""
    found = {(a["patch"], a["merge"]) for s in spec.sources if (a := _vlm_args(spec, s)) is not None}
    if len(found) > 1:
        raise ConfigError(
            f"job {spec.name!r}: its vlm sources cut images with different (patch, merge) {sorted(found)}; "
            f"pixel_values holds one patch size, so give every vlm transform the same patch and merge"
        )
    if found:
        patch, merge = found.pop()
        return ImageKeys(patch=int(patch), merge=int(merge))
    if spec.balance.cost == CostKind.VLM:
        return ImageKeys(patch=int(_VLM_DEFAULTS["patch"]), merge=int(_VLM_DEFAULTS["merge"]))
    return None


def source_transform(spec: JobSpec, source: SourceSpec) -> str | None:
    """The transform name a source's loader runs: a ``vlm(...)`` transform gets the job's image_token_id and
    seq_len (ConfigError when it names other ones itself, or when one image can exceed seq_len); any other
    transform as written."""
    args = _vlm_args(spec, source)
    if args is None or source.transform is None:
        return source.transform
    add = []
    for key, want in (("image_token_id", spec.image_token_id), ("seq_len", spec.seq_len)):
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
