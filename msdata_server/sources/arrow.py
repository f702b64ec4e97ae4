"""Arrow IPC reader (file format, which Feather v2 is; also the stream format): memory-mapped, zero-copy
record batches, a numpy record-batch index."""

from __future__ import annotations

import numpy as np
import pyarrow as pa

from ._arrow import check_selected, selected_records
from .base import FileSource

__all__ = ["ArrowSource"]


class _Mapped:
    """An open IPC file: its memory map and its record batches (read lazily for the file format)."""

    def __init__(self, path: str):
        self.mm = pa.memory_map(path, "r")
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


class ArrowSource(FileSource):
    """Rows of one column (or a dict of several ``columns``) of Arrow IPC / Feather v2 files."""

    format = "arrow"
    extensions = (".arrow", ".feather", ".ipc", ".arrows")

    def _open(self, path: str) -> _Mapped:
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

    def _read_file(self, f: int, rows: np.ndarray) -> tuple[list, int]:
        cum = self.unit_cum[f]
        batches = np.searchsorted(cum, rows, side="right") - 1
        out: list = [None] * len(rows)
        nbytes = 0
        for b in np.unique(batches).tolist():
            sel = np.flatnonzero(batches == b)
            frows = rows[sel]
            try:
                m = self.handle(f)
                batch = m.batch(b)
                cols = [batch.column(m.schema.get_field_index(c)) for c in (self.columns or (self.column,))]
            except Exception as e:
                reason = self.error_reason(e)
                for k, r in zip(sel.tolist(), frows.tolist()):
                    out[k] = self.bad_sample(f, r, reason, f"record batch {b}: {e}", f"{self.paths[f]} batch {b}")
                continue

            def bad(k: int, reason: str, detail: str, _rows=frows) -> object:
                return self.bad_sample(f, int(_rows[k]), reason, detail)

            recs, nb = selected_records(cols, self.columns, frows - cum[b], max_bytes=self.max_bytes, bad=bad)
            nbytes += nb
            for k, rec in zip(sel.tolist(), recs):
                out[k] = rec
        return out, nbytes
