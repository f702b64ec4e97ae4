"""What a source's file listing says of each file, in one place: its path (or URI), size, modification time
and etag where the store gives one. Resume checks of a source's files compare these."""

from __future__ import annotations

import os
from dataclasses import dataclass

__all__ = ["ListedFile", "local_file"]


@dataclass(frozen=True, slots=True)
class ListedFile:
    """One file of a source as listed: ``path`` is a local path or a URI; ``etag`` is "" where the store (or
    pyarrow's listing of it) gives none, and then ``size`` and ``mtime_ns`` identify the version."""

    path: str
    size: int
    mtime_ns: int
    etag: str = ""

    def to_json(self) -> list:
        return [self.path, self.size, self.mtime_ns, self.etag]

    @classmethod
    def from_json(cls, v: list) -> ListedFile:
        return cls(str(v[0]), int(v[1]), int(v[2]), str(v[3]))


def local_file(path: str) -> ListedFile:
    st = os.stat(path)
    return ListedFile(path, int(st.st_size), int(st.st_mtime_ns))
