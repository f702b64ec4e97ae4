"""What the planner reads of the data: sample lengths by ordinal, through a MetadataView.

`LengthReader` draws each source's next documents in order until a token deficit is covered, in
chunks sized by a running mean length, keeping what it read beyond as a look-ahead, and checks what
the view returns. Neither is planner state: both are pure values of the view, safe to drop.
"""

from __future__ import annotations

import time
from typing import Protocol

import numpy as np

from msdata_server.errors import BadSampleError, ProtocolError

from .pack import LongDocs

__all__ = ["LengthReader", "MetadataView"]

MIN_CHUNK, MAX_CHUNK = 64, 1 << 16  # ordinals per MetadataView.lengths call (the loaders hold what was asked)
MAX_SKIPPED = 1 << 20  # consecutive empty (bad) samples before a source is declared broken


class MetadataView(Protocol):
    """Lengths of samples by ordinal; what the planner reads (the node server implements it)."""

    def lengths(self, source: int, start: int, count: int) -> np.ndarray:
        """int64 token lengths of ordinals [start, start+count) of `source`; 0 = a skipped bad sample."""
        ...


class LengthReader:
    """Reads the sources' lengths in order for a planner; see the module docstring."""

    def __init__(self, sources: tuple[str, ...], seq_len: int, mode: LongDocs):
        n = len(sources)
        self._sources, self._seq_len, self._mode = sources, seq_len, mode
        self._ahead: list[tuple[int, np.ndarray]] = [(0, np.zeros(0, np.int64)) for _ in range(n)]
        self._mean_len = np.full(n, max(1.0, seq_len / 8))  # only sizes the read chunks

    def draw(self, view: MetadataView, s: int, start: int, deficit: float, ingest: list[float]) -> np.ndarray:
        """Lengths of source s's next documents from `start`, in order, until `deficit` tokens are covered.

        The last one crosses the deficit (never short of it); empty (bad) samples are passed over.
        Milliseconds spent in the view are added to ingest[0].
        """
        cur = start
        got: list[np.ndarray] = []
        have = 0
        empty_run = 0
        while True:
            count = int(min(MAX_CHUNK, max(MIN_CHUNK, 1.1 * (deficit - have) / self._mean_len[s] + 16)))
            arr = self._read(view, s, cur, count, ingest)
            used = np.minimum(arr, self._seq_len) if self._mode is LongDocs.TRUNCATE else arr
            ends = np.cumsum(used)
            j = int(np.searchsorted(ends, deficit - have, side="left"))
            nonzero = int(np.count_nonzero(arr))
            if nonzero:
                self._mean_len[s] = max(1.0, float(ends[-1]) / nonzero)
                empty_run = 0
            else:
                empty_run += arr.size
                if empty_run >= MAX_SKIPPED:
                    raise BadSampleError(
                        f"source {self._sources[s]!r} gave {empty_run} empty (bad) samples in a row up to ordinal"
                        f" {cur + arr.size - 1}; check its files and transform",
                        source=self._sources[s],
                    )
            if j < arr.size:
                got.append(arr[: j + 1])
                self._ahead[s] = (cur + j + 1, arr[j + 1 :])
                return np.concatenate(got) if len(got) > 1 else got[0]
            got.append(arr)
            have += int(ends[-1])
            cur += arr.size

    def _read(self, view: MetadataView, s: int, start: int, count: int, ingest: list[float]) -> np.ndarray:
        """Lengths of [start, start+count) of source s, from the look-ahead or the view."""
        a_start, ahead = self._ahead[s]
        if a_start == start and ahead.size:
            return ahead
        t = time.perf_counter()
        raw = view.lengths(s, start, count)
        ingest[0] += (time.perf_counter() - t) * 1e3
        arr = np.asarray(raw)
        if arr.shape != (count,) or not (np.issubdtype(arr.dtype, np.integer) or arr.size == 0):
            raise ProtocolError(
                f"MetadataView.lengths({s}, {start}, {count}) returned {arr.dtype} shape {arr.shape};"
                f" it must return {count} integer lengths"
            )
        arr = arr.astype(np.int64, copy=False)
        if arr.size and int(arr.min()) < 0:
            raise ProtocolError(f"MetadataView.lengths({s}, {start}, {count}) returned a negative length")
        return arr
