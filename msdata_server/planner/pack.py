"""Documents to pieces (split or truncate at seq_len) and arrival-order packing, all vectorised."""

from __future__ import annotations

import numpy as np

from msdata_client.choices import LongDocs

__all__ = ["LongDocs", "long_docs_mode", "next_fit", "pieces"]


def long_docs_mode(value: str) -> LongDocs:
    """Parse a long_docs setting; ConfigError listing the choices."""
    return LongDocs.parse(value, "long_docs", brief=True)


def pieces(lengths: np.ndarray, seq_len: int, mode: LongDocs) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(doc index, offset, length) of every piece of `lengths`, in document order; empty docs yield none."""
    lengths = np.asarray(lengths, dtype=np.int64)
    docs = np.flatnonzero(lengths > 0)
    lens = lengths[docs]
    if mode is LongDocs.TRUNCATE or not lens.size or int(lens.max()) <= seq_len:
        return docs, np.zeros(docs.size, np.int64), np.minimum(lens, seq_len)
    counts = (lens + (seq_len - 1)) // seq_len
    doc = np.repeat(docs, counts)
    first = np.cumsum(counts) - counts
    k = np.arange(doc.size, dtype=np.int64) - np.repeat(first, counts)
    offset = k * seq_len
    return doc, offset, np.minimum(lengths[doc] - offset, seq_len)


def next_fit(lengths: np.ndarray, n_rows: int, seq_len: int) -> np.ndarray:
    """Arrival-order packing: fill row 0, then row 1, ...; a piece that does not fit starts the next row.

    Returns the row of each piece (-1 once every row is used). One searchsorted per row, not per piece.
    """
    lengths = np.asarray(lengths, dtype=np.int64)
    out = np.full(lengths.size, -1, np.int64)
    ends = np.cumsum(lengths)
    start, base = 0, 0
    for row in range(n_rows):
        if start >= lengths.size:
            break
        stop = int(np.searchsorted(ends, base + seq_len, side="right"))
        stop = max(stop, start + 1)  # a piece is never longer than a row
        out[start:stop] = row
        base = int(ends[stop - 1])
        start = stop
    return out
