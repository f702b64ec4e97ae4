"""Per-sample transforms (record -> array) and how they are named, loaded and applied.

Convention: ``fn(record, rng=Generator seeded from (seed, sample_id))``; a sample's length is
``len(result)``; token arrays are int32. A transform raises BadSampleError for a bad record (the sample is
skipped and counted). A transform that ignores ``rng`` may set ``fn.needs_rng = False``: it then gets
``rng=None`` and no generator is built per sample. Names are ``"module:function"``, or
``"module:factory(arg, key=value)"`` to build a transform from a factory such as ``hf_tokenizer``.
A picture document (``vlm``) comes back as a ``VlmSample``: tokens plus the pixels of its images.
"""

from __future__ import annotations

import ast
import functools
import io
import math
import os
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any, TypeVar

import numpy as np

from msdata_client.choices import TRANSFORM_NAME
from msdata_client.spec import IMAGE_TOKEN_ID, VIDEO_TOKEN_ID

from ._imports import import_callable
from .document import VlmSample
from .errors import BadSampleError, ConfigError
from .sources.base import BadSample
from .sources.order import make_rng
from .video import decode_clip, default_max_frames

__all__ = [
    "EOS",
    "IMAGE_TOKEN",
    "MAX_IMAGE_PIXELS_ENV",
    "byte_tokens",
    "check_image_fits",
    "check_video_fits",
    "hf_tokenizer",
    "identity",
    "image_patches",
    "load_transform",
    "max_image_pixels",
    "max_image_tokens",
    "max_video_tokens",
    "parse_transform_name",
    "run_transform",
    "smart_resize",
    "transform_call",
    "vlm",
]

EOS = 256
IMAGE_TOKEN = IMAGE_TOKEN_ID  # the default image placeholder id ([job] image_token_id)
VIDEO_TOKEN = VIDEO_TOKEN_ID  # the default video placeholder id ([job] video_token_id)
_NAME = TRANSFORM_NAME


class _Bad(BadSampleError):
    """A BadSampleError that carries its reason (one of sources.base.BAD_REASONS)."""

    def __init__(self, reason: str, message: str):
        super().__init__(message)
        self.reason = reason


_F = TypeVar("_F", bound=Callable[..., Any])


def _without_rng(fn: _F) -> _F:
    """Mark a transform that ignores ``rng``: it gets ``rng=None`` and no generator is built per sample."""
    fn.needs_rng = False  # type: ignore[attr-defined]  # functions take attributes; Callable does not say so
    return fn


@_without_rng
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


@_without_rng
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


def hf_tokenizer(path: str, *, eos: int | None = None, add_special_tokens: bool = False) -> Callable:
    """A transform tokenizing text with a local tokenizer.json (package ``tokenizers``), then ``eos`` if given.

    Its ``batch`` tokenizes a task's records in one ``encode_batch`` call (what ``run_transform`` uses): the
    library's own speed, which one ``encode`` per record falls well short of (``bench/tokenize.py``). In a pool
    worker it runs on one thread (the pool is the parallelism; ``pool.worker``)."""
    try:
        from tokenizers import Tokenizer
    except ImportError:
        raise ConfigError("transform hf_tokenizer needs the 'tokenizers' package: pip install tokenizers") from None
    try:
        tok = Tokenizer.from_file(str(path))
    except Exception as e:
        raise ConfigError(f"hf_tokenizer: cannot load tokenizer file {path!r}: {e}") from None
    # the same ids without the character offsets (tokenizers >= 0.20), which nothing here reads
    encode_batch = getattr(tok, "encode_batch_fast", tok.encode_batch)
    tail = [] if eos is None else [eos]

    def text(record) -> str:
        if isinstance(record, (bytes, bytearray, memoryview)):
            try:
                return bytes(record).decode("utf-8")
            except UnicodeDecodeError as e:
                raise _Bad("invalid_utf8", f"text is not valid UTF-8: {e}") from None
        if not isinstance(record, str):
            raise _Bad("transform_error", f"hf_tokenizer needs str or bytes, got {type(record).__name__}")
        return record

    @_without_rng
    def tokenize(record, **_) -> np.ndarray:
        return np.array(tok.encode(text(record), add_special_tokens=add_special_tokens).ids + tail, dtype=np.int32)

    def tokenize_batch(records: list) -> list[np.ndarray | BadSampleError]:
        """Each record's tokens (or the BadSampleError that makes it a bad sample), in order."""
        out: list[np.ndarray | BadSampleError | None] = [None] * len(records)
        texts: list[str] = []
        at: list[int] = []
        for i, rec in enumerate(records):
            try:
                texts.append(text(rec))
                at.append(i)
            except BadSampleError as e:
                out[i] = e
        for i, enc in zip(at, encode_batch(texts, add_special_tokens=add_special_tokens), strict=True):
            out[i] = np.array(enc.ids + tail, dtype=np.int32)
        return out  # type: ignore[return-value]  # every None was replaced

    tokenize.batch = tokenize_batch  # type: ignore[attr-defined]  # functions take attributes; Callable does not say so
    return tokenize


MAX_IMAGE_PIXELS_ENV = "MSDATA_MAX_IMAGE_PIXELS"  # [node] max_image_pixels, as the server hands it to its workers
DEFAULT_MAX_IMAGE_PIXELS = 50_000_000
_CROP_SIDE = 1 / math.sqrt(0.5)  # image_patches crops at least half the area: each side at least 1/_CROP_SIDE


def max_image_pixels() -> int:
    """The most pixels one image may decode to in this process ([node] max_image_pixels, through the
    environment the server gives its transform workers)."""
    try:
        return int(os.environ.get(MAX_IMAGE_PIXELS_ENV, DEFAULT_MAX_IMAGE_PIXELS))
    except ValueError:
        return DEFAULT_MAX_IMAGE_PIXELS


def _bound_decode(im, least: tuple[int, int], what: str) -> None:
    """Before the pixels are decoded: a JPEG decodes at 1/2, 1/4 or 1/8 scale (DCT scaling, Pillow's draft) while
    it stays at least ``least`` (w, h); an image that still decodes to more than max_image_pixels() is an
    oversize bad sample (a 144-megapixel PNG costs seconds and gigabytes: issue 25, item 10)."""
    w, h = im.size
    if im.format == "JPEG" and (w >= 2 * least[0] and h >= 2 * least[1]):
        im.draft("RGB", least)
    dw, dh = im.size
    limit = max_image_pixels()
    if dw * dh > limit:
        raise _Bad(
            "oversize",
            f"{what}: {w}x{h} pixels decode to {dw * dh} > [node] max_image_pixels = {limit}; shrink the image "
            f"or raise max_image_pixels in node.toml",
        )


def image_patches(record, *, rng, patch: int = 16, grid: tuple[int, int] = (16, 16), **_) -> np.ndarray:
    """Image bytes -> uint8 [grid_h * grid_w, patch * patch * 3]: decode (Pillow), random crop of 50-100 %
    of the area, resize to grid * patch pixels, cut into patches. ``len()`` is the token count."""
    try:
        from PIL import Image, UnidentifiedImageError
    except ImportError:
        raise ConfigError("transform image_patches needs Pillow: pip install Pillow") from None
    gh, gw = grid
    try:
        with Image.open(io.BytesIO(bytes(record))) as im:  # reads the header only
            least = math.ceil(gw * patch * _CROP_SIDE), math.ceil(gh * patch * _CROP_SIDE)
            _bound_decode(im, least, "image")  # the smallest crop still covers the grid without upscaling
            img = im.convert("RGB")
    except _Bad:
        raise
    except Image.DecompressionBombError as e:
        raise _Bad("oversize", f"image: {e}") from None
    except (UnidentifiedImageError, OSError, ValueError, TypeError) as e:
        raise _Bad("corrupt", f"image does not decode: {e}") from None
    w, h = img.size
    scale = math.sqrt(rng.uniform(0.5, 1.0))
    cw, ch = max(1, round(w * scale)), max(1, round(h * scale))
    x0, y0 = int(rng.integers(0, w - cw + 1)), int(rng.integers(0, h - ch + 1))
    img = img.resize((gw * patch, gh * patch), Image.Resampling.BILINEAR, box=(x0, y0, x0 + cw, y0 + ch))
    a = np.asarray(img, dtype=np.uint8).reshape(gh, patch, gw, patch, 3)
    return np.ascontiguousarray(a.transpose(0, 2, 1, 3, 4)).reshape(gh * gw, patch * patch * 3)


MAX_ASPECT = 200  # Qwen2-VL refuses images whose long side is more than 200 times the short one


def smart_resize(
    height: int, width: int, *, factor: int = 28, min_pixels: int = 56 * 56, max_pixels: int = 1024 * 1024
) -> tuple[int, int]:
    """(height, width) to resize an image to: both multiples of ``factor``, area within [min_pixels,
    max_pixels], aspect ratio kept as nearly as that allows. Qwen2-VL's rule; where its rounding leaves the
    bounds (bounds closer than its rounding steps) the closest aspect ratio inside them is taken instead.
    ValueError for an aspect ratio over MAX_ASPECT or bounds that no multiple of factor fits."""
    if height < 1 or width < 1:
        raise ValueError(f"image {height=} {width=} must be at least 1 pixel")
    if max(height, width) > MAX_ASPECT * min(height, width):
        raise ValueError(f"aspect ratio {max(height, width) / min(height, width):.0f} > {MAX_ASPECT}")
    lo, hi = -(-min_pixels // (factor * factor)), max_pixels // (factor * factor)  # area in factor x factor blocks
    if lo > hi:
        raise ValueError(f"no multiple of {factor} x {factor} blocks has an area in [{min_pixels}, {max_pixels}]")
    h_bar = max(factor, round(height / factor) * factor)
    w_bar = max(factor, round(width / factor) * factor)
    if h_bar * w_bar > max_pixels:
        beta = math.sqrt(height * width / max_pixels)
        h_bar = max(factor, math.floor(height / beta / factor) * factor)
        w_bar = max(factor, math.floor(width / beta / factor) * factor)
    elif h_bar * w_bar < min_pixels:
        beta = math.sqrt(min_pixels / (height * width))
        h_bar = math.ceil(height * beta / factor) * factor
        w_bar = math.ceil(width * beta / factor) * factor
    if min_pixels <= h_bar * w_bar <= max_pixels:
        return h_bar, w_bar
    # every block height H from 1 up, with the block width closest to the aspect ratio that keeps the area
    hs = np.arange(1, hi + 1, dtype=np.int64)
    ws = np.clip(np.rint(hs * (width / height)), -(-lo // hs), hi // hs)
    ok = ws >= np.maximum(1, -(-lo // hs))
    err = np.where(ok, np.abs(np.log(np.maximum(ws, 1) / hs * (height / width))), np.inf)
    k = int(np.argmin(err))
    return int(hs[k]) * factor, int(ws[k]) * factor


def max_image_tokens(*, patch: int, merge: int, max_pixels: int) -> int:
    """The most placeholder tokens one image can take in a ``vlm`` transform: its area at most max_pixels, in
    blocks of ``patch * merge`` pixels squared (one placeholder each), as ``smart_resize`` never exceeds it."""
    return max_pixels // (patch * merge) ** 2


def check_image_fits(*, patch: int, merge: int, max_pixels: int, seq_len: int, where: str = "vlm") -> None:
    """ConfigError when one image at max_pixels alone takes more placeholder tokens than seq_len: the images of a
    document go with its first piece, which is at most seq_len tokens, so such an image could never be delivered
    (``job.images`` applies it to a max_pixels a job's vlm transform sets)."""
    n = max_image_tokens(patch=patch, merge=merge, max_pixels=max_pixels)
    if n > seq_len:
        factor = patch * merge
        raise ConfigError(
            f"{where}: max_pixels={max_pixels} lets one image take up to {n} placeholder tokens "
            f"(max_pixels // ({patch} * {merge})**2), more than seq_len={seq_len}; a document's images must fit in "
            f"one row, so lower max_pixels to at most {seq_len * factor * factor} or raise [job] seq_len to at "
            f"least {n}"
        )


def _keys(spec: str) -> tuple[str, ...]:
    """``"jpg;png"`` -> ("jpg", "png"): the first of them that a record holds is used (WebDataset's habit)."""
    keys = tuple(k.strip() for k in str(spec).split(";") if k.strip())
    if not keys:
        raise ConfigError(f"vlm: key {spec!r} must name a field, e.g. 'image' or 'jpg;png'")
    return keys


def _lookup(record: Mapping, keys: tuple[str, ...]) -> Any:
    for k in keys:
        v = record.get(k)
        if v is not None:
            return v
    return None


def vlm(
    patch: int = 14,
    merge: int = 2,
    min_pixels: int = 56 * 56,
    max_pixels: int = 1024 * 1024,
    image_key: str = "image",
    text_key: str = "caption",
    image_token_id: int = IMAGE_TOKEN,
    tokenizer: str | None = None,
    eos: int | None = None,
    seq_len: int | None = None,
    video_key: str | None = None,
    fps: float = 2.0,
    min_frames: int = 4,
    max_frames: int | None = None,
    temporal_patch: int = 2,
    video_min_pixels: int = 128 * 28 * 28,
    video_max_pixels: int = 768 * 28 * 28,
    video_token_id: int = VIDEO_TOKEN,
) -> Callable:
    """A transform for image-text records (a dict: ``columns = [...]`` or a WebDataset sample) -> VlmSample.

    Each image (encoded bytes, or a list of them for an interleaved sample) is decoded with Pillow (a corrupt
    one makes the sample bad), made RGB (transparency over white), resized by ``smart_resize`` to multiples of
    ``patch * merge`` with its area in [min_pixels, max_pixels] (bicubic; a JPEG much larger than that is
    decoded at a reduced scale first) and cut into ``patch x patch`` patches in Qwen2-VL order (the merge x
    merge patches of one placeholder adjacent; a patch flattened channel, row, column). Tokens: per image
    ``t*h*w / merge**2`` placeholders ``image_token_id``, then the text as byte tokens with EOS 256 (or with
    ``tokenizer``, a tokenizer.json, then ``eos`` if given). Keys may list alternatives: ``"jpg;png"``.

    ``seq_len`` (a job sets it to its ``[job] seq_len``, as it does ``image_token_id``): a document's images go
    with its first piece, so a sample whose placeholders alone exceed seq_len is a bad sample
    (``image_tokens_exceed_seq_len``). A job refuses a max_pixels it sets whose one image could exceed it
    (``check_image_fits``).

    Video (``video_key`` set, e.g. ``"mp4;webm;mkv"``): each clip is sampled and cut into temporal patches by
    ``_VideoSide`` (see ``video.py``); its placeholders ``video_token_id`` follow the images'. A record may then
    have images, clips, both or neither; without ``video_key`` the image field is required as before.
    """
    try:
        from PIL import Image
    except ImportError:
        raise ConfigError("transform vlm needs Pillow: pip install 'msdata[vlm]' (or pip install pillow)") from None
    for name, v in (("patch", patch), ("merge", merge), ("min_pixels", min_pixels), ("max_pixels", max_pixels)):
        if isinstance(v, bool) or not isinstance(v, int) or v < 1:
            raise ConfigError(f"vlm: {name}={v!r} must be an integer >= 1")
    if isinstance(image_token_id, bool) or not isinstance(image_token_id, int) or image_token_id < 0:
        raise ConfigError(f"vlm: {image_token_id=} must be an integer >= 0")
    video = _video_setup(
        video_key,
        patch=patch,
        merge=merge,
        seq_len=seq_len,
        fps=fps,
        min_frames=min_frames,
        max_frames=max_frames,
        temporal_patch=temporal_patch,
        video_min_pixels=video_min_pixels,
        video_max_pixels=video_max_pixels,
        video_token_id=video_token_id,
    )
    if seq_len is not None and (isinstance(seq_len, bool) or not isinstance(seq_len, int) or seq_len < 1):
        raise ConfigError(f"vlm: {seq_len=} must be an integer >= 1 (the job's seq_len) or None")
    factor = patch * merge
    if -(-min_pixels // factor**2) > max_pixels // factor**2:
        raise ConfigError(
            f"vlm: no image of whole {factor}x{factor} blocks has an area in [{min_pixels=}, {max_pixels=}]; "
            f"raise max_pixels to at least {-(-min_pixels // factor**2) * factor**2}"
        )
    room = seq_len if seq_len is not None else math.inf  # placeholders a document may have
    image_keys, text_keys = _keys(image_key), _keys(text_key)
    text_tokens = byte_tokens if tokenizer is None else hf_tokenizer(tokenizer, eos=eos)
    per_token = merge * merge
    row = 3 * patch * patch

    @_without_rng
    def transform(record, **_) -> VlmSample:
        if not isinstance(record, Mapping):
            raise _Bad(
                "transform_error",
                f"vlm needs a record with fields {image_key!r} and {text_key!r}, got a {type(record).__name__}; "
                f"set columns = [...] in the source (or use format = 'webdataset')",
            )
        images, text = _lookup(record, image_keys), _lookup(record, text_keys)
        if video is not None and images is None:
            images = ()  # with video a record need not have images
        if images is None or text is None:
            which = [k for k, v in ((image_key, images), (text_key, text)) if v is None]
            raise _Bad("missing_field", f"the record has no {which} (fields: {sorted(record)[:10]})")
        if isinstance(images, (bytes, bytearray, memoryview)):
            images = [images]
        elif not isinstance(images, (list, tuple, np.ndarray)):
            raise _Bad("corrupt", f"field {image_key!r} holds a {type(images).__name__}, not image bytes or a list")
        pixels, grids, n_ph = [], [], 0
        for i, blob in enumerate(images):
            px = _image_patches(Image, blob, i, patch=patch, merge=merge, min_pixels=min_pixels, max_pixels=max_pixels)
            pixels.append(px)
            grids.append(px.grid)
            n_ph += math.prod(px.grid) // per_token
            if n_ph > room:  # the rest need not be decoded
                raise _Bad(
                    "image_tokens_exceed_seq_len",
                    f"{_counted(i + 1, len(images))}: {n_ph} image placeholder tokens, more than "
                    f"seq_len={seq_len}; a document's images go in one row with their placeholders: raise "
                    f"[job] seq_len or lower the vlm transform's max_pixels (now {max_pixels})",
                )
        clips = video.clips(record, room - n_ph) if video is not None else None
        ids = text_tokens(text)
        grid = np.array(grids, dtype=np.int64).reshape(-1, 3)
        n_v = clips.placeholders if clips is not None else 0
        tokens = np.empty(n_ph + n_v + len(ids), dtype=np.int32)
        tokens[:n_ph] = image_token_id
        tokens[n_ph : n_ph + n_v] = video_token_id
        tokens[n_ph + n_v :] = ids
        pv = np.concatenate([p.values for p in pixels]) if pixels else np.zeros((0, row), dtype=np.uint8)
        return VlmSample(tokens, pv, grid, *((clips.values, clips.grid) if clips is not None and n_v else ()))

    return transform


def max_video_tokens(*, patch: int, merge: int, temporal_patch: int, max_frames: int, video_max_pixels: int) -> int:
    """The most placeholder tokens one clip can take: max_frames // temporal_patch temporal patches, each at most
    video_max_pixels in blocks of ``patch * merge`` pixels squared."""
    return max_frames // temporal_patch * (video_max_pixels // (patch * merge) ** 2)


def check_video_fits(
    *, patch: int, merge: int, temporal_patch: int, max_frames: int, video_max_pixels: int, seq_len: int, where: str
) -> None:
    """ConfigError when one clip at max_frames and video_max_pixels takes more placeholder tokens than seq_len (a
    document's clips go with its first piece, at most seq_len tokens), naming both ways out."""
    n = max_video_tokens(
        patch=patch,
        merge=merge,
        temporal_patch=temporal_patch,
        max_frames=max_frames,
        video_max_pixels=video_max_pixels,
    )
    if n > seq_len:
        per = video_max_pixels // (patch * merge) ** 2
        raise ConfigError(
            f"{where}: max_frames={max_frames} at video_max_pixels={video_max_pixels} lets one clip take up to {n} "
            f"placeholder tokens ({max_frames // temporal_patch} temporal patches x {per}), more than "
            f"seq_len={seq_len}; a clip must fit in one row, so lower max_frames to at most "
            f"{max(seq_len // max(per, 1), 0) * temporal_patch} (or video_max_pixels), or raise [job] seq_len to "
            f"at least {n}"
        )


@dataclass(frozen=True, slots=True)
class _Clips:
    values: np.ndarray  # uint8 [rows, 3 * temporal_patch * patch * patch], clips in order
    grid: np.ndarray  # int64 [n_videos, 3]
    placeholders: int


@dataclass(frozen=True, slots=True, kw_only=True)
class _VideoSide:
    """The video half of a ``vlm`` transform: where clips are in a record and how each becomes patches. Each
    clip (bytes, or a list) is decoded by ``video.decode_clip``: ``clamp(round(duration * fps), min_frames,
    max_frames)`` frames (at most the clip's, rounded down to a multiple of ``temporal_patch``, at least it)
    evenly over the clip, all resized to one size by ``smart_resize`` within [min_pixels, max_pixels] (the
    video bounds); ``max_frames`` defaults to as many as fit seq_len at video_max_pixels (at most 768). A clip
    that does not decode is a bad sample (``video_decode_error``); a document whose placeholders pass seq_len
    too (``video_tokens_exceed_seq_len``)."""

    keys: tuple[str, ...]
    patch: int
    merge: int
    temporal_patch: int
    fps: float
    min_frames: int
    max_frames: int
    min_pixels: int
    max_pixels: int
    seq_len: int | None

    def clips(self, record: Mapping, room: float) -> _Clips:
        """The record's clips decoded (none when it has no video field); ``room``: placeholders left in the row."""
        blobs = _lookup(record, self.keys)
        row = 3 * self.temporal_patch * self.patch * self.patch
        if blobs is None:
            return _Clips(np.zeros((0, row), np.uint8), np.zeros((0, 3), np.int64), 0)
        if isinstance(blobs, (bytes, bytearray, memoryview)):
            blobs = [blobs]
        elif not isinstance(blobs, (list, tuple, np.ndarray)):
            raise _Bad("video_decode_error", f"field {self.keys[0]!r} holds a {type(blobs).__name__}, not clip bytes")
        size = functools.partial(
            smart_resize, factor=self.patch * self.merge, min_pixels=self.min_pixels, max_pixels=self.max_pixels
        )
        values, grids, n = [], [], 0
        for i, blob in enumerate(blobs):
            clip = decode_clip(
                blob,
                f"video {i}",
                patch=self.patch,
                merge=self.merge,
                temporal_patch=self.temporal_patch,
                fps=self.fps,
                min_frames=self.min_frames,
                max_frames=self.max_frames,
                size=size,
            )
            n += math.prod(clip.grid) // (self.merge * self.merge)
            if n > room:  # the rest need not be decoded
                raise _Bad(
                    "video_tokens_exceed_seq_len",
                    f"video {i}: the document's placeholders reach {n} video tokens with {room:.0f} left of "
                    f"seq_len={self.seq_len} after its images; lower the vlm transform's max_frames (now "
                    f"{self.max_frames}) or video_max_pixels (now {self.max_pixels}), or raise [job] seq_len",
                )
            values.append(clip.values)
            grids.append(clip.grid)
        pv = values[0] if len(values) == 1 else np.concatenate(values) if values else np.zeros((0, row), np.uint8)
        return _Clips(pv, np.array(grids, dtype=np.int64).reshape(-1, 3), n)


def _video_setup(
    video_key: str | None,
    *,
    patch: int,
    merge: int,
    seq_len: int | None,
    fps,
    min_frames,
    max_frames,
    temporal_patch,
    video_min_pixels,
    video_max_pixels,
    video_token_id,
) -> _VideoSide | None:
    """The checked video arguments of ``vlm`` (ConfigError naming a bad one), or None without ``video_key``."""
    for name, v in (
        ("temporal_patch", temporal_patch),
        ("min_frames", min_frames),
        ("video_min_pixels", video_min_pixels),
        ("video_max_pixels", video_max_pixels),
    ):
        if isinstance(v, bool) or not isinstance(v, int) or v < 1:
            raise ConfigError(f"vlm: {name}={v!r} must be an integer >= 1")
    if isinstance(video_token_id, bool) or not isinstance(video_token_id, int) or video_token_id < 0:
        raise ConfigError(f"vlm: {video_token_id=} must be an integer >= 0")
    if isinstance(fps, bool) or not isinstance(fps, (int, float)) or not math.isfinite(fps) or fps <= 0:
        raise ConfigError(f"vlm: {fps=} must be a number > 0 (frames sampled per second of a clip)")
    if max_frames is None:
        max_frames = default_max_frames(
            seq_len=seq_len, patch=patch, merge=merge, temporal_patch=temporal_patch, video_max_pixels=video_max_pixels
        )
    elif isinstance(max_frames, bool) or not isinstance(max_frames, int) or max_frames < temporal_patch:
        raise ConfigError(f"vlm: {max_frames=} must be an integer >= temporal_patch={temporal_patch}")
    elif min_frames > max_frames:
        raise ConfigError(f"vlm: {min_frames=} is more than {max_frames=}; lower min_frames")
    factor = patch * merge
    if -(-video_min_pixels // factor**2) > video_max_pixels // factor**2:
        raise ConfigError(
            f"vlm: no frame of whole {factor}x{factor} blocks has an area in [{video_min_pixels=}, "
            f"{video_max_pixels=}]; raise video_max_pixels to at least {-(-video_min_pixels // factor**2) * factor**2}"
        )
    if video_key is None:
        return None
    return _VideoSide(
        keys=_keys(video_key),
        patch=patch,
        merge=merge,
        temporal_patch=temporal_patch,
        fps=float(fps),
        min_frames=min_frames,
        max_frames=max_frames,
        min_pixels=video_min_pixels,
        max_pixels=video_max_pixels,
        seq_len=seq_len,
    )


def _counted(k: int, n: int) -> str:
    """Which images went over the limit: "its 3 images", "its first 2 of 5 images"."""
    if k == n:
        return "its image" if n == 1 else f"its {n} images"
    return f"its first {k} of {n} images"


@dataclass(frozen=True, slots=True)
class _Patches:
    values: np.ndarray  # uint8 [t*h*w, 3*patch*patch]
    grid: tuple[int, int, int]


def _image_patches(Image, blob, i: int, *, patch: int, merge: int, min_pixels: int, max_pixels: int) -> _Patches:
    """Decode, make RGB, resize and cut one image into patches (Qwen2-VL order)."""
    if not isinstance(blob, (bytes, bytearray, memoryview)):
        raise _Bad("corrupt", f"image {i} is a {type(blob).__name__}, not encoded bytes")
    factor = patch * merge
    try:
        im = Image.open(io.BytesIO(blob))  # reads the header only
        w, h = im.size
        if max(w, h) > MAX_ASPECT * min(w, h):
            raise _Bad("transform_error", f"image {i}: {w}x{h} pixels, an aspect ratio over {MAX_ASPECT}")
        th, tw = smart_resize(h, w, factor=factor, min_pixels=min_pixels, max_pixels=max_pixels)
        if im.format == "JPEG" and (w >= 2 * tw or h >= 2 * th):
            im.draft("RGB", (tw, th))  # DCT scaling: decode at 1/2, 1/4 or 1/8, still at least the target
        _bound_decode(im, (im.size[0], im.size[1]), f"image {i}")  # drafted already: only the pixel limit
        img = _rgb(Image, im)
    except _Bad:
        raise
    except Image.DecompressionBombError as e:
        raise _Bad("oversize", f"image {i}: {e}") from None
    except Exception as e:  # Pillow raises many kinds (OSError, SyntaxError, struct.error...) for bad data
        raise _Bad("corrupt", f"image {i} does not decode: {type(e).__name__}: {e}") from None
    if img.size != (tw, th):
        img = img.resize((tw, th), Image.Resampling.BICUBIC)
    a = np.asarray(img, dtype=np.uint8)
    gh, gw = th // patch, tw // patch
    # (bh, mh, ph, bw, mw, pw, c) -> (bh, bw, mh, mw, c, ph, pw): the merge x merge patches of a token adjacent
    a = a.reshape(gh // merge, merge, patch, gw // merge, merge, patch, 3).transpose(0, 3, 1, 4, 6, 2, 5)
    return _Patches(np.ascontiguousarray(a).reshape(gh * gw, 3 * patch * patch), (1, gh, gw))


def _rgb(Image, im):
    """The decoded image in RGB; transparent pixels over white (as Hugging Face's convert_rgb does)."""
    if im.mode == "RGB":
        im.load()
        return im
    if "A" in im.getbands() or "transparency" in im.info:
        rgba = im.convert("RGBA")
        out = Image.new("RGBA", rgba.size, (255, 255, 255, 255))
        out.alpha_composite(rgba)
        return out.convert("RGB")
    return im.convert("RGB")


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


def transform_call(path: str) -> tuple[str, str, list, dict]:
    """(module, function, positional arguments, keyword arguments) of a transform name, importing nothing."""
    module, name, args = parse_transform_name(path)
    if args is None:
        return module, name, [], {}
    try:
        pos, kw = _parse_args(args)
    except SyntaxError as e:
        raise ConfigError(f"transform {path!r}: cannot parse the arguments ({e.msg})") from None
    return module, name, pos, kw


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
        _, _, pos, kw = transform_call(path)
        fn = fn(*pos, **kw)
        if not callable(fn):
            raise ConfigError(f"transform {path!r}: the factory did not return a callable")
    return fn


def run_transform(fn: Callable, records: list, *, seed: int, sample_ids) -> list[Any]:
    """Apply fn to each record; a record that is already a BadSample, or on which fn raises, yields a
    BadSample. Each sample's rng is seeded from (seed, sample_id), so results do not depend on batching.

    A transform that needs no rng may offer ``fn.batch(records) -> list`` (per record, in order: its result or
    the BadSampleError that makes it a bad sample; ``hf_tokenizer`` does): it is then called once for the
    records here. If it raises, the records go through ``fn`` one by one, which says which sample failed."""
    batch = getattr(fn, "batch", None)
    if batch is not None and not getattr(fn, "needs_rng", True):
        good = [i for i, rec in enumerate(records) if not isinstance(rec, BadSample)]
        try:
            got = batch([records[i] for i in good])
            if len(got) != len(good):
                raise ValueError(f"{fn!r}.batch returned {len(got)} results for {len(good)} records")
        except Exception:
            pass  # one by one below
        else:
            done = list(records)
            sids = np.asarray(sample_ids, dtype=np.int64)
            for i, res in zip(good, got):
                done[i] = _checked(res, int(sids[i]))
            return done
    needs_rng = getattr(fn, "needs_rng", True)
    ids = np.asarray(sample_ids, dtype=np.int64).tolist()
    out: list[Any] = []
    for rec, sid in zip(records, ids):
        if isinstance(rec, BadSample):
            out.append(rec)
            continue
        try:
            res = fn(rec, rng=make_rng(seed, sid) if needs_rng else None)
        except Exception as e:
            res = e
        out.append(_checked(res, sid))
    return out


def _checked(res: Any, sid: int) -> Any:
    """A transform's result for sample ``sid`` as run_transform returns it: a picture document or an array, or
    a BadSample for an exception (raised or returned by a batch) or a scalar."""
    try:
        if isinstance(res, BaseException):
            raise res
        if isinstance(res, VlmSample):  # a picture document: its arrays travel as they are
            return res
        if not isinstance(res, np.ndarray):
            res = np.asarray(res)
        if res.ndim == 0:
            raise _Bad("transform_error", f"transform returned a {res.dtype} scalar; it must return an array")
    except BadSampleError as e:
        return BadSample(getattr(e, "reason", "transform_error"), f"sample {sid}", str(e))
    except Exception as e:
        return BadSample("transform_error", f"sample {sid}", f"{type(e).__name__}: {e}")
    return res
