"""Parquet reader: files kept open, a numpy row-group index, only the needed row groups and columns read,
a small LRU of decoded row groups (windows follow row groups, so a window's reads hit the cache; the mixed
order reads a window in each of its lanes at once, so the LRU keeps the groups of lanes windows, within
cache_bytes); a batch's rows are gathered across its row groups and turned into records at once (_units.py)."""

from __future__ import annotations

from typing import Any, ClassVar

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

from ..storage import ListedFile, SourceMeta, get_store, is_uri
from ._arrow import check_selected
from ._units import UnitColumnsSource
from .base import _Lru

__all__ = ["ParquetSource"]


class ParquetSource(UnitColumnsSource):
    """Rows of one column (or a dict of several ``columns``) of Parquet files."""

    format = "parquet"
    extensions = (".parquet", ".parq", ".pq")
    # decoded row groups kept, within cache_bytes; None: lanes * (most row groups in a window) + 8
    cache_groups: ClassVar[int | None] = None
    cache_bytes: ClassVar[int] = 256 << 20

    def __init__(self, spec: Any, *, seed: int):
        self._footers: dict[int, bytes] = {}  # remote files' footers (serialized FileMetaData): no re-read on open
        self._groups = _Lru(max_items=self.cache_groups or 8, max_bytes=self.cache_bytes)
        super().__init__(spec, seed=seed)
        self._groups.max_items = self.cache_groups or self._order.lanes * self._groups_per_window() + 8

    def _groups_per_window(self) -> int:
        """The most row groups one window spans (small row groups merge into one window, whose rows are read
        in shuffled order: the LRU must hold all of a window's groups for each lane, or they are read again)."""
        order = self._order
        if not len(order.starts):
            return 1
        # every file's windows at once, in source-wide rows (one searchsorted over all units, not one per file)
        f = np.repeat(np.arange(len(order.counts)), np.diff(order.offsets))
        base = self._file_first[f]
        starts = order.starts + base
        nxt = np.append(order.starts[1:], 0)
        last_of_file = np.zeros(len(starts), dtype=bool)
        last_of_file[order.offsets[1:][np.diff(order.offsets) > 0] - 1] = True
        ends = np.where(last_of_file, order.counts[f], nxt) + base  # each window's end (the next one's start)
        first = np.searchsorted(self._unit_first, starts, side="right")
        last = np.searchsorted(self._unit_first, ends - 1, side="right")
        return max(1, int((last - first).max()) + 1)

    def _open(self, path: str) -> pq.ParquetFile:
        if is_uri(path):  # by ranges through the store: the footer in one suffix read (or kept), then column chunks
            footer = self._footers.get(self._index[path])
            md = pq.read_metadata(pa.BufferReader(footer)) if footer is not None else None
            return pq.ParquetFile(self.open_bytes(path), metadata=md, page_checksum_verification=True)
        # a local file is read where asked: pre-buffering (coalesced reads through Arrow's I/O threads) took 10x
        # the CPU of the read itself for a row group of 128 rows (0.33 ms against 0.035 ms); opened here, not by
        # path (Arrow resolving a filesystem for the path was a sixth of an open, 32,768 opens at 1,024 sources)
        return _OwnedFile(pa.OSFile(path), page_checksum_verification=True, pre_buffer=False)

    def _prefetch(self, store: Any, obj: ListedFile) -> Any:
        """A remote file's footer: one suffix-range read, no HEAD."""
        return store.parquet_footer(obj)

    def _scan(self, i: int, path: str) -> np.ndarray:
        if is_uri(path):  # the footer alone (fetched ahead in parallel); the file opens when first read
            md = self.prefetched(path) or get_store().parquet_footer(self._listed[path])
            check_selected(self.name, path, md.schema.to_arrow_schema(), self.column, self.columns)
            out = pa.BufferOutputStream()
            md.write_metadata_file(out)
            self._footers[i] = out.getvalue().to_pybytes()
            return np.array([md.row_group(g).num_rows for g in range(md.num_row_groups)], dtype=np.int64)
        pf = self._open(path)
        try:
            check_selected(self.name, path, pf.schema_arrow, self.column, self.columns)
            md = pf.metadata
            units = np.array([md.row_group(g).num_rows for g in range(md.num_row_groups)], dtype=np.int64)
        except BaseException:
            pf.close()
            raise
        self.keep_open(i, pf)
        return units

    def _unit_name(self) -> str:
        return "row group"

    def _handle_size(self, handle: Any) -> int:
        try:
            return 3 * handle.metadata.serialized_size + 1024  # decoded, a footer takes ~3x (module handles.py)
        except Exception:
            return 1024

    def _decoded_bytes(self) -> int:
        return self._groups.total

    def _meta_arrays(self, i: int) -> dict[str, np.ndarray]:
        footer = self._footers.get(i)
        return {} if footer is None else {"footer": np.frombuffer(footer, dtype=np.uint8)}

    def _meta_restore(self, meta: SourceMeta) -> None:
        self._footers = {i: a["footer"].tobytes() for i, a in enumerate(meta.arrays) if "footer" in a}

    def _prefetch_units(self, pairs: list[tuple[int, int]]) -> None:
        """The row groups of a batch not decoded yet, of remote files, read at once in the store's threads (one
        thread per file: a ParquetFile is read by one thread at a time); a failed one is left for ``_unit`` to
        read again and judge."""
        if not self._remote:
            return
        by_file: dict[int, list[int]] = {}
        for f, g in pairs:
            if self._groups.get((f, g)) is None:
                by_file.setdefault(f, []).append(g)
        if len(by_file) < 2:
            return
        names = list(self.columns) if self.columns is not None else [self.column]
        files = list(by_file)

        def read(k: int) -> list[tuple[int, list[pa.Array]]]:
            f, got = files[k], []
            for g in by_file[f]:
                try:
                    table = self.handle(f).read_row_group(g, columns=names, use_threads=len(names) > 1)
                except Exception:
                    continue
                got.append((g, [_one_array(table.column(c)) for c in names]))
            return got

        for f, groups in zip(files, self._overlapped(files, read)):
            for g, cols in groups:
                self._groups.put((f, g), cols, sum(c.get_total_buffer_size() for c in cols))

    def _unit(self, f: int, g: int) -> list[pa.Array] | Exception:
        """The decoded columns (``columns`` order) of row group g of file f, or the exception that reading them
        raised."""
        key = (f, g)
        got = self._groups.get(key)
        if got is None:
            names = list(self.columns) if self.columns is not None else [self.column]
            try:
                table = self._retry(lambda: self.handle(f).read_row_group(g, columns=names, use_threads=len(names) > 1))
                got = [_one_array(table.column(c)) for c in names]
                size = sum(c.get_total_buffer_size() for c in got)  # fresh arrays: what nbytes says, at once
            except Exception as e:
                if self.error_reason(e) in ("read_error", "storage_error"):
                    return e  # persistent I/O or store trouble: try again next time
                got, size = e, 0  # cached too: a corrupt row group is not decoded again for every batch
            self._groups.put(key, got, size)
        return got

    def _trim_locked(self) -> None:
        if not self.keeps_decoded:
            self._groups.clear()  # a source read rarely would hold its decoded window for nothing
        super()._trim_locked()

    def close(self) -> None:
        with self._lock:
            self._groups.clear()
        super().close()


class _OwnedFile(pq.ParquetFile):
    """A ParquetFile over a file this source opened (``pa.OSFile``): closing it closes the file (ParquetFile
    leaves a file object it was given open)."""

    def close(self, force: bool = False) -> None:
        super().close(force=True)


def _one_array(col: pa.ChunkedArray) -> pa.Array:
    """A row group's column as one array: its one chunk as it is (combine_chunks costs ~10 us even then, a copy).
    Server PSS 4 s after the loaders went idle is the same either way (85-88 MiB at 64 sources); sampled at once,
    it varies by tens of MiB with how recently row groups were freed (the allocator returns pages after ~1 s)."""
    return col.chunk(0) if col.num_chunks == 1 else col.combine_chunks()
