"""Plumbing of the job specs: small validators whose messages carry the bad value and the fix.

(Allowed values of enumerated settings are parsed by `msdata_client.choices`.)
"""

from __future__ import annotations

import math
import os
import re
from collections.abc import Iterable, Iterator, Mapping, Sequence
from typing import Any

from msdata_client.choices import DEFAULT_TRANSFORM, ShuffleMode, is_import_path, is_transform_name
from msdata_client.errors import ConfigError

__all__ = [
    "FrozenMap",
    "check_float",
    "check_import_path",
    "check_int",
    "check_keys",
    "check_name",
    "check_shuffle",
    "check_str_tuple",
    "check_transform",
    "check_weights",
    "finite_sum",
    "resolve_path",
]

_NAME_RE = re.compile(r"[A-Za-z0-9_.-]{1,128}", re.ASCII)
_INT64_MAX = (1 << 63) - 1


class FrozenMap(Mapping[str, Any]):
    """An immutable, hashable mapping that keeps insertion order; equal to any mapping with the same items."""

    __slots__ = ("_d",)

    def __init__(self, items: Mapping[str, Any] | Sequence[tuple[str, Any]] = ()) -> None:
        self._d = dict(items)

    def __getitem__(self, key: str) -> Any:
        return self._d[key]

    def __iter__(self) -> Iterator[str]:
        return iter(self._d)

    def __len__(self) -> int:
        return len(self._d)

    def __hash__(self) -> int:
        return hash(frozenset(self._d.items()))

    def __repr__(self) -> str:
        return repr(self._d)


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _is_number(value: Any) -> bool:
    """A finite int or float (not a bool)."""
    return (_is_int(value) or isinstance(value, float)) and math.isfinite(value)


def check_int(where: str, value: Any, *, low: int, high: int = _INT64_MAX, fix: str) -> int:
    if not _is_int(value) or not low <= value <= high:
        bound = f">= {low}" if high == _INT64_MAX else f"in {low}..{high}"
        raise ConfigError(f"{where}={value!r} must be an integer {bound}; {fix}")
    return value


def check_float(where: str, value: Any, *, low: float = 0.0, strict: bool = False, fix: str) -> float:
    ok = _is_number(value)
    if ok:
        ok = value > low if strict else value >= low
    if not ok:
        raise ConfigError(f"{where}={value!r} must be a finite number {'>' if strict else '>='} {low:g}; {fix}")
    return float(value)


def check_name(where: str, value: Any) -> str:
    if not isinstance(value, str) or not _NAME_RE.fullmatch(value):
        raise ConfigError(
            f"{where}={value!r} is not a valid name; use 1 to 128 characters from [A-Za-z0-9_.-] (e.g. 'web_en')"
        )
    return value


def check_import_path(where: str, value: Any) -> str:
    if not is_import_path(value):
        raise ConfigError(f"{where}={value!r} must have the form 'module:function' (e.g. {DEFAULT_TRANSFORM!r})")
    return value


def check_transform(where: str, value: Any) -> str:
    if not is_transform_name(value):
        raise ConfigError(
            f"{where}={value!r} must have the form 'module:function' or 'module:factory(arguments)' "
            f"(e.g. {DEFAULT_TRANSFORM!r} or 'msdata_server.transforms:vlm(patch=14, merge=2)')"
        )
    return value


def check_str_tuple(where: str, value: Any, *, fix: str) -> tuple[str, ...]:
    if isinstance(value, str):
        value = (value,)
    if not isinstance(value, Sequence) or not all(isinstance(v, str) and v for v in value):
        raise ConfigError(f"{where}={value!r} must be a list of non-empty strings; {fix}")
    return tuple(value)


def check_keys(table: str, d: Any, allowed: Sequence[str]) -> Mapping[str, Any]:
    if not isinstance(d, Mapping):
        raise ConfigError(f"{table} must be a table of keys ({', '.join(allowed)}), got {type(d).__name__}: {d!r}")
    for key in d:
        if key not in allowed:
            raise ConfigError(f"unknown key {key!r} in {table}; allowed keys: {', '.join(allowed)}")
    return d


def check_weights(where: str, value: Any, *, all_zero_ok: bool = False) -> FrozenMap:
    if not isinstance(value, Mapping) or not value:
        raise ConfigError(f"{where}={value!r} must be a non-empty table of source = weight (e.g. {{ web = 0.7 }})")
    out: dict[str, float] = {}
    for key, w in value.items():
        if not isinstance(key, str):
            raise ConfigError(f"{where} key {key!r} must be a source name (a string)")
        if not _is_number(w):
            raise ConfigError(f"{where}[{key!r}]={w!r} must be a finite number >= 0")
        if w < 0:
            raise ConfigError(
                f"{where}[{key!r}]={w!r} is a negative weight; weights must be >= 0 (0 leaves a source out)"
            )
        out[key] = float(w)
    total = finite_sum(out.values())
    if total is None:
        raise ConfigError(
            f"{where}={dict(out)!r} sum to more than a float holds; scale the weights down (only their ratios count)"
        )
    if total <= 0 and not all_zero_ok:
        raise ConfigError(
            f"{where}={dict(out)!r} sums to 0 (all weights are zero); give at least one source a weight > 0"
        )
    return FrozenMap(out)


def finite_sum(values: Iterable[float]) -> float | None:
    """The exact sum of finite floats, or None when it overflows (math.fsum raises OverflowError then)."""
    try:
        total = math.fsum(values)
    except OverflowError:
        return None
    return total if math.isfinite(total) else None


_SHUFFLE_KEYS = ("mode", "spread", "window")
_SHUFFLE_FIX = "e.g. shuffle = { spread = 64 }, shuffle = { mode = 'file' } or shuffle = false (a fixed order)"


def check_shuffle(where: str, value: Any) -> bool | FrozenMap:
    """A `[[source]] shuffle` value: true (the default order), false (a fixed order) or a table of `mode`
    ('mix', 'file', 'none'), `spread` (files read at once, mix only, 2..1024) and `window` (rows shuffled
    together, 1..2**31-1; not with 'none'). A table comes back as a FrozenMap of the keys it set."""
    if isinstance(value, bool):
        return value
    if not isinstance(value, Mapping):
        keys = ", ".join(_SHUFFLE_KEYS)
        raise ConfigError(f"{where}={value!r} must be true, false or a table of {keys}; {_SHUFFLE_FIX}")
    check_keys(where, value, _SHUFFLE_KEYS)
    mode = ShuffleMode.parse(value.get("mode", ShuffleMode.MIX.value), f"{where} mode")
    out: dict[str, Any] = {}
    if "mode" in value:
        out["mode"] = mode.value
    if "spread" in value:
        if mode != ShuffleMode.MIX:
            raise ConfigError(f"{where} sets spread with mode={mode.value!r}; spread is the mixed order's, remove it")
        out["spread"] = check_int(f"{where} spread", value["spread"], low=2, high=1024, fix="32 (the default) or more")
    if "window" in value:
        if mode == ShuffleMode.NONE:
            raise ConfigError(f"{where} sets window with mode='none' (a fixed order shuffles nothing); remove window")
        fix = "4096 (the default) rows shuffled together"
        out["window"] = check_int(f"{where} window", value["window"], low=1, high=(1 << 31) - 1, fix=fix)
    return FrozenMap(out)


def resolve_path(path: str, base_dir: str | None) -> str:
    """`path` made absolute against `base_dir` (default: the working directory), with ~ expanded; a URI
    (``s3://bucket/...``, ``file:///...``) is kept as it is."""
    if "://" in path and path.split("://", 1)[0].replace("+", "").replace(".", "").replace("-", "").isalnum():
        return path
    path = os.path.expanduser(path)
    if not os.path.isabs(path):
        path = os.path.join(base_dir if base_dir is not None else os.getcwd(), path)
    return os.path.normpath(path)
