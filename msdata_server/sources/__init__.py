"""Source readers, picked by format name from one table, and ``open_source``.

Every source reads its samples in a deterministic order that is a pure function of (seed, name, epoch)
(order.py); bad data comes back as ``BadSample`` records, counted and logged once, never raised.
"""

from __future__ import annotations

from typing import Any

from ..errors import ConfigError
from .arrow import ArrowSource
from .base import BAD_REASONS, BadSample, ReadResult, Source, SourceStats
from .jsonl import JsonlSource
from .parquet import ParquetSource
from .synthetic import SyntheticSource

__all__ = [
    "ArrowSource",
    "BAD_REASONS",
    "BadSample",
    "FORMATS",
    "JsonlSource",
    "ParquetSource",
    "ReadResult",
    "Source",
    "SourceStats",
    "SyntheticSource",
    "open_source",
]

FORMATS: dict[str, type[Source]] = {
    "arrow": ArrowSource,
    "jsonl": JsonlSource,
    "parquet": ParquetSource,
    "synthetic": SyntheticSource,
}


def open_source(spec: Any, *, seed: int) -> Source:
    """Open the source a SourceSpec describes; ConfigError (naming source, path and fix) when it cannot."""
    cls = FORMATS.get(spec.format)
    if cls is None:
        raise ConfigError(f"source {spec.name!r}: unknown format {spec.format!r}; use one of {sorted(FORMATS)}")
    return cls(spec, seed=seed)
