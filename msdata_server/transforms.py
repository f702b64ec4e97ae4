"""Per-sample transforms (record -> array) and how they are named, loaded and applied.

Convention: ``fn(record, rng=Generator seeded from (seed, sample_id))``; a sample's length is
``len(result)``; token arrays are int32. A transform raises BadSampleError for a bad record (the sample is
skipped and counted). A transform that ignores ``rng`` may set ``fn.needs_rng = False``: it then gets
``rng=None`` and no generator is built per sample. Names are ``"module:function"``, or
``"module:factory(arg, key=value)"`` to build a transform from a factory such as ``hf_tokenizer``.
"""

from __future__ import annotations

import ast
import functools
import io
import math
import re
from typing import Any, Callable

import numpy as np

from ._imports import import_callable
from .errors import BadSampleError, ConfigError
from .sources.base import BadSample
from .sources.order import make_rng

__all__ = [
    "EOS",
    "byte_tokens",
    "hf_tokenizer",
    "identity",
    "image_patches",
    "load_transform",
    "parse_transform_name",
    "run_transform",
]

EOS = 256
_NAME = re.compile(r"^\s*([A-Za-z_][\w.]*)\s*:\s*([A-Za-z_]\w*)\s*(?:\((.*)\))?\s*$", re.S)


class _Bad(BadSampleError):
    """A BadSampleError that carries its reason (one of sources.base.BAD_REASONS)."""

    def __init__(self, reason: str, message: str):
        super().__init__(message)
        self.reason = reason


def byte_tokens(record, **_) -> np.ndarray:
    """Text -> its UTF-8 bytes as int32 ids 0..255, then EOS 256. Invalid UTF-8 raises BadSampleError."""
    if isinstance(record, str):
        try:
            data = record.encode("utf-8")
        except UnicodeEncodeError as e:  # lone surrogates from a lax decoder
            raise _Bad("invalid_utf8", f"text is not valid UTF-8: {e}") from None
    elif isinstance(record, (bytes, bytearray, memoryview)):
        data = bytes(record)
        try:
            data.decode("utf-8")
        except UnicodeDecodeError as e:
            raise _Bad("invalid_utf8", f"text is not valid UTF-8: {e}") from None
    else:
        raise _Bad("transform_error", f"byte_tokens needs str or bytes, got {type(record).__name__}")
    out = np.empty(len(data) + 1, dtype=np.int32)
    out[:-1] = np.frombuffer(data, dtype=np.uint8)
    out[-1] = EOS
    return out


byte_tokens.needs_rng = False


def identity(record, **_) -> np.ndarray:
    """The transform of ``transform = None``: records that already are token arrays (synthetic, pre-tokenized)."""
    if isinstance(record, np.ndarray):
        return record
    if isinstance(record, (list, tuple)):
        return np.asarray(record, dtype=np.int32)
    raise _Bad(
        "transform_error",
        f"no transform for a {type(record).__name__} record; set transform (e.g. msdata_server.transforms:byte_tokens)",
    )


identity.needs_rng = False


def hf_tokenizer(path: str, *, eos: int | None = None, add_special_tokens: bool = False) -> Callable:
    """A transform tokenizing text with a local tokenizer.json (package ``tokenizers``), then ``eos`` if given."""
    try:
        from tokenizers import Tokenizer
    except ImportError:
        raise ConfigError(
            "transform hf_tokenizer needs the 'tokenizers' package: pip install tokenizers"
        ) from None
    try:
        tok = Tokenizer.from_file(str(path))
    except Exception as e:
        raise ConfigError(f"hf_tokenizer: cannot load tokenizer file {path!r}: {e}") from None

    def tokenize(record, **_) -> np.ndarray:
        if isinstance(record, (bytes, bytearray, memoryview)):
            try:
                record = bytes(record).decode("utf-8")
            except UnicodeDecodeError as e:
                raise _Bad("invalid_utf8", f"text is not valid UTF-8: {e}") from None
        if not isinstance(record, str):
            raise _Bad("transform_error", f"hf_tokenizer needs str or bytes, got {type(record).__name__}")
        ids = tok.encode(record, add_special_tokens=add_special_tokens).ids
        if eos is not None:
            ids.append(eos)
        return np.asarray(ids, dtype=np.int32)

    tokenize.needs_rng = False
    return tokenize


def image_patches(record, *, rng, patch: int = 16, grid: tuple[int, int] = (16, 16), **_) -> np.ndarray:
    """Image bytes -> uint8 [grid_h * grid_w, patch * patch * 3]: decode (Pillow), random crop of 50-100 %
    of the area, resize to grid * patch pixels, cut into patches. ``len()`` is the token count."""
    try:
        from PIL import Image, UnidentifiedImageError
    except ImportError:
        raise ConfigError("transform image_patches needs Pillow: pip install Pillow") from None
    gh, gw = grid
    try:
        with Image.open(io.BytesIO(bytes(record))) as im:
            img = im.convert("RGB")
    except (UnidentifiedImageError, OSError, ValueError, TypeError) as e:
        raise _Bad("corrupt", f"image does not decode: {e}") from None
    w, h = img.size
    scale = math.sqrt(rng.uniform(0.5, 1.0))
    cw, ch = max(1, round(w * scale)), max(1, round(h * scale))
    x0, y0 = int(rng.integers(0, w - cw + 1)), int(rng.integers(0, h - ch + 1))
    img = img.resize((gw * patch, gh * patch), Image.Resampling.BILINEAR, box=(x0, y0, x0 + cw, y0 + ch))
    a = np.asarray(img, dtype=np.uint8).reshape(gh, patch, gw, patch, 3)
    return np.ascontiguousarray(a.transpose(0, 2, 1, 3, 4)).reshape(gh * gw, patch * patch * 3)


def _parse_args(text: str) -> tuple[list, dict]:
    """Arguments of ``factory(a, k=v)``: Python literals, or bare words taken as strings."""
    call = ast.parse(f"f({text})", mode="eval").body
    if not isinstance(call, ast.Call) or any(k.arg is None for k in call.keywords):
        raise SyntaxError("not a plain argument list")

    def value(node):
        try:
            return ast.literal_eval(node)
        except ValueError:
            return ast.unparse(node)

    return [value(a) for a in call.args], {k.arg: value(k.value) for k in call.keywords}


def parse_transform_name(path: str) -> tuple[str, str, str | None]:
    """(module, function, argument text or None) of a transform name, without importing anything."""
    m = _NAME.match(path) if isinstance(path, str) else None
    if m is None:
        raise ConfigError(
            f"transform {path!r} must look like 'module:function' or 'module:factory(args)', "
            f"e.g. 'msdata_server.transforms:byte_tokens'"
        )
    return m.group(1), m.group(2), m.group(3)


@functools.lru_cache(maxsize=64)
def load_transform(path: str | None) -> Callable:
    """``"module:function"`` (or ``"module:factory(args)"``) -> the callable; None -> identity."""
    if path is None:
        return identity
    module, name, args = parse_transform_name(path)
    fn = import_callable("transform", path, module, name)
    if args is not None:
        try:
            pos, kw = _parse_args(args)
        except SyntaxError as e:
            raise ConfigError(f"transform {path!r}: cannot parse the arguments ({e.msg})") from None
        fn = fn(*pos, **kw)
        if not callable(fn):
            raise ConfigError(f"transform {path!r}: the factory did not return a callable")
    return fn


def run_transform(fn: Callable, records: list, *, seed: int, sample_ids) -> list[Any]:
    """Apply fn to each record; a record that is already a BadSample, or on which fn raises, yields a
    BadSample. Each sample's rng is seeded from (seed, sample_id), so results do not depend on batching."""
    needs_rng = getattr(fn, "needs_rng", True)
    ids = np.asarray(sample_ids, dtype=np.int64).tolist()
    out: list[Any] = []
    for rec, sid in zip(records, ids):
        if isinstance(rec, BadSample):
            out.append(rec)
            continue
        try:
            res = fn(rec, rng=make_rng(seed, sid) if needs_rng else None)
            if not isinstance(res, np.ndarray):
                res = np.asarray(res)
            if res.ndim == 0:
                raise _Bad("transform_error", f"transform returned a {res.dtype} scalar; it must return an array")
        except BadSampleError as e:
            out.append(BadSample(getattr(e, "reason", "transform_error"), f"sample {sid}", str(e)))
        except Exception as e:
            out.append(BadSample("transform_error", f"sample {sid}", f"{type(e).__name__}: {e}"))
        else:
            out.append(res)
    return out
