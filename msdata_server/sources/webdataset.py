"""WebDataset reader: tar shards whose members sharing a key (the path up to the first dot of the basename)
form one sample, delivered as ``{extension: bytes}``.

Each shard's member headers are scanned once (tarfile) into numpy arrays of data offsets, sizes and extension
ids, with a CSR index of samples over members; a read is one ``pread`` of a sample's span. Samples are rows
in the deterministic order like rows of any other file format (one unit per shard), so seek, partitions and
sample ids behave exactly as for Parquet. A truncated shard, a sample lacking a part (an extension most
samples have, or one that ``columns`` asks for) or one with a part twice is a counted bad sample. A corrupt
header mid-shard is skipped to the next valid ustar header (512-byte blocks, checksum): the samples after it
are read, the one that lost a member is bad.
"""

from __future__ import annotations

import io
import logging
import os
import re
import tarfile
from dataclasses import dataclass
from functools import partial
from typing import Any, BinaryIO, ClassVar

import numpy as np

from ..errors import ConfigError, StorageError
from ..storage import RemoteFile, SourceMeta, is_uri
from ._fd import Fd
from .base import FileSource

__all__ = ["ShardIndex", "WebDatasetSource", "shard_index", "split_member_name"]

log = logging.getLogger(__name__)

# webdataset's rule: key = directory + basename up to its first dot; extension = the rest of the basename
_KEY_EXT = re.compile(r"^((?:.*/|)[^./][^./]*)\.([^/]+)$")
_BLOCK = 512  # tar block size
_REMOTE_SCAN_BUFFER = 8 << 20  # a remote shard's headers are scanned through reads of this size
_SPAN_SLACK = 64 << 10  # a sample's unselected members up to this many bytes are read along in the one pread

# why a sample is bad at scan time (ShardIndex.flags)
_OK, _CUT, _DUPLICATE, _LAST = 0, 1, 2, 3  # _LAST: the last sample before a truncation (bad if it lacks parts)
_DAMAGED = 4  # a sample next to a corrupt header (bad if it lacks parts: the lost member was one of them)


def split_member_name(name: str) -> tuple[str, str] | None:
    """(key, extension) of a tar member name, or None for a name that belongs to no sample (no extension)."""
    m = _KEY_EXT.match(name)
    return (m.group(1), m.group(2)) if m else None


@dataclass(frozen=True, slots=True, kw_only=True)
class ShardIndex:
    """One shard's members and samples as arrays: sample s owns members ``starts[s]:starts[s+1]``."""

    offsets: np.ndarray  # int64 per member: where its data starts in the file
    sizes: np.ndarray  # int64 per member
    exts: np.ndarray  # int32 per member: extension id (WebDatasetSource.extensions)
    starts: np.ndarray  # int64 [samples + 1]
    flags: np.ndarray  # uint8 per sample: _OK, _CUT, _DUPLICATE, _LAST or _DAMAGED
    truncated: str  # why the shard looks truncated; "" when it ends with the end-of-archive blocks
    damaged: str = ""  # where corrupt headers were skipped; "" when none

    @property
    def num_samples(self) -> int:
        return len(self.starts) - 1

    @property
    def nbytes(self) -> int:
        return self.offsets.nbytes + self.sizes.nbytes + self.exts.nbytes + self.starts.nbytes + self.flags.nbytes

    @classmethod
    def empty(cls) -> ShardIndex:
        z = np.zeros(0, np.int64)
        return cls(
            offsets=z,
            sizes=z,
            exts=np.zeros(0, np.int32),
            starts=np.zeros(1, np.int64),
            flags=np.zeros(0, np.uint8),
            truncated="",
        )


def _valid_header(block: bytes) -> bool:
    """Whether a 512-byte block is a ustar header with a good checksum (where to resume after damage)."""
    if len(block) < _BLOCK or block[257:262] != b"ustar":
        return False
    try:
        tarfile.TarInfo.frombuf(block, tarfile.ENCODING, "surrogateescape")
    except tarfile.HeaderError:
        return False
    return True


def _resync(fh, start: int, size: int) -> int | None:
    """The offset of the first valid header after ``start`` (scanning 512-byte blocks), or None."""
    pos = start + _BLOCK
    chunk = 1 << 20
    while pos < size:
        fh.seek(pos)
        buf = fh.read(chunk)
        for k in range(0, len(buf) - _BLOCK + 1, _BLOCK):
            if buf[k + 257 : k + 262] == b"ustar" and _valid_header(buf[k : k + _BLOCK]):
                return pos + k
        pos += max(_BLOCK, len(buf) - len(buf) % _BLOCK)
        if len(buf) < chunk:
            return None
    return None


def shard_index(path: str, ext_ids: dict[str, int], remote: RemoteFile | None = None) -> ShardIndex:
    """Scan a tar shard's headers (data is skipped, never read); ``ext_ids`` assigns extension ids and grows.
    A remote shard is scanned through a large read buffer (a few range reads, not one per header).

    tarfile.ReadError for a file that is no tar at all; a shard cut short keeps the samples before the cut and
    marks the ones it touches. A corrupt header mid-shard is skipped: the scan resumes at the next valid ustar
    header, and the samples on either side of the damage are bad if they lack a part (``damaged``).
    """
    if remote is not None:
        with io.BufferedReader(remote, buffer_size=_REMOTE_SCAN_BUFFER) as fh:
            return _scan_tar(fh, remote.size, ext_ids)
    with open(path, "rb") as fh:
        return _scan_tar(fh, os.path.getsize(path), ext_ids)


def _scan_tar(fh: BinaryIO, size: int, ext_ids: dict[str, int]) -> ShardIndex:
    """The index of a tar read from ``fh`` (``size`` bytes): members grouped into samples by key, each sample
    flagged (cut, duplicate part, damaged); past a corrupt header the scan resumes at the next valid one."""
    offsets: list[int] = []
    sizes: list[int] = []
    exts: list[int] = []
    starts: list[int] = []
    flags: list[int] = []
    truncated = ""
    damaged: list[str] = []
    after_damage = False
    key = None
    seen: set[int] = set()
    tf = tarfile.open(fileobj=fh, mode="r:")  # noqa: SIM115  (reopened past a damaged header; fh is the caller's)
    while True:
        try:
            m = tf.next()
        except tarfile.ReadError as e:
            m, err = None, str(e)
        else:
            err = ""
        if m is None:
            end = tf.offset  # where the next header would be: the end-of-archive blocks (zeros) must lie there
            fh.seek(end)
            tail = fh.read(_BLOCK)
            if not err and len(tail) == _BLOCK and tail.count(0) == _BLOCK:
                break
            resume = _resync(fh, end, size) if len(tail) == _BLOCK else None
            if resume is None:
                truncated = err or f"no end-of-archive marker at byte {end} of {size}"
                break
            damaged.append(f"a corrupt header at byte {end}, next valid one at byte {resume}")
            if flags and flags[-1] == _OK:
                flags[-1] = _DAMAGED  # the lost member may have been one of its parts
            after_damage = True  # ... or the first part of the sample that comes next
            fh.seek(resume)
            tf = tarfile.open(fileobj=fh, mode="r:")  # noqa: SIM115  (as above)
            continue
        if not m.isreg():
            continue
        ke = split_member_name(m.name)
        if ke is None:
            continue
        if ke[0] != key:  # consecutive members with one key are one sample
            key = ke[0]
            seen.clear()
            starts.append(len(offsets))
            flags.append(_DAMAGED if after_damage else _OK)
        after_damage = False
        if m.offset_data + m.size > size:
            flags[-1] = _CUT
            truncated = f"member {m.name!r} ends at byte {m.offset_data + m.size} of {size}"
            break
        e_id = ext_ids.setdefault(ke[1], len(ext_ids))
        if e_id in seen:
            flags[-1] = _DUPLICATE
        seen.add(e_id)
        offsets.append(m.offset_data)
        sizes.append(m.size)
        exts.append(e_id)
    if truncated and flags and flags[-1] == _OK:
        flags[-1] = _LAST
    starts.append(len(offsets))
    return ShardIndex(
        offsets=np.array(offsets, dtype=np.int64),
        sizes=np.array(sizes, dtype=np.int64),
        exts=np.array(exts, dtype=np.int32),
        starts=np.array(starts, dtype=np.int64),
        flags=np.array(flags, dtype=np.uint8),
        truncated=truncated,
        damaged="; ".join(damaged),
    )


class _Block:
    """A span of a remote shard read in one request: reads inside it are served from memory."""

    def __init__(self, fh: RemoteFile, start: int, data: bytes):
        self.fh, self.start, self.data = fh, start, data

    def pread(self, n: int, offset: int) -> bytes:
        at = offset - self.start
        if at >= 0 and at + n <= len(self.data):
            return self.data[at : at + n]
        return self.fh.pread(n, offset)


class WebDatasetSource(FileSource):
    """Samples of WebDataset tar shards as ``{extension: bytes}``: the extensions named by ``columns`` (an
    entry "jpg;png" takes the first of them a sample has), or else those that more than half of the samples
    have (``column`` is not used)."""

    format = "webdataset"
    extensions = (".tar",)
    span_slack: ClassVar[int] = _SPAN_SLACK
    coalesce_bytes: ClassVar[int] = 4 << 20  # a remote read's samples of a shard within this span: one request

    def __init__(self, spec: Any, *, seed: int):
        self.shards: list[ShardIndex] = []
        self.ext_ids: dict[str, int] = {}
        super().__init__(spec, seed=seed)
        names = list(self.ext_ids)
        if self.columns is not None:  # each entry an extension, or alternatives "jpg;png" (the first present wins)
            groups = [tuple(e for e in c.split(";") if e) for c in self.columns]
            missing = [c for c, g in zip(self.columns, groups) if not any(e in self.ext_ids for e in g)]
            if missing:
                self.close()
                raise ConfigError(
                    f"source {self.name!r}: no sample of its shards has the extension(s) {missing}; the "
                    f"extensions are {names}. Set columns = [...] to some of them ('jpg;png' takes either)"
                )
            wanted = [tuple(self.ext_ids[e] for e in g if e in self.ext_ids) for g in groups]
        else:  # the extensions most samples have: a sample lacking one of them is bad
            held = np.zeros(len(names), dtype=np.int64)
            for s in self.shards:
                held += np.bincount(s.exts, minlength=len(names))
            wanted = [(i,) for i in np.flatnonzero(2 * held > self.num_samples).tolist()]
            rare = [n for i, n in enumerate(names) if (i,) not in wanted]
            if rare:
                log.warning(
                    "source %s: extensions %s are held by at most half of the samples and not delivered; "
                    "set columns = [...] to choose the parts",
                    self.name,
                    rare,
                )
        self.wanted: tuple[tuple[int, ...], ...] = tuple(wanted)  # per record field: its extension ids
        self.ext_names: tuple[str, ...] = tuple(names)
        self._wanted_text = [self.columns[k] if self.columns else names[g[0]] for k, g in enumerate(wanted)]

    def _open(self, path: str) -> Fd | RemoteFile:
        return self.open_bytes(path)

    def _scan(self, i: int, path: str) -> np.ndarray:
        try:
            remote = self.open_bytes(path) if is_uri(path) else None
            assert remote is None or isinstance(remote, RemoteFile)
            idx = shard_index(path, self.ext_ids, remote)
        except BaseException:
            self.shards.append(ShardIndex.empty())
            raise
        self.shards.append(idx)
        if idx.damaged:
            log.error(
                "source %s: shard %s is damaged (%s); the scan resumed at the next valid header, %d samples "
                "indexed, a sample that lost a part is counted bad",
                self.name,
                path,
                idx.damaged,
                idx.num_samples,
            )
        if idx.truncated:
            log.error(
                "source %s: shard %s is truncated (%s); %d samples before the cut indexed, a sample it "
                "touches is counted bad",
                self.name,
                path,
                idx.truncated,
                idx.num_samples,
            )
        return np.array([idx.num_samples], dtype=np.int64)

    def _index_bytes(self) -> int:
        return super()._index_bytes() + sum(s.nbytes for s in self.shards)

    _INDEX_FIELDS = ("offsets", "sizes", "exts", "starts", "flags")

    def _meta_arrays(self, i: int) -> dict[str, np.ndarray]:
        return {k: getattr(self.shards[i], k) for k in self._INDEX_FIELDS}

    def _meta_extra(self) -> dict[str, Any]:
        return {
            "ext_names": list(self.ext_ids),
            "truncated": [s.truncated for s in self.shards],
            "damaged": [s.damaged for s in self.shards],
        }

    def _meta_restore(self, meta: SourceMeta) -> None:
        self.ext_ids = {name: k for k, name in enumerate(meta.extra["ext_names"])}
        self.shards = []
        damaged = meta.extra.get("damaged") or [""] * len(meta.arrays)
        for a, cut, dmg in zip(meta.arrays, meta.extra["truncated"], damaged):
            if not a:
                self.shards.append(ShardIndex.empty())
                continue
            self.shards.append(
                ShardIndex(
                    offsets=a["offsets"],
                    sizes=a["sizes"],
                    exts=a["exts"],
                    starts=a["starts"],
                    flags=a["flags"],
                    truncated=str(cut),
                    damaged=str(dmg),
                )
            )

    def _read_file(self, f: int, rows: np.ndarray) -> tuple[list, int]:
        shard = self.shards[f]
        out: list = [None] * len(rows)
        nbytes = 0
        try:
            fh = self.handle(f)
        except (OSError, StorageError) as e:
            reason = self.error_reason(e)
            for k, r in enumerate(rows.tolist()):
                out[k] = self.bad_sample(f, r, reason, str(e), f"{self.paths[f]}: {e}")
            return out, 0
        if isinstance(fh, RemoteFile) and len(rows) > 1:
            fh = self._coalesced(fh, shard, rows)
        for k, r in enumerate(rows.tolist()):
            out[k], nb = self._sample(f, shard, fh, r)
            nbytes += nb
        return out, nbytes

    def _coalesced(self, fh: RemoteFile, shard: ShardIndex, rows: np.ndarray) -> Fd | RemoteFile | _Block:
        """A remote shard's samples of one read in one range request when their members lie close together
        (the read order keeps a read's rows of a shard within a window): a request costs its latency, bytes
        in between little."""
        lo, hi = shard.starts[rows], shard.starts[rows + 1]
        has = hi > lo
        if not has.any():
            return fh
        first, last = lo[has], hi[has] - 1
        start = int(shard.offsets[first].min())
        end = int((shard.offsets[last] + shard.sizes[last]).max())
        need = int(sum(int(shard.sizes[a:b].sum()) for a, b in zip(first.tolist(), (last + 1).tolist())))
        if end - start > max(4 * need, self.coalesce_bytes):
            return fh
        try:
            return _Block(fh, start, fh.pread(end - start, start))
        except StorageError as e:
            self.error_reason(e)  # "fail": the job stops here; "skip": the samples' own reads say it again
            return fh

    def _sample(self, f: int, shard: ShardIndex, fh: Fd | RemoteFile | _Block, row: int) -> tuple[object, int]:
        """One sample's record and the bytes it took, or a BadSample and 0."""
        lo, hi = int(shard.starts[row]), int(shard.starts[row + 1])
        exts = shard.exts[lo:hi]
        flag = int(shard.flags[row])
        if flag == _CUT:
            return self.bad_sample(f, row, "corrupt", f"shard truncated: {shard.truncated}", f"{self.paths[f]} cut"), 0
        if flag == _DUPLICATE:
            return self.bad_sample(f, row, "corrupt", "a part appears twice in the sample (key repeated)"), 0
        present = exts.tolist()
        found = [next((e for e in g if e in present), -1) for g in self.wanted]
        missing = [t for t, e in zip(self._wanted_text, found) if e < 0]
        if missing:
            if flag == _DAMAGED:
                detail = f"a tar header next to it is corrupt ({shard.damaged}); the sample lacks {missing}"
                return self.bad_sample(f, row, "corrupt", detail, f"{self.paths[f]} damaged"), 0
            if flag == _LAST:
                detail = f"shard truncated ({shard.truncated}); the sample lacks {missing}"
                return self.bad_sample(f, row, "corrupt", detail, f"{self.paths[f]} cut"), 0
            return self.bad_sample(f, row, "missing_field", f"the sample has no part(s) {missing}"), 0
        members = np.array([lo + present.index(e) for e in found], dtype=np.int64)
        offs, sizes = shard.offsets[members], shard.sizes[members]
        need = int(sizes.sum())
        if need > self.max_bytes:
            return self.bad_sample(f, row, "oversize", f"{need} bytes > max_sample_bytes {self.max_bytes}"), 0
        start, end = int(offs.min()), int((offs + sizes).max())
        try:
            if end - start <= 2 * need + self.span_slack:  # one read of the span, headers and all
                block = self._retry(lambda: fh.pread(end - start, start))
                if len(block) != end - start:
                    raise EOFError(f"short read: {len(block)} of {end - start} bytes (file changed?)")
                parts = [block[o - start : o - start + s] for o, s in zip(offs.tolist(), sizes.tolist())]
            else:  # unselected big members in between: read the wanted ones alone
                spans = zip(offs.tolist(), sizes.tolist())
                parts = [self._retry(partial(fh.pread, s, o)) for o, s in spans]
                if [len(p) for p in parts] != sizes.tolist():
                    raise EOFError("short read (file changed?)")
        except (OSError, EOFError, StorageError) as e:
            reason = "read_error" if isinstance(e, EOFError) else self.error_reason(e)
            return self.bad_sample(f, row, reason, str(e)), 0
        return {self.ext_names[e]: p for e, p in zip(found, parts)}, need
