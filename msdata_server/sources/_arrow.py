"""Turning rows of Arrow columns into records (shared by the Parquet and Arrow IPC readers): one column's
values, or a dict by column name when a source selects several (``columns = [...]``)."""

from __future__ import annotations

from collections.abc import Callable, Sequence

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

__all__ = ["arrow_records", "arrow_rows", "check_column", "check_columns", "check_selected", "selected_records"]


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


def check_columns(source: str, path: str, schema: pa.Schema, columns: Sequence[str]) -> list[int]:
    """Indices of several columns in a file's schema; ConfigError naming the missing ones and the columns."""
    from ..errors import ConfigError

    names = schema.names
    missing = [c for c in columns if c not in names]
    if missing:
        raise ConfigError(
            f"source {source!r}: file {path} has no column(s) {missing}; its columns are {names}. "
            f"Set columns = [...] to some of them in the source"
        )
    return [names.index(c) for c in columns]


def check_selected(source: str, path: str, schema: pa.Schema, column: str, columns: Sequence[str] | None) -> None:
    """check_column for one ``column``, check_columns when the source selects several ``columns``."""
    if columns is None:
        check_column(source, path, schema, column)
    else:
        check_columns(source, path, schema, columns)


def selected_records(
    arrays: Sequence[pa.Array],
    columns: Sequence[str] | None,
    idx: np.ndarray,
    *,
    max_bytes: int,
    bad: Callable[[int, str, str], object],
) -> tuple[list, int]:
    """arrow_records of the one column (``columns`` None) or arrow_rows of several."""
    if columns is None:
        return arrow_records(arrays[0], idx, max_bytes=max_bytes, bad=bad)
    return arrow_rows(arrays, columns, idx, max_bytes=max_bytes, bad=bad)


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


def _is_binary_list(t: pa.DataType) -> bool:
    """A list of encoded blobs (several images of one interleaved sample): values come back as list[bytes]."""
    return _is_list(t) and _is_binary(t.value_type) and not _is_text(t.value_type)


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

    Text and binary values come back as str/bytes, lists of blobs as lists of bytes, lists of numbers as numpy
    arrays (pre-tokenized data), anything else as Python values. ``bad(k, reason, detail)`` makes the record
    for the k-th requested row when it is null ("missing_field"), larger than max_bytes ("oversize") or not
    valid UTF-8.
    """
    out, sizes, keep = _records(arr, idx, max_bytes=max_bytes, bad=bad)
    return out, int(sizes[keep].sum())


def arrow_rows(
    arrays: Sequence[pa.Array],
    names: Sequence[str],
    idx: np.ndarray,
    *,
    max_bytes: int,
    bad: Callable[[int, str, str], object],
) -> tuple[list, int]:
    """Records ``{name: value}`` for rows ``idx`` of several columns, and the bytes they hold.

    A row is bad (one ``bad`` call, the first reason found) when any of its columns is null or not valid
    UTF-8, or when its columns together hold more than max_bytes.
    """
    first: dict[int, object] = {}

    def once(k: int, reason: str, detail: str) -> object:
        b = first.get(k)
        if b is None:
            b = first[k] = bad(k, reason, detail)
        return b

    cols: list[list] = []
    total = np.zeros(len(idx), dtype=np.int64)
    for arr, name in zip(arrays, names):
        vals, sizes, _ = _records(arr, idx, max_bytes=max_bytes, bad=_naming_column(once, name))
        cols.append(vals)
        total += sizes
    for k in np.flatnonzero(total > max_bytes).tolist():
        once(k, "oversize", f"{int(total[k])} bytes in columns {list(names)} > max_sample_bytes {max_bytes}")
    out: list = [None] * len(idx)
    nbytes = 0
    for k in range(len(idx)):
        b = first.get(k)
        if b is not None:
            out[k] = b
        else:
            out[k] = {name: col[k] for name, col in zip(names, cols)}
            nbytes += int(total[k])
    return out, nbytes


def _naming_column(bad: Callable[[int, str, str], object], name: str) -> Callable[[int, str, str], object]:
    """``bad`` with the column named in its detail."""
    return lambda k, reason, detail: bad(k, reason, f"column {name!r}: {detail}")


def _records(
    arr: pa.Array, idx: np.ndarray, *, max_bytes: int, bad: Callable[[int, str, str], object]
) -> tuple[list, np.ndarray, np.ndarray]:
    """(records, bytes per requested row, positions of the rows that are not bad) for rows ``idx`` of ``arr``."""
    sub = arr.take(pa.array(idx, type=pa.int64()))
    n = len(sub)
    out: list = [None] * n
    valid = np.ones(n, dtype=bool)
    if sub.null_count:
        valid = ~np.asarray(sub.is_null().to_numpy(zero_copy_only=False), dtype=bool)
    t = sub.type
    if _is_binary(t):
        sizes = pc.binary_length(sub).fill_null(0).to_numpy(zero_copy_only=False).astype(np.int64)
    elif _is_binary_list(t):
        flat = pc.list_flatten(sub)
        parents = pc.list_parent_indices(sub).to_numpy(zero_copy_only=False)
        blob = pc.binary_length(flat).fill_null(0).to_numpy(zero_copy_only=False).astype(np.int64)
        sizes = np.bincount(parents, weights=blob, minlength=n).astype(np.int64)
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
    if len(keep) == 0:
        return out, sizes, keep
    part = sub if len(keep) == n else sub.take(pa.array(keep, type=pa.int64()))
    if _is_text(t):
        vals = _values(part, bad, keep)
    elif _is_binary_list(t):
        vals = part.to_pylist()  # list[bytes] per row (a null image inside stays None: the transform says so)
    elif _is_list(t):
        flat = pc.list_flatten(part).to_numpy(zero_copy_only=False)
        cut = np.cumsum(pc.list_value_length(part).to_numpy(zero_copy_only=False).astype(np.int64))[:-1]
        vals = [v.copy() for v in np.split(flat, cut)]
    else:
        vals = part.to_pylist()
    for k, v in zip(keep.tolist(), vals):
        out[k] = v
    return out, sizes, keep
