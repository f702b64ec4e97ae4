"""A remote object opened for reading: ranged reads through the store (retries, counters, the cache), and a
file-like face (seek/read) for the format libraries (pyarrow's Parquet and IPC readers, tarfile)."""

from __future__ import annotations

import io
from typing import Any, Protocol

from .listing import ListedFile

__all__ = ["RangeReader", "RemoteFile"]


class RangeReader(Protocol):
    """Who serves a remote file's ranges (the Store: retries, counters, the cache)."""

    def read(self, f: RemoteFile, offset: int, n: int) -> bytes: ...


class RemoteFile(io.RawIOBase):
    """Object ``obj`` read by ranges (``pread``) or as a seekable raw stream; the size is the listing's (no
    request to learn it). Thread-safe for ``pread``; the stream position is for one reader at a time. Opening
    and closing one costs nothing: the store keeps the object's pyarrow file for every reader of it."""

    def __init__(self, store: RangeReader, obj: ListedFile):
        super().__init__()
        self.store = store
        self.obj = obj
        self.size = obj.size
        self._pos = 0
        self._preloaded: tuple[int, bytes] = (0, b"")  # (offset, bytes) fetched ahead (a footer), served locally

    # ---- ranged reads ----
    def pread(self, n: int, offset: int) -> bytes:
        """Bytes [offset, offset + n) (fewer at the end of the object)."""
        offset = int(offset)
        n = max(0, min(int(n), self.size - offset))
        if n == 0:
            return b""
        at, data = self._preloaded
        if at <= offset and offset + n <= at + len(data):
            return data[offset - at : offset - at + n]
        return self.store.read(self, offset, n)

    def preload_tail(self, n: int) -> None:
        """Fetch the last n bytes now (one suffix-range read: a Parquet or Arrow footer) so that the format
        library's reads in them cost no request."""
        n = min(int(n), self.size)
        if n > 0:
            self._preloaded = (self.size - n, self.store.read(self, self.size - n, n))

    # ---- file-like ----
    def readable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return True

    def tell(self) -> int:
        return self._pos

    def seek(self, offset: int, whence: int = io.SEEK_SET) -> int:
        base = {io.SEEK_SET: 0, io.SEEK_CUR: self._pos, io.SEEK_END: self.size}[whence]
        self._pos = max(0, base + int(offset))
        return self._pos

    def readinto(self, b: Any) -> int:
        data = self.pread(len(b), self._pos)
        b[: len(data)] = data
        self._pos += len(data)
        return len(data)

    def read(self, size: int | None = -1) -> bytes:
        if size is None or size < 0:
            size = self.size - self._pos
        data = self.pread(size, self._pos)
        self._pos += len(data)
        return data

    def readall(self) -> bytes:
        return self.read(-1)

    def close(self) -> None:
        self._preloaded = (0, b"")
        super().close()
