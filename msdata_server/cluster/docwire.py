"""Documents over peer links (a fetch reply): token arrays, and picture documents with their pixels, as one
raw buffer and a small JSON header; never pickled.

Buffer: every document's tokens as int32, back to back; then, for the picture documents in order, their
``pixel_values`` (uint8) and then their ``image_grid_thw`` (int64), then for one with clips its
``pixel_values_videos`` (uint8, raw: clips travel as their patches' bytes) and ``video_grid_thw`` (int64). The
header lists the token counts (``lens``) and, per document, ``[patches, images, row]`` for a picture (``[patches,
images, row, video_rows, videos, video_row]`` for one with clips) or ``None`` (``pics``; absent when there is
none, as older peers send).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np

from ..document import VlmSample
from ..errors import ProtocolError

if TYPE_CHECKING:
    from typing_extensions import Buffer

__all__ = ["pack_docs", "split_docs"]


def pack_docs(docs: list) -> tuple[dict, bytes]:
    """Documents (int arrays or ``VlmSample``) as one buffer plus the header that splits it.

    The buffer is joined straight from the documents' arrays (one copy; arrays already ``<i4``/uint8/``<i8``
    and contiguous are not converted first), and is immutable bytes, which the link sends without copying."""
    toks = [d.tokens if isinstance(d, VlmSample) else d for d in docs]
    lens = [len(t) for t in toks]
    parts = [_raw(t, "<i4") for t in toks]
    head: dict = {"lens": lens, "dtype": "<i4"}
    pics = [_pic(d) for d in docs]
    if any(p is not None for p in pics):
        head["pics"] = pics
        for d in docs:
            if isinstance(d, VlmSample):
                parts.append(_raw(d.pixel_values, np.uint8))
                parts.append(_raw(d.image_grid_thw, "<i8"))
                if len(d.video_grid_thw):
                    parts.append(_raw(d.pixel_values_videos, np.uint8))
                    parts.append(_raw(d.video_grid_thw, "<i8"))
    return head, b"".join(parts)


def _raw(a: object, dtype: np.typing.DTypeLike) -> memoryview:
    """The bytes of ``a`` as ``dtype``, C order: a view when it already is, else a converted copy."""
    return np.ascontiguousarray(a, dtype=dtype).reshape(-1).data.cast("B")  # flat: an empty [0, 3] casts too


def _pic(d: object) -> list[int] | None:
    if not isinstance(d, VlmSample):
        return None
    pv = d.pixel_values
    pic = [int(pv.shape[0]), len(d.image_grid_thw), int(pv.shape[1]) if pv.ndim == 2 else 0]
    if len(d.video_grid_thw):
        vv = d.pixel_values_videos
        pic += [int(vv.shape[0]), len(d.video_grid_thw), int(vv.shape[1])]
    return pic


def split_docs(head: dict, payload: Buffer | None) -> list:
    """The documents of a fetch reply (copies, so the payload buffer can go); ProtocolError if malformed."""
    try:
        lens = [int(x) for x in head["lens"]]
        raw = memoryview(payload).cast("B") if payload is not None else memoryview(b"")
        dtype = np.dtype(head["dtype"])
        ntok = sum(lens) * dtype.itemsize
        if any(n < 0 for n in lens) or ntok > len(raw):
            raise ValueError(f"{sum(lens)} tokens do not fit a payload of {len(raw)} bytes")
        a = np.frombuffer(raw[:ntok], dtype=dtype)
        pics = head.get("pics") or [None] * len(lens)
        if len(pics) != len(lens):
            raise ValueError(f"{len(pics)} picture entries for {len(lens)} documents")
        out: list = []
        off, at = 0, ntok
        for n, pic in zip(lens, pics):
            tokens = a[off : off + n].copy()
            off += n
            if pic is None:
                out.append(tokens)
                continue
            if len(pic) not in (3, 6):
                raise ValueError(f"picture entry {pic} must hold 3 or 6 counts")
            sizes = [int(x) for x in pic]
            if min(sizes) < 0:
                raise ValueError(f"picture {pic} has a negative count")
            pv, grid, at = _pixels(raw, at, sizes[0], sizes[1], sizes[2], pic)
            if len(sizes) == 3:
                out.append(VlmSample(tokens, pv, grid))
                continue
            vv, vgrid, at = _pixels(raw, at, sizes[3], sizes[4], sizes[5], pic)
            out.append(VlmSample(tokens, pv, grid, vv, vgrid))
        if at != len(raw):
            raise ValueError(f"{len(raw) - at} bytes left over after the documents")
    except (KeyError, TypeError, ValueError) as e:
        raise ProtocolError(f"malformed fetch reply: {e}") from None
    return out


def _pixels(raw: memoryview, at: int, rows: int, n: int, row: int, pic: list) -> tuple[np.ndarray, np.ndarray, int]:
    """uint8 [rows, row] pixels and int64 [n, 3] grids from ``raw`` at ``at`` (copies), and where they end."""
    npx, ngrid = rows * row, n * 3 * 8
    if at + npx + ngrid > len(raw):
        raise ValueError(f"picture {pic} does not fit the payload")
    pv = np.frombuffer(raw[at : at + npx], dtype=np.uint8).reshape(rows, row).copy()
    grid = np.frombuffer(raw[at + npx : at + npx + ngrid], dtype="<i8").reshape(n, 3).astype(np.int64)
    return pv, grid, at + npx + ngrid
