"""Lineage rows: which document piece sat where in which step, as the server recomputes it by replay.

One row per document piece of a micro-batch, in the order the pieces sit in the batch (``sample_ids`` and
``source_ids`` of a batch list the same pieces in the same order). The columns (ARCHITECTURE §4.6):

==========  =======  ===========================================================================
column      type     meaning
==========  =======  ===========================================================================
step        int64    the training step
micro       int32    the micro-batch within the step
dp_rank     int32    the data-parallel coordinate (data group) that received it
row         int32    the packed row within the micro-batch
offset      int32    the piece's first token within that row
length      int32    tokens of the piece
source      string   the source's name
file        string   the file the document came from (``<synthetic:NAME>`` for a synthetic source)
file_row    int64    the 0-based row (record, line) within ``file``
sample_id   int64    the stable global sample id (``file_index << 32 | file_row``), as in the batch
piece       int32    the piece's index within its document (long documents are split at seq_len)
skipped     bool     the step was skipped (``loader.skip``): planned, never delivered
==========  =======  ===========================================================================

and, beyond the fixed ones: ``source_id`` (the source's index, as in the batch), ``file_index``, ``epoch`` and
``ordinal`` (the position in the source's deterministic order), ``doc_offset`` (the piece's first token within
its document). The server sends columns (files by index); this module turns them into a pyarrow Table, a list
of dicts, or a Parquet file. No torch here.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import numpy as np

from .errors import ConfigError, ProtocolError

__all__ = [
    "COLUMNS",
    "FIXED_COLUMNS",
    "ReplayWindow",
    "check_skip",
    "fetch",
    "from_wire",
    "table_or_rows",
    "to_pylist",
    "to_table",
    "write_parquet",
]

# name -> numpy dtype ("str": a string column); the first twelve are the fixed contract
COLUMNS: dict[str, str] = {
    "step": "int64",
    "micro": "int32",
    "dp_rank": "int32",
    "row": "int32",
    "offset": "int32",
    "length": "int32",
    "source": "str",
    "file": "str",
    "file_row": "int64",
    "sample_id": "int64",
    "piece": "int32",
    "skipped": "bool",
    "source_id": "int32",
    "file_index": "int32",
    "epoch": "int64",
    "ordinal": "int64",
    "doc_offset": "int32",
}
FIXED_COLUMNS = tuple(COLUMNS)[:12]


def from_wire(frame: Mapping[str, Any]) -> dict[str, np.ndarray]:
    """Columns from the server's answer: numeric columns as lists, ``source`` and ``file`` as indexes into
    ``sources`` and ``files`` (per source, a list of paths). ProtocolError for a malformed answer."""
    try:
        cols = frame["columns"]
        sources = list(frame["sources"])
        files = [list(f) for f in frame["files"]]
        out = {k: np.asarray(cols[k], dtype=t) for k, t in COLUMNS.items() if t != "str"}
        n = out["step"].size
        if any(v.shape != (n,) for v in out.values()):
            raise ValueError("columns of different lengths")
        src, fidx = out["source_id"], out["file_index"]
        out["source"] = np.array([sources[s] for s in src.tolist()], dtype=object)
        out["file"] = np.array([files[s][f] for s, f in zip(src.tolist(), fidx.tolist())], dtype=object)
    except (KeyError, TypeError, ValueError, IndexError) as e:
        raise ProtocolError(f"malformed lineage answer from the server: {e!r}") from None
    return {k: out[k] for k in COLUMNS}


def to_pylist(cols: Mapping[str, np.ndarray]) -> list[dict]:
    """One dict per row, plain Python values."""
    names = list(COLUMNS)
    lists = [cols[k].tolist() for k in names]
    return [dict(zip(names, vals)) for vals in zip(*lists)]


def to_table(cols: Mapping[str, np.ndarray]):
    """A pyarrow Table with the documented schema (ImportError when pyarrow is missing)."""
    import pyarrow as pa

    fields, arrays = [], []
    for name, t in COLUMNS.items():
        typ = pa.string() if t == "str" else pa.from_numpy_dtype(np.dtype(t))
        fields.append(pa.field(name, typ, nullable=False))
        arrays.append(pa.array(cols[name].tolist() if t == "str" else cols[name], type=typ))
    return pa.Table.from_arrays(arrays, schema=pa.schema(fields))


def write_parquet(cols: Mapping[str, np.ndarray], path: str) -> None:
    """Write the rows to a Parquet file at ``path``."""
    import pyarrow.parquet as pq

    pq.write_table(to_table(cols), path)


def check_skip(steps: object, defer: object) -> dict:
    """The skip a rank asks for, as it travels in its state: ``{"steps": k, "defer": d}`` for k steps from the
    loaded state, ``{"start": A, "stop": B, "defer": d}`` for the absolute steps A..B-1; ConfigError naming the fix."""
    if not isinstance(defer, bool):
        raise ConfigError(f"skip(defer={defer!r}) must be True or False")
    if isinstance(steps, (tuple, list)):
        ok = len(steps) == 2 and all(isinstance(x, int) and not isinstance(x, bool) and x >= 0 for x in steps)
        if not ok:
            raise ConfigError(f"skip(steps={steps!r}): a range must be (A, B), two ints >= 0 (the steps A..B-1)")
        a, b = steps
        if a >= b:
            raise ConfigError(f"skip(steps=({a}, {b})): A must be below B (it skips the steps A..B-1)")
        return {"start": a, "stop": b, "defer": defer}
    if isinstance(steps, bool) or not isinstance(steps, int) or steps < 1:
        raise ConfigError(
            f"skip(steps={steps!r}): steps must be an int >= 1 (the number of steps to skip) or a range (A, B)"
        )
    return {"steps": steps, "defer": defer}


def fetch(endpoint: str, job: str, start: int, stop: int, *, rank: int | None = None, timeout: float = 600.0) -> dict:
    """Ask a server for the lineage of ``job``'s steps [start, stop) (one rank's data group when ``rank`` is
    given), on a connection of its own; columns as ``from_wire`` gives them. A refusal raises its error type."""
    from .errors import CheckpointError, MsdataError, RemoteError
    from .wire import request

    frame = {"t": "lineage", "job": job, "start": start, "stop": stop, "rank": rank}
    reply = request(endpoint, frame, timeout=timeout)
    if reply.get("t") == "refused":
        kinds: dict[str, type[MsdataError]] = {"ConfigError": ConfigError, "CheckpointError": CheckpointError}
        kind, msg = reply.get("kind", ""), reply.get("message", "refused")
        raise kinds[kind](msg) if kind in kinds else RemoteError(msg, kind)
    return from_wire(reply)


def table_or_rows(cols: Mapping[str, np.ndarray]):
    """A pyarrow Table, or a list of dicts where pyarrow is not installed."""
    try:
        return to_table(cols)
    except ImportError:
        return to_pylist(cols)


class ReplayWindow:
    """The micro-batches of steps [start, stop) as ``rank`` saw them (``DataClient(job, replay=(A, B))``),
    rebuilt by the server from replayed plans; asked one step at a time on a connection of its own, so the
    running job is not disturbed. Arrays arrive as dtype, shape and base64 bytes (exact, never pickled)."""

    def __init__(self, endpoint: str, job: str, rank: int, window: object, *, timeout: float = 600.0):
        a, b = window if isinstance(window, tuple) and len(window) == 2 else (None, None)
        if not (isinstance(a, int) and isinstance(b, int)) or isinstance(a, bool) or isinstance(b, bool):
            a = b = -1
        if not 0 <= a < b:
            raise ConfigError(f"replay={window!r} must be (A, B): steps A up to B (excluded), 0 <= A < B")
        self.endpoint, self.job, self.rank, self.timeout = endpoint, job, rank, timeout
        self.start, self.stop = a, b
        self._next = self.start
        self._ready: list[tuple[int, int, dict[str, np.ndarray]]] = []

    def next(self) -> tuple[int, int, dict[str, np.ndarray]]:
        """(step, micro, arrays) of the next micro-batch; StopIteration after the window."""
        while not self._ready:
            if self._next >= self.stop:
                raise StopIteration
            self._ready = self._fetch(self._next)
            self._next += 1
        return self._ready.pop(0)

    def _fetch(self, step: int) -> list[tuple[int, int, dict[str, np.ndarray]]]:
        import base64
        import socket

        from .errors import CheckpointError, RemoteError
        from .wire import FrameReader, encode, recv_into_reader

        frame = {"t": "replay", "id": 1, "job": self.job, "start": step, "stop": step + 1, "rank": self.rank}
        out = []
        with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as s:
            s.settimeout(self.timeout)
            s.connect(self.endpoint)
            s.sendall(encode(frame))
            reader = FrameReader()
            while True:
                while (f := reader.next_frame()) is None:
                    recv_into_reader(s, reader)
                t = f.get("t")
                if t == "rbatch":
                    arrays = {}
                    for name, dtype, shape, data in f["fields"]:
                        buf = bytearray(base64.b64decode(data))  # writable: torch takes it without a warning
                        arrays[name] = np.frombuffer(buf, dtype=np.dtype(dtype)).reshape(shape)
                    out.append((int(f["step"]), int(f["micro"]), arrays))
                elif t == "replay":
                    return out
                elif t == "refused":
                    kind, msg = f.get("kind", ""), f.get("message", "refused")
                    errs: dict[str, type[Exception]] = {"ConfigError": ConfigError, "CheckpointError": CheckpointError}
                    raise errs[kind](msg) if kind in errs else RemoteError(msg, kind)
                else:
                    raise ProtocolError(f"unexpected frame {t!r} in a replay answer")
