"""The Source interface, bad-sample records, and the machinery every file format shares.

A Source addresses samples by ordinal (epoch * num_samples + pos) in its deterministic order (order.py) and
reads raw records. Bad data never raises: a bad sample comes back as a ``BadSample`` and is counted.
"""

from __future__ import annotations

import errno
import logging
import threading
import time
from collections import Counter, OrderedDict
from collections.abc import Callable, Mapping
from concurrent.futures import Executor
from dataclasses import dataclass, field
from typing import Any, ClassVar

import numpy as np

from msdata_client.source import Shuffle

from ..errors import ConfigError, StorageError
from ..storage import ListedFile, RemoteFile, SourceMeta, get_store, is_uri, local_path
from ._fd import Fd
from .handles import SourceHandles, node_handles
from .order import Order
from .paths import expand_files

__all__ = [
    "BAD_REASONS",
    "BadDataLog",
    "BadSample",
    "FileSource",
    "Ragged",
    "ReadResult",
    "Source",
    "SourceStats",
    "dominant_reason",
    "selected_columns",
    "shuffle_of",
]

log = logging.getLogger(__name__)

# Every kind of bad sample, as counted in statistics.
BAD_REASONS = (
    "bad_json",  # a JSON Lines line that is not a JSON object
    "corrupt",  # a record or row group that cannot be decoded
    "corrupt_file",  # a file skipped at open (counted once per file; its rows are not in the order)
    "image_tokens_exceed_seq_len",  # a picture document whose image placeholders alone exceed seq_len (vlm)
    "invalid_utf8",  # text that is not valid UTF-8
    "missing_field",  # a record without the configured column, or a null value
    "oversize",  # larger than max_sample_bytes
    "read_error",  # an I/O error that persisted through the retries
    "storage_error",  # an object-store read that failed for good, skipped by [job] on_read_error = "skip"
    "transform_error",  # the transform raised on this sample
    "video_decode_error",  # a clip that does not decode: not a video, no video stream, past the give-up limits (vlm)
    "video_tokens_exceed_seq_len",  # a document whose image and video placeholders together exceed seq_len (vlm)
    "worker_crash",  # the sample killed transform workers repeatedly
)


def dominant_reason(bad: Mapping[str, int]) -> str:
    """The reason most of these bad samples (counts by reason) had, with its share: for error messages."""
    total = sum(bad.values())
    if not total:
        return "no bad sample counted here yet"
    reason, n = max(bad.items(), key=lambda kv: (kv[1], kv[0]))
    return f"{reason} ({n} of {total} bad samples read)"


TRANSIENT_ERRNOS = frozenset(
    {errno.EIO, errno.EAGAIN, errno.EINTR, errno.ETIMEDOUT, errno.EBUSY, errno.ESTALE, errno.ECONNRESET}
)


@dataclass(frozen=True, slots=True)
class BadSample:
    """A sample that could not be read or transformed; ``reason`` is one of BAD_REASONS.

    ``scope`` (default: the location) keys the log-once: a corrupt row group logs once, not once per row.
    """

    reason: str
    location: str
    detail: str = ""
    scope: str = ""


class BadDataLog:
    """Counts bad samples by reason and logs each (reason, scope) once, up to ``limit`` lines per source."""

    def __init__(self, source: str, *, limit: int = 200):
        self.source = source
        self.limit = limit
        self.counts: Counter[str] = Counter()
        self._seen: set[tuple[str, str]] = set()
        self._lock = threading.Lock()

    def record(self, bad: BadSample) -> None:
        key = (bad.reason, bad.scope or bad.location)
        with self._lock:
            self.counts[bad.reason] += 1
            if key in self._seen:
                return
            if len(self._seen) >= self.limit:
                if len(self._seen) == self.limit:
                    self._seen.add(("", ""))
                    log.warning("source %s: more than %d bad-data places; logging no more", self.source, self.limit)
                return
            self._seen.add(key)
        log.warning("source %s: skipping bad sample (%s) at %s: %s", self.source, bad.reason, bad.location, bad.detail)

    def snapshot(self) -> dict[str, int]:
        with self._lock:
            return dict(self.counts)


@dataclass(frozen=True, slots=True, kw_only=True)
class SourceStats:
    """What a source has read so far and what its index costs."""

    name: str
    format: str
    files: int
    files_skipped: int
    num_samples: int
    rows_read: int
    bytes_read: int
    bad_samples: Mapping[str, int]
    index_bytes: int
    open_files: int


@dataclass(frozen=True, slots=True)
class ReadResult:
    """Records of one read, in ordinal order, and the raw bytes they took."""

    records: list
    nbytes: int


class Source:
    """A source of samples in a deterministic order; subclasses implement ``_read_file`` (or ``read_batch``)."""

    format: ClassVar[str] = ""

    def __init__(self, spec: Any, *, seed: int):
        self.spec = spec
        self.name: str = spec.name
        self.seed = int(seed)
        self.order: Order | None = None
        self.bad = BadDataLog(self.name)
        self._rows_read = 0
        self._bytes_read = 0
        self._lock = threading.RLock()  # reads run in threads; one read at a time per source
        # [job] on_read_error: "fail" stops the job on an object-store read that failed for good (StorageError);
        # "skip" counts the unit's samples as bad (storage_error). open_source sets it.
        self.on_read_error = "fail"

    @property
    def _order(self) -> Order:
        if self.order is None:
            raise RuntimeError(f"source {self.name!r} has no sample order: a Source subclass sets it when it opens")
        return self.order

    @property
    def num_samples(self) -> int:
        """Samples per epoch."""
        return self._order.num_samples

    def locate_many(self, ordinals) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """(epoch, file_index, row) arrays for ordinals."""
        return self._order.locate(np.asarray(ordinals, dtype=np.int64))

    def locate(self, ordinal: int) -> tuple[int, int, int]:
        """(epoch, file_index, row) of one ordinal: a pure function of (seed, name, ordinal)."""
        e, f, r = self.locate_many(np.array([ordinal], dtype=np.int64))
        return int(e[0]), int(f[0]), int(r[0])

    def sample_ids(self, ordinals) -> np.ndarray:
        """Stable global ids, file_index << 32 | row (the same sample has the same id in every epoch)."""
        _, f, r = self.locate_many(ordinals)
        return (f << 32) | r

    def location(self, ordinal: int) -> str:
        """A human-readable place of an ordinal, for logs."""
        _, f, r = self.locate(ordinal)
        return f"{self.name} row {r}" if f == 0 else f"{self.name} file {f} row {r}"

    def read(self, ordinals) -> list[object]:
        """Raw records in ordinal order; a BadSample for each bad one."""
        return self.read_batch(ordinals).records

    def read_batch(self, ordinals) -> ReadResult:
        raise NotImplementedError

    def read_executor(self) -> Executor | None:
        """Where the loader runs this source's reads: None for the loop's default threads."""
        return None

    def _account(self, rows: int, nbytes: int) -> None:
        self._rows_read += rows
        self._bytes_read += nbytes

    def _files_info(self) -> tuple[int, int, int]:
        """(files, files_skipped, open_files)."""
        return 0, 0, 0

    def statistics(self) -> SourceStats:
        files, skipped, open_files = self._files_info()
        return SourceStats(
            name=self.name,
            format=self.format,
            files=files,
            files_skipped=skipped,
            num_samples=self.num_samples,
            rows_read=self._rows_read,
            bytes_read=self._bytes_read,
            bad_samples=self.bad.snapshot(),
            index_bytes=self._index_bytes(),
            open_files=open_files,
        )

    def _index_bytes(self) -> int:
        return self.order.nbytes if self.order is not None else 0

    def memory(self) -> dict[str, int]:
        """Bytes this source holds, by what (status ``sources[...].memory``): ``order``, the order's cached
        permutations; ``metadata``, its index arrays (row counts, offsets, row-group starts); ``handles``, its
        open handles (estimated: a Parquet footer decoded takes ~3x its serialized size); ``decoded``, decoded
        units cached (Parquet row groups)."""
        order = self.order
        return {
            "order": order.cache_bytes() if order is not None else 0,
            "metadata": self._index_bytes(),
            "handles": self._handles_bytes(),
            "decoded": self._decoded_bytes(),
        }

    def _handles_bytes(self) -> int:
        return 0

    def open_files(self) -> int:
        """Handles this source holds open now (cheap: status asks every second for every source)."""
        return self._files_info()[2]

    def _decoded_bytes(self) -> int:
        return 0

    def trim(self) -> None:
        """Drop caches that only speed up reads close together in time (the loader calls it when idle)."""
        if self.order is not None:
            self.order.trim()

    def close(self) -> None:
        """Release file handles and caches. Idempotent."""

    def __enter__(self):
        return self

    def __exit__(self, *exc) -> None:
        self.close()


class Ragged:
    """Per-file int64 arrays of varying length as one flat array and offsets (CSR): ``r[f]`` is file f's (a
    view), with no numpy object kept per file (100,000 files: one array, not 100,000)."""

    __slots__ = ("flat", "offsets")

    def __init__(self, flat: np.ndarray, offsets: np.ndarray):
        self.flat, self.offsets = flat, offsets

    @classmethod
    def of(cls, arrays: list[np.ndarray]) -> Ragged:
        offsets = np.zeros(len(arrays) + 1, dtype=np.int64)
        np.cumsum([len(a) for a in arrays], out=offsets[1:])
        flat = np.concatenate(arrays).astype(np.int64, copy=False) if arrays else np.zeros(0, np.int64)
        return cls(flat, offsets)

    def __getitem__(self, f: int) -> np.ndarray:
        return self.flat[self.offsets[f] : self.offsets[f + 1]]

    def __len__(self) -> int:
        return len(self.offsets) - 1

    def __iter__(self):
        return (self[f] for f in range(len(self)))

    @property
    def nbytes(self) -> int:
        return self.flat.nbytes + self.offsets.nbytes


@dataclass(slots=True)
class _Lru:
    """A small LRU keyed by anything, bounded by entry count and by total size."""

    max_items: int
    max_bytes: int
    items: OrderedDict = field(default_factory=OrderedDict)
    sizes: dict = field(default_factory=dict)
    total: int = 0

    def get(self, key):
        v = self.items.get(key)
        if v is not None:
            self.items.move_to_end(key)
        return v

    def put(self, key, value, size: int, on_evict: Callable | None = None) -> None:
        self.items[key] = value
        self.sizes[key] = size
        self.total += size
        while len(self.items) > 1 and (len(self.items) > self.max_items or self.total > self.max_bytes):
            k, v = self.items.popitem(last=False)
            self.total -= self.sizes.pop(k)
            if on_evict is not None:
                on_evict(v)

    def clear(self, on_evict: Callable | None = None) -> None:
        if on_evict is not None:
            for v in self.items.values():
                on_evict(v)
        self.items.clear()
        self.sizes.clear()
        self.total = 0


def selected_columns(spec: Any) -> tuple[str, ...] | None:
    """The spec's ``columns`` (several columns per record: the transform gets a dict by name), or None when it
    selects one ``column``; ConfigError for a malformed list."""
    cols = getattr(spec, "columns", None)
    if cols is None or (not isinstance(cols, str) and len(cols) == 0):
        return None
    if isinstance(cols, str) or not all(isinstance(c, str) and c for c in cols) or len(set(cols)) != len(cols):
        raise ConfigError(
            f"source {spec.name!r}: columns={cols!r} must be a list of distinct non-empty column names, "
            f'e.g. columns = ["image", "caption"]'
        )
    return tuple(cols)


def shuffle_of(spec: Any) -> Shuffle:
    """The read order a spec asks for (``[[source]] shuffle``; the default, rows mixed across files, for a
    spec object without the field)."""
    settings = getattr(spec, "shuffle_settings", None)
    return settings() if settings is not None else Shuffle()


def meta_identity(spec: Any) -> dict[str, Any]:
    """What keys a remote source's listing and metadata in the state_dir (``storage.metacache``)."""
    columns = selected_columns(spec)
    return {
        "format": spec.format,
        "paths": list(spec.paths),
        "column": spec.column,
        "columns": None if columns is None else list(columns),
    }


class FileSource(Source):
    """A source over files: path expansion, skipping unreadable files, the order, grouping reads by file,
    retries of transient I/O errors, and a bounded cache of open handles.

    A record is the value of ``column``, or a dict by name of ``columns`` when the spec selects several.
    Subclasses implement ``_scan(i, path) -> unit row counts`` (raise ConfigError for a configuration mistake,
    anything else marks the file unreadable), ``_open(path)``/``_close(handle)``, and
    ``_read_file(f, rows) -> (records, nbytes)`` (or ``_read_rows`` to read the rows of a batch's files at once).
    """

    extensions: ClassVar[tuple[str, ...]] = ()
    # open handles per source, within the node's LRU ([node] open_files, handles.py): None keeps the order's
    # lanes + 4 (the mixed order reads 32 files at once: 36 descriptors, ~1 MiB of Parquet footers; the
    # file-local order reads one: 5); the index is numpy
    max_open: ClassVar[int | None] = None
    retries: ClassVar[int] = 3
    backoff: ClassVar[float] = 0.01  # seconds, doubled at every retry

    def __init__(self, spec: Any, *, seed: int):
        super().__init__(spec, seed=seed)
        self.column: str = spec.column
        self.columns: tuple[str, ...] | None = selected_columns(spec)
        self.max_bytes: int = int(spec.max_sample_bytes)
        # resized once ordered
        self._handles = SourceHandles(node_handles(), self._lock, self._close, self.max_open or 4)
        self._warm: dict[str, Any] = {}  # what the scan of remote files needs, fetched ahead in parallel
        self.skipped: dict[int, str] = {}
        store = get_store()
        remote = any(is_uri(str(p)) and local_path(str(p)) is None for p in spec.paths)
        meta_cache = store.meta if remote else None
        identity = meta_identity(spec)
        meta = meta_cache.load(identity, spec) if meta_cache is not None else None
        if meta is not None:  # a restart, a resume, another node's copy: no listing, no footer read
            self._set_files(meta.files)
            units = meta.units
            self.skipped = dict(meta.skipped)
            self.bad.counts["corrupt_file"] += len(self.skipped)
            self._meta_restore(meta)
        else:
            self._set_files(expand_files(spec.name, spec.format, spec.paths, self.extensions))
            units = self._scan_all(store)
            if meta_cache is not None:
                meta_cache.save(identity, self._meta_collect(units))
        if len(self.skipped) == len(self.paths):
            self.close()
            raise ConfigError(
                f"source {self.name!r}: none of its {len(self.paths)} {spec.format} file(s) could be read "
                f"(first: {self.paths[0]}: {self.skipped[0]}); check that the files are valid {spec.format}"
            )
        self.unit_cum = Ragged.of([np.concatenate(([0], np.cumsum(u))) for u in units])
        shuffle = shuffle_of(spec)
        self.order = Order.from_units(
            seed=self.seed, name=self.name, units=units, window=shuffle.window, mode=shuffle.mode, spread=shuffle.spread
        )
        self._handles.max_items = self.max_open or self.order.lanes + 4
        if self.order.num_samples == 0:
            self.close()
            raise ConfigError(f"source {self.name!r}: its files {list(self.paths)[:3]}... hold no rows")

    def _set_files(self, files: list[ListedFile]) -> None:
        self._remote = any(is_uri(f.path) for f in files)
        self.paths: tuple[str, ...] = tuple(f.path for f in files)
        # what remote reads need (the listed version of each object); a local source keeps its paths only
        self.files: tuple[ListedFile, ...] = tuple(files) if self._remote else ()
        self._listed = {f.path: f for f in self.files}
        self._index = {f.path: i for i, f in enumerate(self.files)}

    def _scan_all(self, store: Any) -> list[np.ndarray]:
        """Every file's unit row counts; files that cannot be read are skipped (counted). Remote files' footers
        are fetched first, in parallel up to [storage] max_inflight."""
        remote = [p for p in self.paths if is_uri(p)]
        if remote and type(self)._prefetch is not FileSource._prefetch:

            def warm(path: str) -> tuple[str, Any]:
                try:
                    return path, self._prefetch(store, self._listed[path])
                except Exception:  # the scan reads it again and says why
                    return path, None

            from concurrent.futures import ThreadPoolExecutor

            with ThreadPoolExecutor(max_workers=min(store.cfg.max_inflight, 64)) as ex:
                self._warm = {p: got for p, got in ex.map(warm, remote) if got is not None}
        units: list[np.ndarray] = []
        for i, p in enumerate(self.paths):
            try:
                u = np.asarray(self._scan(i, p), dtype=np.int64)
            except ConfigError:
                self.close()
                raise
            except StorageError as e:  # the store refused or failed for good: nothing to skip, the job cannot start
                self.close()
                raise ConfigError(f"source {self.name!r}: cannot read {p}: {e}") from None
            except Exception as e:  # a truncated or corrupt file: skip it, never fatal
                self.skipped[i] = f"{type(e).__name__}: {e}"
                self.bad.counts["corrupt_file"] += 1
                log.error("source %s: skipping unreadable file %s: %s", self.name, p, self.skipped[i])
                u = np.zeros(0, dtype=np.int64)
            units.append(u)
        self._warm.clear()
        return units

    def _meta_collect(self, units: list[np.ndarray]) -> SourceMeta:
        """What the scan learned, for the metadata cache (formats add their arrays in ``_meta_arrays``)."""
        arrays = [self._meta_arrays(i) for i in range(len(self.paths))]
        return SourceMeta(list(self.files), units, dict(self.skipped), arrays, self._meta_extra())

    # ---- subclass hooks ----
    def _prefetch(self, store: Any, obj: ListedFile) -> Any:
        """What the scan of a remote file needs first (a footer), fetched for every remote file in parallel (up
        to [storage] max_inflight) before the scan; ``_scan`` finds it with ``prefetched(path)``."""
        return None

    def prefetched(self, path: str) -> Any:
        return self._warm.pop(path, None)

    def _meta_arrays(self, i: int) -> dict[str, np.ndarray]:
        """A format's per-file index (beyond unit row counts) to keep in the metadata cache."""
        return {}

    def _meta_extra(self) -> dict[str, Any]:
        return {}

    def _meta_restore(self, meta: SourceMeta) -> None:
        """Take the per-file index back from the metadata cache instead of scanning."""

    def _scan(self, i: int, path: str) -> np.ndarray:
        raise NotImplementedError

    def _open(self, path: str) -> Any:
        raise NotImplementedError

    def _close(self, handle: Any) -> None:
        close = getattr(handle, "close", None)
        if close is not None:
            close()

    def _read_file(self, f: int, rows: np.ndarray) -> tuple[list, int]:
        raise NotImplementedError

    # ---- shared machinery ----
    def open_bytes(self, path: str) -> Fd | RemoteFile:
        """A file of the source for ranged reads (``pread(n, offset)``, ``size``): a descriptor, or the object
        through the store (its listed size and version)."""
        if is_uri(path):
            warm = self._warm.pop(path, None)
            return warm if isinstance(warm, RemoteFile) else get_store().open(self._listed[path])
        return Fd(path)

    def keep_open(self, f: int, handle: Any) -> None:
        """Put a handle opened while scanning into the cache, if the node's LRU has room (else close it: at 1,024
        sources, keeping it would only close another source's)."""
        if len(self._handles.lru) < self._handles.lru.limit:
            self._handles.put(f, handle)
        else:
            self._close(handle)

    def handle(self, f: int) -> Any:
        """The open handle of file f (opened on demand, least recently used closed beyond max_open)."""
        h = self._handles.get(f)
        if h is None:
            h = self._retry(lambda: self._open(self.paths[f]))
            self._handles.put(f, h)
        return h

    def _retry(self, fn: Callable[[], Any]) -> Any:
        """Call fn, retrying transient OSErrors (EIO, EAGAIN, ...) with exponential backoff."""
        delay = self.backoff
        for attempt in range(self.retries + 1):
            try:
                return fn()
            except OSError as e:
                if e.errno not in TRANSIENT_ERRNOS or attempt == self.retries:
                    raise
                log.info("source %s: transient read error (%s), retry %d in %.3fs", self.name, e, attempt + 1, delay)
            time.sleep(delay)  # a backoff between retries, not synchronisation
            delay *= 2

    def bad_sample(self, f: int, row: int, reason: str, detail: str = "", scope: str = "") -> BadSample:
        b = BadSample(reason, f"{self.paths[f]} row {row}", detail, scope)
        self.bad.record(b)
        return b

    def error_reason(self, e: BaseException) -> str:
        """The bad-sample reason of a read error; raises a StorageError again when the job says
        ``on_read_error = "fail"`` (the job stops with it, naming the object and the last status code)."""
        if isinstance(e, StorageError):
            if self.on_read_error != "skip":
                raise e
            return "storage_error"
        if isinstance(e, OSError) and e.errno in TRANSIENT_ERRNOS:
            return "read_error"
        return "corrupt"

    def location(self, ordinal: int) -> str:
        _, f, r = self.locate(ordinal)
        return f"{self.paths[f]} row {r}"

    def read_batch(self, ordinals) -> ReadResult:
        ords = np.asarray(ordinals, dtype=np.int64).reshape(-1)
        _, files, rows = self.locate_many(ords)
        with self._lock:
            out, nbytes = self._read_rows(files, rows)
            self._account(len(ords), nbytes)
        return ReadResult(out, nbytes)

    def _read_rows(self, files: np.ndarray, rows: np.ndarray) -> tuple[list, int]:
        """Records of (files[k], rows[k]) in that order and their bytes: ``_read_file`` once per file (a format
        that reads rows of several files at once overrides this); remote files' reads overlap."""
        out: list = [None] * len(rows)
        nbytes = 0
        fs = np.unique(files).tolist()
        picks = [np.flatnonzero(files == f) for f in fs]
        got = self._overlapped(fs, lambda k: self._read_file(fs[k], rows[picks[k]]))
        for idx, (recs, nb) in zip(picks, got):
            nbytes += nb
            for i, r in zip(idx.tolist(), recs):
                out[i] = r
        return out, nbytes

    def read_executor(self) -> Executor | None:
        return get_store().read_pool() if self._remote else None

    def _overlapped(self, files: list[int], fn: Callable[[int], Any]) -> list[Any]:
        """fn(k) for each k in range(len(files)): in order here, or, for remote files whose handles all fit the
        open-handle cache, in the store's threads after opening the handles here (the cache is not thread-safe;
        a handle open already is only looked up)."""
        distinct = set(files)
        if not self._remote or len(files) < 2 or len(distinct) > min(self._handles.max_items, node_handles().limit):
            return [fn(k) for k in range(len(files))]
        try:
            for f in distinct:
                self.handle(f)
        except Exception:  # the reads below say why, file by file
            return [fn(k) for k in range(len(files))]
        if any(self._handles.get(f) is None for f in distinct):  # closed for the node's bound meanwhile
            return [fn(k) for k in range(len(files))]
        return get_store().map(fn, list(range(len(files))))

    def _files_info(self) -> tuple[int, int, int]:
        return len(self.paths), len(self.skipped), len(self._handles)

    def _index_bytes(self) -> int:
        return super()._index_bytes() + self.unit_cum.nbytes

    def _handles_bytes(self) -> int:
        return sum(self._handle_size(h) for h in self._handles.values())

    def _handle_size(self, handle: Any) -> int:
        """Estimated bytes one open handle holds (a descriptor: a few hundred)."""
        return 256

    def trim(self) -> None:
        """Close the open handles too (a Parquet footer with string statistics costs ~28 KB in memory; reopening
        costs ~0.2 ms when reading resumes); skipped while a read holds the lock, so the caller never blocks."""
        if self._lock.acquire(blocking=False):
            try:
                super().trim()
                self._trim_locked()
            finally:
                self._lock.release()

    def _trim_locked(self) -> None:
        if not self._remote:  # a remote handle holds no descriptor, and reopening it would cost a request
            self._handles.clear()

    @property
    def keeps_decoded(self) -> bool:
        """Whether trim keeps decoded units: a remote unit costs a request (and its latency) to read again, so
        a remote source keeps its bounded LRU of them across bursts."""
        return self._remote

    def close(self) -> None:
        with self._lock:
            self._handles.clear()
