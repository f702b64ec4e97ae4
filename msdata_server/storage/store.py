"""The node's object store: pyarrow filesystems resolved from URIs (S3 with ``[storage]`` s3_endpoint and
s3_region; any other scheme ``pyarrow.fs.FileSystem.from_uri`` accepts), at most ``max_inflight`` requests at
once, every request retried (retry.py) and counted (stats.py). One Store per process (``get_store``); the
server configures it from node.toml before any job opens a source."""

from __future__ import annotations

import logging
import math
import os
import threading
import time
from collections import OrderedDict
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from datetime import UTC, datetime
from email.utils import parsedate_to_datetime
from typing import Any, TypeVar
from urllib.parse import urlsplit

from ..config import StorageConfig
from ..errors import ConfigError, StorageError
from .cache import DiskCache
from .listing import ListedFile
from .metacache import MetaCache
from .remotefile import RemoteFile
from .retry import RetryPolicy, with_retries
from .stats import StorageStats
from .uri import check_uri, fixed_part, glob_regex, split_uri

__all__ = ["Store", "configure", "get_store"]

log = logging.getLogger(__name__)
T = TypeVar("T")
_LIST_PAGE = 1000  # keys per listing page (S3 ListObjectsV2)
_RECENT_BYTES = 64 << 20  # ranges read lately, kept in memory for the other partitions of a source
_ETAGS = 1 << 17  # object versions whose first ETag is kept (~200 bytes each)
_REVALIDATE_S = 300.0  # seconds an object stays open before its next read opens (and checks) it again
# objects kept open for every reader of the process: an S3 object's open file is a few hundred bytes and holds no
# connection; another scheme's (HDFS...) may hold a descriptor or a socket until it is dropped
_NATIVES = {True: 8192, False: 64}  # by "is S3"


def _head_metadata(nf: Any) -> dict[str, str]:
    """What the open's HEAD answered (pyarrow keeps its headers as the file's metadata), keys in lower case;
    empty for a filesystem that gives none."""
    try:
        md = nf.metadata()
    except Exception:
        return {}
    out: dict[str, str] = {}
    for k, v in (md or {}).items():
        key = k.decode() if isinstance(k, bytes) else str(k)
        out[key.lower()] = v.decode(errors="replace") if isinstance(v, bytes) else str(v)
    return out


def _seconds(text: str) -> int | None:
    """Whole seconds since the epoch of an ISO 8601 or HTTP date; None when absent or unreadable."""
    if not text:
        return None
    try:
        dt = datetime.fromisoformat(text.replace("Z", "+00:00"))
    except ValueError:
        try:
            dt = parsedate_to_datetime(text)
        except (TypeError, ValueError):
            return None
    if dt.tzinfo is None:
        dt = dt.replace(tzinfo=UTC)
    return math.floor(dt.timestamp())


def _iso(seconds: int) -> str:
    return datetime.fromtimestamp(seconds, UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


def _version(obj: ListedFile) -> tuple[str, int, int]:
    return (obj.path, obj.size, obj.mtime_ns)


def _hidden(rel: str) -> bool:
    # as for local directories: Spark/Hadoop markers (_SUCCESS) and dot files are never data
    return any(p.startswith((".", "_")) for p in rel.split("/"))


class Store:
    """Filesystems, the request limit, retries and counters of this process."""

    def __init__(self, cfg: StorageConfig, state_dir: str | None = None):
        self.cfg = cfg
        # listings and per-file metadata of remote sources, kept across restarts (None: list every time)
        self.meta: MetaCache | None = MetaCache(state_dir) if state_dir else None
        self.stats = StorageStats()
        self.policy = RetryPolicy(retries=cfg.retries, give_up_s=cfg.give_up_s)
        self._inflight = threading.BoundedSemaphore(cfg.max_inflight)
        self.cache: DiskCache | None = (
            DiskCache(cfg.cache_dir, int(cfg.cache_gib * (1 << 30))) if cfg.cache_dir and cfg.cache_gib else None
        )
        self._fs: dict[str, Any] = {}
        self._lock = threading.Lock()
        self._pool: ThreadPoolExecutor | None = None
        self._read_pool: ThreadPoolExecutor | None = None
        self._recent: OrderedDict[str, bytes] = OrderedDict()  # ranges read lately, within _RECENT_BYTES
        self._recent_bytes = 0
        # each listed object version's ETag at its first open, the latest _ETAGS (beyond them, a rewrite within
        # the second of the listing's mtime goes unseen; the Last-Modified check still holds)
        self._etags: OrderedDict[tuple[str, int, int], str] = OrderedDict()
        # (file, opened at) by object version, S3 objects apart from other schemes' (_NATIVES)
        self._natives: dict[bool, OrderedDict[tuple[str, int, int], tuple[Any, float]]] = {
            True: OrderedDict(),
            False: OrderedDict(),
        }
        # an object opened longer ago than this is opened again (a HEAD) at its next read, which checks its
        # version: a rewrite of the same size under a running job is found within this time
        self.revalidate_s = _REVALIDATE_S

    def read_pool(self) -> ThreadPoolExecutor:
        """Threads for remote sources' batch reads (the loop's default executor has cpus + 4: too few to wait
        on the latency of 64 sources' requests at once); apart from ``map``'s, which those reads use."""
        with self._lock:
            if self._read_pool is None:
                self._read_pool = ThreadPoolExecutor(max_workers=self.cfg.max_inflight, thread_name_prefix="msd-read")
            return self._read_pool

    def map(self, fn: Callable[[Any], T], items: list[Any]) -> list[T]:
        """fn over items in the node's storage threads (up to max_inflight at once: reads of a batch's files
        or row groups overlap their latency), results in order."""
        with self._lock:
            if self._pool is None:
                self._pool = ThreadPoolExecutor(max_workers=self.cfg.max_inflight, thread_name_prefix="msd-storage")
            pool = self._pool
        return list(pool.map(fn, items))

    # ---- filesystems ----
    def resolve(self, uri: str) -> tuple[Any, str, str]:
        """(filesystem, path in it, the URI prefix that turns its paths back into URIs)."""
        scheme, rest = split_uri(uri)
        if scheme in ("s3", "s3a"):
            return self._s3(), rest, f"{scheme}://"
        import pyarrow.fs as pafs

        parts = urlsplit(uri)
        key = f"{parts.scheme}://{parts.netloc}"
        with self._lock:
            fs = self._fs.get(key)
        try:
            fs2, path = pafs.FileSystem.from_uri(uri)
        except Exception as e:
            raise ConfigError(f"{uri!r}: pyarrow has no filesystem for it ({e})") from None
        if fs is None:
            with self._lock:
                fs = self._fs.setdefault(key, fs2)
        prefix = uri[: len(uri) - len(rest)] if path == rest else key
        return fs, path, prefix

    def _s3(self) -> Any:
        with self._lock:
            fs = self._fs.get("s3")
            if fs is None:
                fs = self._fs["s3"] = self._make_s3()
            return fs

    def _make_s3(self) -> Any:
        import pyarrow.fs as pafs

        endpoint = self.cfg.s3_endpoint or os.environ.get("AWS_ENDPOINT_URL_S3") or os.environ.get("AWS_ENDPOINT_URL")
        region = self.cfg.s3_region or os.environ.get("AWS_REGION") or os.environ.get("AWS_DEFAULT_REGION") or ""
        kw: dict[str, Any] = {
            # our retry layer retries (with full jitter, for up to give_up_s) and counts every attempt
            "retry_strategy": pafs.AwsStandardS3RetryStrategy(max_attempts=1),
            "connect_timeout": 5.0,
            "request_timeout": 60.0,
        }
        if region:
            kw["region"] = region
        if endpoint:  # the constructor does not read AWS_ENDPOINT_URL itself
            u = urlsplit(endpoint)
            kw["endpoint_override"] = u.netloc + u.path.rstrip("/")
            kw["scheme"] = u.scheme or "https"
        return pafs.S3FileSystem(**kw)

    # ---- requests ----
    def request(self, fn: Callable[[], T], *, what: str, nbytes: Callable[[T], int] = lambda _: 0, count: int = 1) -> T:
        """fn() as ``count`` counted request(s) under the in-flight limit, retried."""

        def attempt() -> T:
            with self._inflight:
                t0 = time.perf_counter()
                try:
                    out = fn()
                except BaseException:
                    self.stats.request(0, time.perf_counter() - t0)
                    raise
                dt = time.perf_counter() - t0
            for _ in range(count):
                self.stats.request(0, dt / count)
            self.stats.add("bytes", nbytes(out))
            return out

        return with_retries(attempt, what=what, policy=self.policy, stats=self.stats)

    def read(self, f: RemoteFile, offset: int, n: int) -> bytes:
        """Bytes [offset, offset + n) of an open remote file (n > 0, within its size): from the ranges read
        lately (in memory: the partitions of a source read the same row groups), or the node's object cache,
        else one ranged request (kept in both)."""
        obj = f.obj
        key = DiskCache.key(obj, offset, n)
        with self._lock:
            recent = self._recent.get(key)
            if recent is not None:
                self._recent.move_to_end(key)
                return recent
        cache = self.cache if self.cache is not None and self.cache.enabled else None
        if cache is not None:
            hit = cache.get(key)
            if hit is not None and len(hit) == n:
                self.stats.add("cache_hits")
                self._remember(key, hit)
                return hit
            self.stats.add("cache_misses")

        def get() -> bytes:
            native = self._native(obj)
            try:
                data = native.read_at(n, offset)
            except BaseException:
                self._forget(obj, native)  # reopen on the retry (a reset connection)
                raise
            if len(data) != n:
                raise StorageError(self.changed(obj, f"a read of {n} bytes at {offset} gave {len(data)}"))
            return data

        data = self.request(get, what=f"object {obj.path}", nbytes=len)
        if cache is not None:
            cache.put(key, data)
        self._remember(key, data)
        return data

    def _native(self, obj: ListedFile) -> Any:
        """The object's open pyarrow file, shared by every RemoteFile of this version of it (a source's handle
        closed and opened again, another job's source, another partition): opened, a HEAD that checks its
        version, at most once per ``revalidate_s``; the latest _NATIVES kept (dropped, not closed: a read may be
        using one; it closes when the last reader lets it go)."""
        key, s3 = _version(obj), obj.path.startswith(("s3://", "s3a://"))
        kept = self._natives[s3]
        with self._lock:
            got = kept.get(key)
            if got is not None and time.monotonic() - got[1] <= self.revalidate_s:
                kept.move_to_end(key)
                return got[0]
        opened_at = time.monotonic()
        native = self._open_checked(obj)
        with self._lock:
            kept[key] = (native, opened_at)
            kept.move_to_end(key)
            while len(kept) > _NATIVES[s3]:
                kept.popitem(last=False)
        return native

    def _forget(self, obj: ListedFile, native: Any) -> None:
        kept = self._natives[obj.path.startswith(("s3://", "s3a://"))]
        with self._lock:
            got = kept.get(_version(obj))
            if got is not None and got[0] is native:
                del kept[_version(obj)]

    def _open_checked(self, obj: ListedFile) -> Any:
        """The object opened (pyarrow's open sends a HEAD), its size, modification time and ETag from that HEAD
        checked against the listing and against what earlier opens in this process saw: a rewrite of the same
        size is an error naming the object, as a changed size is. (No request beyond the HEAD.)"""
        fs, path, _ = self.resolve(obj.path)
        nf = fs.open_input_file(path)
        try:
            size = nf.size()
            if size != obj.size:
                raise StorageError(self.changed(obj, f"its size is {size} bytes now, {obj.size} when listed"))
            head = _head_metadata(nf)
            modified = _seconds(head.get("last-modified", ""))
            listed = obj.mtime_ns // 1_000_000_000
            if modified is not None and obj.mtime_ns > 0 and modified != listed:
                raise StorageError(self.changed(obj, f"modified at {_iso(modified)}, listed as of {_iso(listed)}"))
            etag = head.get("etag", "")
            if etag:
                with self._lock:
                    seen = self._etags.setdefault(_version(obj), obj.etag or etag)
                    self._etags.move_to_end(_version(obj))
                    if len(self._etags) > _ETAGS:
                        self._etags.popitem(last=False)
                if etag != seen:
                    raise StorageError(self.changed(obj, f"its ETag is {etag} now, {seen} when first read"))
        except BaseException:
            nf.close()
            raise
        return nf

    def _remember(self, key: str, data: bytes) -> None:
        if len(data) > _RECENT_BYTES // 8:
            return
        with self._lock:
            if key not in self._recent:
                self._recent[key] = data
                self._recent_bytes += len(data)
            while self._recent_bytes > _RECENT_BYTES:
                _, old = self._recent.popitem(last=False)
                self._recent_bytes -= len(old)

    def parquet_footer(self, obj: ListedFile) -> Any:
        """The FileMetaData of a Parquet object in one suffix-range read and no HEAD (the listing gave the size):
        pyarrow's dataset layer opens the object with its known size. A file that is not Parquet raises
        pyarrow's error unchanged (the source counts it as corrupt)."""
        import pyarrow.dataset as ds

        fs, path, _ = self.resolve(obj.path)

        def get() -> Any:
            return ds.ParquetFileFormat().make_fragment(path, filesystem=fs, file_size=obj.size).metadata

        return self.request(get, what=f"object {obj.path} (Parquet footer)", nbytes=lambda _: min(obj.size, 64 << 10))

    @staticmethod
    def changed(obj: ListedFile, detail: str) -> str:
        return (
            f"object {obj.path} changed since it was listed ({detail}); the order of a source's samples depends on "
            f"its files: restore the object, or start a new job over the changed data"
        )

    def open(self, obj: ListedFile) -> RemoteFile:
        return RemoteFile(self, obj)

    # ---- listing ----
    def list_entry(self, source: str, entry: str, extensions: tuple[str, ...]) -> list[ListedFile]:
        """The objects a path entry names, in the order of their path relative to its fixed part: a glob's
        matches, every object with one of ``extensions`` under a directory (``.../``), or one object.
        ConfigError naming the source, the entry and the cause when it names nothing."""
        import pyarrow.fs as pafs

        check_uri(entry, where=f"source {source!r}")
        fs, path, prefix = self.resolve(entry)
        where = f"source {source!r}: {entry}"
        scheme, _rest = split_uri(entry)
        is_glob = fixed_part(path) != path
        try:
            if is_glob:
                base = fixed_part(path).rstrip("/")
                rx = glob_regex(path[len(base) + 1 :])
                infos = self._select(fs, base, where)
                found = [i for i in infos if rx.match(i.path[len(base) + 1 :])]
                hint = "a glob that matched no objects"
            else:
                base = path.rstrip("/")
                one = None if path.endswith("/") else self.request(lambda: fs.get_file_info(base), what=where)
                if one is not None and one.type == pafs.FileType.File:
                    found, hint = [one], ""
                else:
                    infos = self._select(fs, base, where)
                    ext = tuple(e.lower() for e in extensions)
                    found = [
                        i
                        for i in infos
                        if not _hidden(i.path[len(base) + 1 :]) and (not ext or i.path.lower().endswith(ext))
                    ]
                    hint = f"a prefix with no {'/'.join(extensions)} objects"
        except StorageError as e:
            raise ConfigError(f"source {source!r}: cannot list {entry}: {e}") from None
        if not found:
            bucket = path.split("/", 1)[0]
            if scheme.startswith("s3") and self.request(lambda: fs.get_file_info(bucket), what=where).type == 0:
                raise ConfigError(f"source {source!r}: {entry}: the bucket {bucket!r} does not exist; fix the path")
            raise ConfigError(f"source {source!r}: no objects matched {entry!r} ({hint}); fix the path or the format")
        found.sort(key=lambda i: i.path)
        return [ListedFile(prefix + i.path, int(i.size), int(i.mtime_ns or 0)) for i in found]

    def _select(self, fs: Any, base: str, where: str) -> list[Any]:
        import pyarrow.fs as pafs

        sel = pafs.FileSelector(base, recursive=True, allow_not_found=True)
        holder: list[int] = [1]

        def get() -> list[Any]:
            infos = [i for i in fs.get_file_info(sel) if i.type == pafs.FileType.File]
            holder[0] = max(1, math.ceil(len(infos) / _LIST_PAGE))
            return infos

        infos = self.request(get, what=f"{where} (listing)")
        for _ in range(holder[0] - 1):  # the pages of a long listing, each a request
            self.stats.request(0, 0.0)
        return infos


_STORE: Store | None = None
_STORE_LOCK = threading.Lock()


def configure(cfg: StorageConfig, state_dir: str | None = None) -> Store:
    """Make the process's store follow ``cfg`` (the server calls it once, before any job opens a source);
    ``state_dir``: where remote sources' listings and metadata are kept across restarts."""
    global _STORE
    with _STORE_LOCK:
        _STORE = Store(cfg, state_dir)
        return _STORE


def get_store() -> Store:
    """The process's store (default settings when never configured: a CLI command, a test)."""
    global _STORE
    with _STORE_LOCK:
        if _STORE is None:
            _STORE = Store(StorageConfig())
        return _STORE
