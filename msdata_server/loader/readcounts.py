"""What a SourceLoader has read, for its statistics: samples, bytes, throughput, bad samples by reason, failed
reads. Kept apart from the loader so that scheduling code does not carry counters; the loader's
``statistics()`` reads them.
"""

from __future__ import annotations

import time
from collections import Counter, deque

import numpy as np

from ..sources.base import BadDataLog, BadSample, Source

__all__ = ["ReadCounts"]

_RATE_WINDOW = 64  # completed batches the throughput is measured over


class ReadCounts:
    """Counts of one loader; a bad sample the transform found is logged once with its location."""

    def __init__(self, source: Source):
        self._source = source
        self.bad: Counter[str] = Counter()
        self._badlog = BadDataLog(source.name)
        self.errors = 0  # batches whose read failed
        self.done = 0  # samples read
        self.bytes = 0
        self.tokens = 0  # tokens of the samples read (their lengths), for the source's profile
        self._rate: deque[tuple[float, int]] = deque(maxlen=_RATE_WINDOW)

    def batch_read(self, ords: np.ndarray, records: list, results: list, nbytes: int, tokens: int = 0) -> None:
        """A batch was read and transformed: ``results`` of ``records`` of ordinals ``ords``, ``tokens`` long."""
        for i, r in enumerate(results):
            if isinstance(r, BadSample):
                self.bad[r.reason] += 1
                if r is not records[i]:  # found by the transform: the source has not logged it
                    loc = self._source.location(int(ords[i]))
                    self._badlog.record(BadSample(r.reason, loc, r.detail))
        self.done += len(results)
        self.bytes += nbytes
        self.tokens += int(tokens)
        self._rate.append((time.monotonic(), len(results)))

    def batch_failed(self) -> None:
        """Reading or transforming a batch raised."""
        self.errors += 1

    def samples_per_s(self) -> float:
        """Throughput over the last few batches (0 until two were read)."""
        rate = 0.0
        if len(self._rate) >= 2:
            dt = self._rate[-1][0] - self._rate[0][0]
            if dt > 0:
                rate = sum(n for _, n in list(self._rate)[1:]) / dt
        return rate

    def bad_counts(self) -> dict[str, int]:
        """Bad samples by reason; files the source skipped at open never reach the loader, so add those."""
        skipped = self._source.bad.snapshot().get("corrupt_file", 0)
        return {**self.bad, "corrupt_file": skipped} if skipped else dict(self.bad)
