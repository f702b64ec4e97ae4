"""An open file descriptor read with ``os.pread``: thread-safe (no shared seek position), closed once."""

from __future__ import annotations

import os

__all__ = ["Fd"]


class Fd:
    """An open file descriptor read with pread (thread-safe, no shared seek position)."""

    def __init__(self, path: str):
        self.fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
        self.size = os.fstat(self.fd).st_size

    def pread(self, n: int, offset: int) -> bytes:
        return os.pread(self.fd, n, offset)

    def close(self) -> None:
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1
