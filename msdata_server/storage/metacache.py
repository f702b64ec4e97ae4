"""A source's listing and per-file metadata (units per file, Parquet footers, JSON Lines line offsets, the
WebDataset member index), kept in ``state_dir`` so a restart or a resume opens a remote source without listing
or reading footers again. One file per source identity (format, paths, selected columns); written atomically;
a file that cannot be read is ignored (the source is listed and scanned again)."""

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
_VERSION = 1


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
                units: list[np.ndarray] = [np.zeros(0, np.int64)] * n
                for name in z.files:
                    if name == "head":
                        continue
                    i, _, field = name.partition(".")
                    if field == "units":
                        units[int(i)] = z[name].astype(np.int64)
                    else:
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
            units=units,
            skipped={int(k): v for k, v in head["skipped"].items()},
            arrays=arrays,
            extra=head["extra"],
        )

    def save(self, identity: dict[str, Any], meta: SourceMeta) -> None:
        """Write atomically; a state_dir that cannot be written only costs a listing next time (one warning)."""
        head = {
            "identity": identity,
            "files": [f.to_json() for f in meta.files],
            "skipped": {str(k): v for k, v in meta.skipped.items()},
            "extra": meta.extra,
        }
        blobs: dict[str, np.ndarray] = {"head": np.frombuffer(json.dumps(head).encode(), dtype=np.uint8)}
        for i, u in enumerate(meta.units):
            blobs[f"{i}.units"] = u
            for field, a in meta.arrays[i].items():
                blobs[f"{i}.{field}"] = a
        try:
            buf = io.BytesIO()
            np.savez(buf, **blobs)  # type: ignore[arg-type]
            self._write(identity, buf.getbuffer())
        except OSError as e:
            log.warning("storage: cannot keep source metadata in %s (%s); the next start lists again", self.dir, e)
