"""Arrow IPC reader (file format, which Feather v2 is; also the stream format): memory-mapped, zero-copy
record batches, a numpy record-batch index; a batch's rows are gathered across its record batches and turned
into records at once (_units.py)."""

from __future__ import annotations

from typing import Any

import numpy as np
import pyarrow as pa

from ..storage import ListedFile, RemoteFile, is_uri
from ._arrow import check_selected
from ._units import UnitColumnsSource

__all__ = ["ArrowSource"]


class _Mapped:
    """An open IPC file: its memory map and its record batches (read lazily for the file format)."""

    def __init__(self, path: str, remote: RemoteFile | None = None):
        # a remote file is read by ranges (the footer, then each record batch it is asked for)
        self.mm = pa.memory_map(path, "r") if remote is None else pa.PythonFile(remote, mode="r")
        try:
            self.reader = pa.ipc.open_file(self.mm)
            self.schema = self.reader.schema
            self.num_batches = self.reader.num_record_batches
            self.batches = None
        except pa.ArrowInvalid:  # not the file format: an IPC stream (its batches map zero-copy too)
            self.mm.seek(0)
            self.reader = None
            stream = pa.ipc.open_stream(self.mm)
            self.schema = stream.schema
            self.batches = list(stream)
            self.num_batches = len(self.batches)

    def batch(self, b: int) -> pa.RecordBatch:
        return self.batches[b] if self.batches is not None else self.reader.get_batch(b)

    def close(self) -> None:
        self.reader = None
        self.batches = None
        self.mm.close()


class ArrowSource(UnitColumnsSource):
    """Rows of one column (or a dict of several ``columns``) of Arrow IPC / Feather v2 files."""

    format = "arrow"
    extensions = (".arrow", ".feather", ".ipc", ".arrows")

    def _prefetch(self, store: Any, obj: ListedFile) -> RemoteFile:
        """A remote file with its footer (schema and record-batch blocks) fetched in one suffix read."""
        fh = store.open(obj)
        fh.preload_tail(64 << 10)
        return fh

    def _open(self, path: str) -> _Mapped:
        if is_uri(path):
            remote = self.open_bytes(path)
            assert isinstance(remote, RemoteFile)
            return _Mapped(path, remote)
        return _Mapped(path)

    def _scan(self, i: int, path: str) -> np.ndarray:
        m = self._open(path)
        try:
            check_selected(self.name, path, m.schema, self.column, self.columns)
            units = np.array([m.batch(b).num_rows for b in range(m.num_batches)], dtype=np.int64)
        except BaseException:
            m.close()
            raise
        self.keep_open(i, m)
        return units

    def _unit_name(self) -> str:
        return "record batch"

    def _unit(self, f: int, b: int) -> list[pa.Array] | Exception:
        """The selected columns of record batch b of file f (zero-copy), or the exception that reading it raised."""
        try:
            m = self.handle(f)
            batch = m.batch(b)
            return [batch.column(m.schema.get_field_index(c)) for c in (self.columns or (self.column,))]
        except Exception as e:
            return e
