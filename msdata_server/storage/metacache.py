"""A source's listing and per-file metadata (units per file, Parquet footers, JSON Lines line offsets, the
WebDataset member index), kept in ``state_dir`` so a restart or a resume opens a remote source without listing
or reading footers again. One file per source identity (format, paths, selected columns); written atomically;
a file that cannot be read is ignored (the source is listed and scanned again). Each field's arrays of every
file are kept as one array and its offsets (a few members per source, not two per file: the members' headers
were most of a warm open's CPU)."""

from __future__ import annotations

import contextlib
import hashlib
import io
import json
import logging
import os
import tempfile
from dataclasses import dataclass
from typing import Any, Protocol

import numpy as np

from .listing import ListedFile

__all__ = ["MetaCache", "MetaShare", "SourceMeta"]

log = logging.getLogger(__name__)
_VERSION = 2  # 2: a field's arrays of every file packed in one member


@dataclass(slots=True)
class SourceMeta:
    """What opening a source learned: its files as listed, each file's unit row counts, why a file was skipped,
    and each format's arrays per file (``arrays[i]``) and JSON-able extras."""

    files: list[ListedFile]
    units: list[np.ndarray]
    skipped: dict[int, str]
    arrays: list[dict[str, np.ndarray]]
    extra: dict[str, Any]


class MetaShare(Protocol):
    """Who else may hold a source's kept metadata (in a cluster, the leader: ``cluster/metashare.py``)."""

    def fetch(self, identity: dict[str, Any], spec: Any) -> bytes | None:
        """The metadata file's bytes, or None: this node lists and reads the metadata itself."""
        ...


class MetaCache:
    """``<state_dir>/storage-meta/<identity digest>.npz``. In a cluster ``share`` fetches a file this node lacks
    from the leader, which lists each source once (the bytes of the same file: a JSON head and arrays, no pickle)."""

    def __init__(self, state_dir: str):
        self.dir = os.path.join(state_dir, "storage-meta")
        self.share: MetaShare | None = None

    @staticmethod
    def key(identity: dict[str, Any]) -> str:
        text = json.dumps({"v": _VERSION, **identity}, sort_keys=True, separators=(",", ":"))
        return hashlib.sha256(text.encode()).hexdigest()[:32]

    def path(self, identity: dict[str, Any]) -> str:
        return os.path.join(self.dir, self.key(identity) + ".npz")

    def load(self, identity: dict[str, Any], spec: Any = None) -> SourceMeta | None:
        """The kept metadata of a source; when this node has none and ``spec`` is given, the copy ``share``
        fetches (kept here too). None: list and read the metadata."""
        meta = self._load(identity)
        if meta is None and spec is not None and self.share is not None:
            blob = self.share.fetch(identity, spec)
            if blob is not None and self.put_bytes(identity, blob):
                meta = self._load(identity)
        return meta

    def read_bytes(self, identity: dict[str, Any]) -> bytes | None:
        """The kept file of a source as it is on disk (what ``share`` hands to another node), None if none."""
        try:
            with open(self.path(identity), "rb") as f:
                return f.read()
        except FileNotFoundError:
            return None

    def put_bytes(self, identity: dict[str, Any], blob: bytes) -> bool:
        """Keep a file another node sent (checked when loaded: a torn or foreign one is ignored)."""
        try:
            self._write(identity, blob)
        except OSError as e:
            log.warning("storage: cannot keep source metadata in %s (%s)", self.dir, e)
            return False
        return True

    def _write(self, identity: dict[str, Any], blob: bytes | memoryview) -> None:
        os.makedirs(self.dir, exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=self.dir, suffix=".tmp")
        try:
            with os.fdopen(fd, "wb") as f:
                f.write(blob)
            os.replace(tmp, self.path(identity))
        except BaseException:
            with contextlib.suppress(OSError):
                os.unlink(tmp)
            raise

    def _load(self, identity: dict[str, Any]) -> SourceMeta | None:
        path = self.path(identity)
        try:
            with np.load(path, allow_pickle=False) as z:
                head = json.loads(bytes(z["head"]).decode())
                n = len(head["files"])
                arrays: list[dict[str, np.ndarray]] = [{} for _ in range(n)]
                units = _unpack(z["units"], z["units.off"], np.ones(n, dtype=bool))
                for field in head["packed"]:
                    got = _unpack(z[f"a.{field}"], z[f"a.{field}.off"], z[f"a.{field}.has"].astype(bool))
                    for i, a in enumerate(got):
                        if a is not None:
                            arrays[i][field] = a
                for name in z.files:  # a field whose arrays differ in dtype or shape: one member per file
                    i, dot, field = name.partition(".")
                    if dot and i.isdigit():
                        arrays[int(i)][field] = z[name]
        except FileNotFoundError:
            return None
        except Exception as e:  # a torn or foreign file: list and scan again
            log.warning("storage: ignoring unreadable source metadata %s (%s); listing again", path, e)
            return None
        if head.get("identity") != identity:
            return None
        return SourceMeta(
            files=[ListedFile.from_json(f) for f in head["files"]],
            units=[u.astype(np.int64) if u is not None else np.zeros(0, np.int64) for u in units],
            skipped={int(k): v for k, v in head["skipped"].items()},
            arrays=arrays,
            extra=head["extra"],
        )

    def save(self, identity: dict[str, Any], meta: SourceMeta) -> None:
        """Write atomically; a state_dir that cannot be written only costs a listing next time (one warning)."""
        packed: list[str] = []
        head: dict[str, Any] = {
            "identity": identity,
            "files": [f.to_json() for f in meta.files],
            "skipped": {str(k): v for k, v in meta.skipped.items()},
            "extra": meta.extra,
            "packed": packed,
        }
        blobs: dict[str, np.ndarray] = {}
        blobs["units"], blobs["units.off"], _ = _pack([np.asarray(u, dtype=np.int64) for u in meta.units])
        for field in sorted({f for a in meta.arrays for f in a}):
            per_file = [a.get(field) for a in meta.arrays]
            got = [a for a in per_file if a is not None]
            if len({(a.dtype.str, a.shape[1:]) for a in got}) == 1 and got[0].ndim >= 1:
                packed.append(field)
                blobs[f"a.{field}"], blobs[f"a.{field}.off"], blobs[f"a.{field}.has"] = _pack(per_file)
            else:
                blobs.update({f"{i}.{field}": a for i, a in enumerate(per_file) if a is not None})
        blobs["head"] = np.frombuffer(json.dumps(head).encode(), dtype=np.uint8)
        try:
            buf = io.BytesIO()
            np.savez(buf, **blobs)  # type: ignore[arg-type]
            self._write(identity, buf.getbuffer())
        except OSError as e:
            log.warning("storage: cannot keep source metadata in %s (%s); the next start lists again", self.dir, e)


def _pack(arrays: list[np.ndarray | None]) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Arrays of one dtype and trailing shape (None: a file without one) as (their concatenation along the
    first axis, offsets into it (len + 1), which are present)."""
    got = [a for a in arrays if a is not None]
    sizes = [0 if a is None else len(a) for a in arrays]
    off = np.zeros(len(arrays) + 1, dtype=np.int64)
    np.cumsum(sizes, out=off[1:])
    data = np.concatenate(got) if got else np.zeros(0, dtype=np.int64)
    return data, off, np.array([a is not None for a in arrays], dtype=np.uint8)


def _unpack(data: np.ndarray, off: np.ndarray, has: np.ndarray) -> list[np.ndarray | None]:
    """The arrays ``_pack`` packed (views of ``data``)."""
    bounds = off.tolist()
    return [data[bounds[i] : bounds[i + 1]] if has[i] else None for i in range(len(has))]
