"""JSON Lines reader: a numpy index of line offsets built once per file by a chunked newline scan (the file
is never loaded whole), lines read by offset (pread), parsed with orjson."""

from __future__ import annotations

from functools import partial
from typing import Any, ClassVar

import numpy as np
import orjson

from ..errors import ConfigError, StorageError
from ..storage import RemoteFile, SourceMeta
from ._fd import Fd
from .base import FileSource, Ragged

__all__ = ["JsonlSource"]

_SCAN_CHUNK = 8 << 20
_SMALL = 16 << 10  # files up to this size are indexed from one read, line by line (100,000 small files: seconds)


def line_index(fh: Fd | RemoteFile) -> tuple[np.ndarray, np.ndarray]:
    """(starts, ends) byte offsets of the non-empty lines of a file, ends exclusive of the newline (read in
    chunks by offset: a remote object in a few large range reads)."""
    if fh.size <= _SMALL:  # one read and a scan by bytes.find: ~5x faster than numpy's for a few lines
        return _small_index(fh.pread(fh.size, 0))
    newlines = []
    size = 0
    while size < fh.size:
        block = fh.pread(_SCAN_CHUNK, size)
        if not block:
            break
        chunk = np.frombuffer(block, dtype=np.uint8)
        newlines.append(np.flatnonzero(chunk == 10).astype(np.int64) + size)
        size += len(block)
    nl = np.concatenate(newlines) if newlines else np.zeros(0, np.int64)
    if size and (len(nl) == 0 or nl[-1] != size - 1):
        nl = np.append(nl, size)  # a last line without a newline
    starts = np.concatenate(([0], nl[:-1] + 1)) if len(nl) else np.zeros(0, np.int64)
    keep = nl > starts  # drop empty lines
    return starts[keep].astype(np.int64), nl[keep].astype(np.int64)


def _small_index(block: bytes) -> tuple[np.ndarray, np.ndarray]:
    starts, ends = [], []
    pos, n = 0, len(block)
    while pos < n:
        end = block.find(b"\n", pos)
        if end < 0:
            end = n
        if end > pos:
            starts.append(pos)
            ends.append(end)
        pos = end + 1
    return np.array(starts, dtype=np.int64), np.array(ends, dtype=np.int64)


class JsonlSource(FileSource):
    """Values of one field (or a dict of several ``columns``) of the JSON objects, one object per line."""

    format = "jsonl"
    extensions = (".jsonl", ".ndjson", ".json")
    coalesce: ClassVar[int] = 1 << 20  # rows whose span is at most this many bytes are read in one pread

    def __init__(self, spec: Any, *, seed: int):
        self.starts: list[np.ndarray] | Ragged = []  # lists while scanning, then one flat array each (Ragged)
        self.ends: list[np.ndarray] | Ragged = []
        super().__init__(spec, seed=seed)
        self.starts, self.ends = Ragged.of(list(self.starts)), Ragged.of(list(self.ends))

    def _open(self, path: str) -> Fd | RemoteFile:
        return self.open_bytes(path)

    def _scan(self, i: int, path: str) -> np.ndarray:
        try:
            fh = self._open(path)
            try:
                starts, ends = line_index(fh)
                first = b""
                if i == 0 and len(starts):  # the first file's first object: checked for the column
                    first = fh.pread(int(min(ends[0] - starts[0], self.max_bytes)), int(starts[0]))
            finally:
                fh.close()
        except BaseException:
            assert isinstance(self.starts, list)
            assert isinstance(self.ends, list)
            self.starts.append(np.zeros(0, np.int64))
            self.ends.append(np.zeros(0, np.int64))
            raise
        assert isinstance(self.starts, list)
        assert isinstance(self.ends, list)
        self.starts.append(starts)
        self.ends.append(ends)
        if i == 0 and len(starts):
            self._check_column(path, first)
        return np.array([len(starts)], dtype=np.int64)

    def _check_column(self, path: str, line: bytes) -> None:
        """The first object of the first file must have the column (a config mistake, not bad data)."""
        try:
            obj = orjson.loads(line)
        except orjson.JSONDecodeError:
            return  # bad data, counted when read
        if not isinstance(obj, dict):
            return
        if self.columns is None and self.column not in obj:
            raise ConfigError(
                f"source {self.name!r}: the first object of {path} has no field {self.column!r}; its fields are "
                f"{sorted(obj)}. Set column = one of them in the source"
            )
        missing = [c for c in self.columns or () if c not in obj]
        if missing:
            raise ConfigError(
                f"source {self.name!r}: the first object of {path} has no field(s) {missing}; its fields are "
                f"{sorted(obj)}. Set columns = [...] to some of them in the source"
            )

    def _meta_arrays(self, i: int) -> dict[str, np.ndarray]:
        return {"starts": self.starts[i], "ends": self.ends[i]}

    def _meta_restore(self, meta: SourceMeta) -> None:
        z = np.zeros(0, np.int64)
        self.starts = [a.get("starts", z).astype(np.int64) for a in meta.arrays]
        self.ends = [a.get("ends", z).astype(np.int64) for a in meta.arrays]

    def _index_bytes(self) -> int:
        if isinstance(self.starts, Ragged) and isinstance(self.ends, Ragged):
            return super()._index_bytes() + self.starts.nbytes + self.ends.nbytes
        return super()._index_bytes() + sum(a.nbytes for a in self.starts) + sum(a.nbytes for a in self.ends)

    def _read_file(self, f: int, rows: np.ndarray) -> tuple[list, int]:
        starts, ends = self.starts[f][rows], self.ends[f][rows]
        sizes = ends - starts
        out: list = [None] * len(rows)
        ok = np.flatnonzero(sizes <= self.max_bytes)
        for k in np.flatnonzero(sizes > self.max_bytes).tolist():
            out[k] = self.bad_sample(
                f, int(rows[k]), "oversize", f"{int(sizes[k])} bytes > max_sample_bytes {self.max_bytes}"
            )
        if len(ok) == 0:
            return out, 0
        lo, hi = int(starts[ok].min()), int(ends[ok].max())
        try:
            fh = self.handle(f)
            if hi - lo <= self.coalesce:
                block = self._retry(lambda: fh.pread(hi - lo, lo))
                lines = [block[s - lo : e - lo] for s, e in zip(starts[ok].tolist(), ends[ok].tolist())]
            else:
                spans = zip(starts[ok].tolist(), ends[ok].tolist())
                lines = [self._retry(partial(fh.pread, e - s, s)) for s, e in spans]
        except (OSError, StorageError) as e:
            reason = self.error_reason(e)
            for k in ok.tolist():
                out[k] = self.bad_sample(f, int(rows[k]), reason, str(e), f"{self.paths[f]}: {e}")
            return out, 0
        nbytes = 0
        for k, line in zip(ok.tolist(), lines):
            out[k] = self._parse(f, int(rows[k]), line, int(sizes[k]))
            nbytes += len(line)
        return out, nbytes

    def _parse(self, f: int, row: int, line: bytes, size: int) -> object:
        if len(line) != size:
            return self.bad_sample(f, row, "read_error", f"short read: {len(line)} of {size} bytes (file changed?)")
        try:
            obj = orjson.loads(line)
        except orjson.JSONDecodeError as e:
            try:
                line.decode("utf-8")
            except UnicodeDecodeError as u:
                return self.bad_sample(f, row, "invalid_utf8", str(u))
            return self.bad_sample(f, row, "bad_json", str(e))
        if not isinstance(obj, dict):
            return self.bad_sample(f, row, "bad_json", f"a line holds a JSON {type(obj).__name__}, not an object")
        if self.columns is not None:
            missing = [c for c in self.columns if obj.get(c) is None]
            if missing:
                return self.bad_sample(f, row, "missing_field", f"no field(s) {missing} (fields: {sorted(obj)[:10]})")
            return {c: obj[c] for c in self.columns}
        value = obj.get(self.column)
        if value is None:
            return self.bad_sample(f, row, "missing_field", f"no field {self.column!r} (fields: {sorted(obj)[:10]})")
        return value
