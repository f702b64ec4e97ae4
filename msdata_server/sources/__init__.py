"""Source readers (Parquet, Arrow IPC, JSON Lines, WebDataset tar shards, synthetic), picked by format name
from one table, and ``open_source``.

Every source reads its samples in a deterministic order that is a pure function of (seed, name, epoch)
(order.py); bad data comes back as ``BadSample`` records, counted and logged once, never raised.
Format modules load on first use: transform workers import ``sources.base`` and must not pay for pyarrow
(forty-odd MiB per pool, bench/memory.py).
"""

from __future__ import annotations

import importlib
import os
import sys
from typing import Any

from ..errors import ConfigError
from ..storage import get_store, is_uri, local_path
from .base import BAD_REASONS, BadSample, FileSource, ReadResult, Source, SourceStats, meta_identity
from .listing import Listing, list_files, listing_of

__all__ = [
    "ArrowSource",
    "BAD_REASONS",
    "BadSample",
    "FORMATS",
    "JsonlSource",
    "Listing",
    "ParquetSource",
    "ReadResult",
    "Source",
    "SourceStats",
    "SyntheticSource",
    "WebDatasetSource",
    "list_source",
    "open_source",
]

# format name -> (module, class); FORMATS (name -> class) imports them all when first asked for
_FORMAT_TABLE = {
    "arrow": ("arrow", "ArrowSource"),
    "jsonl": ("jsonl", "JsonlSource"),
    "parquet": ("parquet", "ParquetSource"),
    "synthetic": ("synthetic", "SyntheticSource"),
    "webdataset": ("webdataset", "WebDatasetSource"),
}
_CLASSES = {cls: fmt for fmt, (_, cls) in _FORMAT_TABLE.items()}


def _format_class(fmt: str) -> type[Source]:
    module, cls = _FORMAT_TABLE[fmt]
    if fmt in ("arrow", "parquet"):
        _prefer_returning_allocator()
    return getattr(importlib.import_module(f".{module}", __name__), cls)


def __getattr__(name: str) -> Any:
    if name == "FORMATS":
        return {fmt: _format_class(fmt) for fmt in _FORMAT_TABLE}
    if name in _CLASSES:
        return _format_class(_CLASSES[name])
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def open_source(spec: Any, *, seed: int, on_read_error: str = "fail") -> Source:
    """Open the source a SourceSpec describes; ConfigError (naming source, path and fix) when it cannot.
    ``on_read_error`` ([job]): "fail" stops the job on an object-store read failed for good, "skip" counts it."""
    if spec.format not in _FORMAT_TABLE:
        raise ConfigError(f"source {spec.name!r}: unknown format {spec.format!r}; use one of {sorted(_FORMAT_TABLE)}")
    src = _format_class(spec.format)(spec, seed=seed)
    src.on_read_error = on_read_error
    return src


def list_source(spec: Any) -> Listing | None:
    """The file listing of the source a SourceSpec describes, without opening its files (None for a source
    that reads no files); ConfigError as ``open_source`` raises it for paths that match nothing. A remote
    source with a state_dir is opened once instead (listing and metadata kept there: the open that follows
    reads neither again)."""
    if spec.format not in _FORMAT_TABLE:
        raise ConfigError(f"source {spec.name!r}: unknown format {spec.format!r}; use one of {sorted(_FORMAT_TABLE)}")
    cls = _format_class(spec.format)
    if not issubclass(cls, FileSource):
        return None
    meta_cache = get_store().meta
    if meta_cache is not None and any(is_uri(str(p)) and local_path(str(p)) is None for p in spec.paths):
        identity = meta_identity(spec)
        meta = meta_cache.load(identity, spec)  # a restart (or the leader's copy): the kept listing
        if meta is None:  # a remote source is listed once: with its metadata, kept for the open that follows
            open_source(spec, seed=0).close()
            meta = meta_cache.load(identity)
        if meta is not None:
            return listing_of(spec.paths, meta.files)
    return list_files(spec.name, spec.format, spec.paths, cls.extensions)


def _prefer_returning_allocator() -> None:
    """Before the first pyarrow import, make Arrow allocate with jemalloc, which gives freed decode buffers
    back to the OS; with Arrow's default (mimalloc) a server reading 64 Parquet sources kept ~100 MiB more
    (bench/memory.py). Only the environment variable also reaches Arrow's C++ allocations, so it must come
    first; an explicit ARROW_DEFAULT_MEMORY_POOL wins."""
    if "pyarrow" not in sys.modules:
        os.environ.setdefault("ARROW_DEFAULT_MEMORY_POOL", "jemalloc")
