"""The picture side of a job: whether its micro-batches carry the image batch keys, how wide a patch row is,
and each source's transform name with the job's ``image_token_id`` bound (one rule for one node and a cluster).

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
from ..transforms import IMAGE_TOKEN, transform_call, vlm

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


def _vlm_args(source: SourceSpec) -> dict | None:
    """The vlm factory's arguments (defaults filled in) of a source whose transform is ``vlm(...)``, else None."""
    if source.transform is None:
        return None
    module, name, pos, kw = transform_call(source.transform)
    if (module, name) != _VLM:
        return None
    try:
        bound = inspect.signature(vlm).bind(*pos, **kw)
    except TypeError as e:
        raise ConfigError(f"source {source.name!r}: transform {source.transform!r}: {e}") from None
    return {**_VLM_DEFAULTS, **bound.arguments, "_given": set(bound.arguments)}


def image_keys(spec: JobSpec) -> ImageKeys | None:
    """The job's image keys (see the module docstring), or None for a job without pictures. ConfigError when
    its vlm sources cut patches of different sizes (one ``pixel_values`` cannot hold both)."""
    found = {(a["patch"], a["merge"]) for s in spec.sources if (a := _vlm_args(s)) is not None}
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
    """The transform name a source's loader runs: a ``vlm(...)`` transform gets the job's image_token_id
    (ConfigError when it names another one itself); any other transform as written."""
    args = _vlm_args(source)
    if args is None or source.transform is None:
        return source.transform
    want = spec.image_token_id
    if "image_token_id" in args["_given"]:
        if args["image_token_id"] != want:
            raise ConfigError(
                f"source {source.name!r}: transform {source.transform!r} sets image_token_id="
                f"{args['image_token_id']!r} but [job] image_token_id = {want}; remove it from the transform "
                f"(the job's id is used)"
            )
        return source.transform
    if want == IMAGE_TOKEN:
        return source.transform
    head, _, rest = source.transform.rstrip().partition("(")
    inner = rest[:-1].strip() if rest else ""
    return f"{head}({inner + ', ' if inner else ''}image_token_id={want})"
