"""Node-wide counters of object-store requests (cumulative since the server started): what `status --json`
reports as ``storage`` and Prometheus as ``msdata_storage_*``."""

from __future__ import annotations

import threading

import numpy as np

__all__ = ["STAT_KEYS", "StorageStats"]

STAT_KEYS = (
    "requests",
    "bytes",
    "retries",
    "throttled",
    "errors",
    "latency_ms_p50",
    "latency_ms_p99",
    "cache_hits",
    "cache_misses",
)
_WINDOW = 4096  # the latest request latencies kept for the percentiles (a ring: bounded memory)


class StorageStats:
    """Thread-safe counters; latencies of the last _WINDOW requests in a ring for p50/p99."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.counts = dict.fromkeys(
            ("requests", "bytes", "retries", "throttled", "errors", "cache_hits", "cache_misses"), 0
        )
        self._lat = np.zeros(_WINDOW, dtype=np.float64)
        self._n = 0

    def request(self, nbytes: int, seconds: float) -> None:
        with self._lock:
            self.counts["requests"] += 1
            self.counts["bytes"] += nbytes
            self._lat[self._n % _WINDOW] = seconds * 1e3
            self._n += 1

    def add(self, key: str, n: int = 1) -> None:
        with self._lock:
            self.counts[key] += n

    def snapshot(self) -> dict[str, float | int]:
        """Every key of STAT_KEYS."""
        with self._lock:
            out: dict[str, float | int] = dict(self.counts)
            lat = self._lat[: min(self._n, _WINDOW)]
            p50, p99 = np.percentile(lat, [50, 99]).tolist() if len(lat) else (0.0, 0.0)
        out["latency_ms_p50"] = round(float(p50), 3)
        out["latency_ms_p99"] = round(float(p99), 3)
        return {k: out[k] for k in STAT_KEYS}
