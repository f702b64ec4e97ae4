"""The node's on-disk LRU cache of fetched object ranges (``[storage] cache_dir``, ``cache_gib``), shared by every
job of the node: a range read again (a second epoch, a restart, another job over the same objects) costs no
request, nor does a range inside one cached (reads coalesce differently when the read-ahead reaches further).
Keys name the object's version (path, size, mtime, etag) and the range, so a changed object never serves stale
bytes and the index of cached ranges per object version is rebuilt from the file names at start.
A cache directory that cannot be written (or a full disk) turns the cache off with one warning; reads go on."""

from __future__ import annotations

import contextlib
import hashlib
import logging
import os
import re
import tempfile
import threading
from collections import OrderedDict

from .listing import ListedFile

__all__ = ["DiskCache"]

log = logging.getLogger(__name__)

_KEY = re.compile(r"^([0-9a-f]{40})-(\d+)-(\d+)$")  # object version, offset, length


class DiskCache:
    """Files ``<dir>/<2 hex>/<key>``, at most ``max_bytes`` in all (least recently used removed first); the index
    (key -> size, in use order) lives in memory, rebuilt from the directory at start (oldest mtime first)."""

    def __init__(self, directory: str, max_bytes: int):
        self.dir = directory
        self.max_bytes = int(max_bytes)
        self.enabled = self.max_bytes > 0
        self._lock = threading.Lock()
        self._index: OrderedDict[str, int] = OrderedDict()
        self._ranges: dict[str, dict[int, int]] = {}  # object version -> offset -> length of its cached ranges
        self._total = 0
        if self.enabled:
            try:
                os.makedirs(self.dir, exist_ok=True)
                with tempfile.NamedTemporaryFile(dir=self.dir, delete=True):  # writable?
                    pass
                self._load()
            except OSError as e:
                self._off(e)

    def _load(self) -> None:
        found: list[tuple[float, str, int]] = []
        for sub in os.scandir(self.dir):
            if sub.is_dir():
                for f in os.scandir(sub.path):
                    if not f.name.endswith(".tmp"):
                        st = f.stat()
                        found.append((st.st_mtime, f.name, st.st_size))
        for _, key, size in sorted(found):
            self._index[key] = size
            self._total += size
            self._add_range(key)
        self._evict()

    def _off(self, e: OSError) -> None:
        self.enabled = False
        log.warning(
            "storage: the object cache in %s is off (%s); reads go to the store. Fix [storage] cache_dir (a writable "
            "local directory with room for cache_gib)",
            self.dir,
            e,
        )

    @staticmethod
    def key(obj: ListedFile, offset: int, n: int) -> str:
        version = f"{obj.path}\0{obj.size}\0{obj.mtime_ns}\0{obj.etag}"
        return f"{hashlib.sha256(version.encode()).hexdigest()[:40]}-{offset}-{n}"

    def _add_range(self, key: str) -> None:
        m = _KEY.match(key)
        if m is not None:
            self._ranges.setdefault(m[1], {})[int(m[2])] = int(m[3])

    def _drop_range(self, key: str) -> None:
        m = _KEY.match(key)
        if m is not None and (ranges := self._ranges.get(m[1])) is not None:
            ranges.pop(int(m[2]), None)
            if not ranges:
                del self._ranges[m[1]]

    def _covering(self, key: str) -> tuple[str, int] | None:
        """A cached range of the same object version that holds ``key``'s range: its key and where the range
        starts in it; None if none does (called with the lock held)."""
        m = _KEY.match(key)
        ranges = self._ranges.get(m[1]) if m is not None else None
        if m is None or not ranges:
            return None
        offset, n = int(m[2]), int(m[3])
        for start, length in ranges.items():
            if start <= offset and offset + n <= start + length:
                return f"{m[1]}-{start}-{length}", offset - start
        return None

    def _path(self, key: str) -> str:
        return os.path.join(self.dir, key[:2], key)

    def get(self, key: str) -> bytes | None:
        """The bytes of ``key``'s range: its own file, or its part of a cached range of the same object version
        that holds it; None when neither is cached."""
        if not self.enabled:
            return None
        m = _KEY.match(key)
        n = int(m[3]) if m is not None else -1  # -1: read the whole file
        with self._lock:
            at = 0
            if key not in self._index:
                found = self._covering(key)
                if found is None:
                    return None
                key, at = found
            self._index.move_to_end(key)
        try:
            with open(self._path(key), "rb") as f:
                f.seek(at)
                data = f.read(n)
            os.utime(self._path(key))  # the use order survives a restart
        except OSError:
            with self._lock:
                self._total -= self._index.pop(key, 0)
                self._drop_range(key)
            return None
        return data

    def put(self, key: str, data: bytes) -> None:
        if not self.enabled or len(data) > self.max_bytes:
            return
        path = self._path(key)
        try:
            os.makedirs(os.path.dirname(path), exist_ok=True)
            fd, tmp = tempfile.mkstemp(dir=os.path.dirname(path), suffix=".tmp")
            try:
                with os.fdopen(fd, "wb") as f:
                    f.write(data)
                os.replace(tmp, path)
            except BaseException:
                os.unlink(tmp)
                raise
        except OSError as e:  # not writable any more, or the disk is full
            self._off(e)
            return
        with self._lock:
            self._total += len(data) - self._index.pop(key, 0)
            self._index[key] = len(data)
            self._add_range(key)
            self._evict()

    def _evict(self) -> None:
        while self._total > self.max_bytes and self._index:
            key, size = self._index.popitem(last=False)
            self._total -= size
            self._drop_range(key)
            with contextlib.suppress(OSError):
                os.unlink(self._path(key))
