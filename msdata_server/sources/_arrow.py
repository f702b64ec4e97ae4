"""Turning rows of an Arrow column into records (shared by the Parquet and Arrow IPC readers)."""

from __future__ import annotations

from typing import Callable

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

__all__ = ["arrow_records", "check_column"]


def check_column(source: str, path: str, schema: pa.Schema, column: str) -> int:
    """Index of ``column`` in a file's schema; ConfigError listing the columns when it is missing."""
    from ..errors import ConfigError

    names = schema.names
    if column not in names:
        raise ConfigError(
            f"source {source!r}: file {path} has no column {column!r}; its columns are {names}. "
            f"Set column = one of them in the source"
        )
    return names.index(column)


def _is_binary(t: pa.DataType) -> bool:
    return (
        pa.types.is_string(t)
        or pa.types.is_large_string(t)
        or pa.types.is_binary(t)
        or pa.types.is_large_binary(t)
        or pa.types.is_string_view(t)
        or pa.types.is_binary_view(t)
    )


def _is_text(t: pa.DataType) -> bool:
    return pa.types.is_string(t) or pa.types.is_large_string(t) or pa.types.is_string_view(t)


def _is_list(t: pa.DataType) -> bool:
    return pa.types.is_list(t) or pa.types.is_large_list(t) or pa.types.is_fixed_size_list(t)


def _values(arr: pa.Array, bad: Callable[[int, str, str], object], keep: np.ndarray) -> list:
    """Python values of a string/binary array; strings that are not valid UTF-8 become bad samples."""
    try:
        return arr.to_pylist()
    except UnicodeDecodeError:
        pass
    raw = arr.cast(pa.large_binary()).to_pylist()
    out: list = []
    for k, b in zip(keep.tolist(), raw):
        try:
            out.append(b.decode("utf-8"))
        except UnicodeDecodeError as e:
            out.append(bad(k, "invalid_utf8", str(e)))
    return out


def arrow_records(
    arr: pa.Array, idx: np.ndarray, *, max_bytes: int, bad: Callable[[int, str, str], object]
) -> tuple[list, int]:
    """Records for rows ``idx`` of ``arr`` (in that order) and the bytes they hold.

    Text and binary values come back as str/bytes, lists of numbers as numpy arrays (pre-tokenized data),
    anything else as Python values. ``bad(k, reason, detail)`` makes the record for the k-th requested row
    when it is null ("missing_field"), larger than max_bytes ("oversize") or not valid UTF-8.
    """
    sub = arr.take(pa.array(idx, type=pa.int64()))
    n = len(sub)
    out: list = [None] * n
    valid = np.ones(n, dtype=bool)
    if sub.null_count:
        valid = ~np.asarray(sub.is_null().to_numpy(zero_copy_only=False), dtype=bool)
    t = sub.type
    if _is_binary(t):
        sizes = pc.binary_length(sub).fill_null(0).to_numpy(zero_copy_only=False).astype(np.int64)
    elif _is_list(t):
        lens = pc.list_value_length(sub).fill_null(0).to_numpy(zero_copy_only=False).astype(np.int64)
        try:
            width = max(1, t.value_type.bit_width // 8)
        except (ValueError, AttributeError):  # a list of variable-width values
            width = 8
        sizes = lens * width
    else:
        sizes = np.zeros(n, dtype=np.int64)
    for k in np.flatnonzero(~valid).tolist():
        out[k] = bad(k, "missing_field", "value is null")
    over = valid & (sizes > max_bytes)
    for k in np.flatnonzero(over).tolist():
        out[k] = bad(k, "oversize", f"{int(sizes[k])} bytes > max_sample_bytes {max_bytes}")
    keep = np.flatnonzero(valid & ~over)
    nbytes = int(sizes[keep].sum())
    if len(keep) == 0:
        return out, nbytes
    part = sub if len(keep) == n else sub.take(pa.array(keep, type=pa.int64()))
    if _is_text(t):
        vals = _values(part, bad, keep)
    elif _is_list(t):
        flat = pc.list_flatten(part).to_numpy(zero_copy_only=False)
        cut = np.cumsum(pc.list_value_length(part).to_numpy(zero_copy_only=False).astype(np.int64))[:-1]
        vals = [v.copy() for v in np.split(flat, cut)]
    else:
        vals = part.to_pylist()
    for k, v in zip(keep.tolist(), vals):
        out[k] = v
    return out, nbytes
