"""Shared-memory rings: fixed-size slots in one POSIX segment, written once by the server, read by ranks.

Layout of a segment: a 4 KiB header (magic, then the length and orjson bytes of a dict that records the
owner, for ``msdata-server cleanup``), then ``slots`` slots of ``slot_size`` bytes (page multiples). The
server creates the segment with mode 0600, reserves and touches every page once (a too-small /dev/shm fails
here, clearly, not with a SIGBUS later), and unlinks the name as soon as it holds the descriptor: clients
receive the descriptor over their Unix socket, so even a SIGKILL leaves nothing in /dev/shm.

Readers map the whole ring once with MAP_PRIVATE (``RingMap``): views are writable copy-on-write, a
reader's writes never reach the producer or other readers, and pages it wrote are dropped when it releases
the slot. Slot accounting (who still reads which slot) is the server's
``SlotTable``; this module imports numpy only, never torch.
"""

from __future__ import annotations

import errno
import functools
import math
import mmap
import os
import struct
from collections import deque
from dataclasses import dataclass

import numpy as np
import orjson

__all__ = [
    "ALIGN",
    "FieldLayout",
    "HEADER_SIZE",
    "MAGIC",
    "RingMap",
    "SlotTable",
    "layout_fields",
    "read_header",
    "write_header",
]

MAGIC = b"MSDSHM\x00\x01"  # every msdata segment starts with it (rings and pool buffers alike)
HEADER_SIZE = 4096
ALIGN = 64  # field offsets inside a slot: cache-line aligned
PAGE = mmap.PAGESIZE
_LEN = struct.Struct("<I")
_MADV_POPULATE_READ = 22  # Linux >= 5.14: fill page tables without breaking copy-on-write


def write_header(buf, info: dict) -> None:
    """Write the magic and the owner record at the start of a segment mapping."""
    body = orjson.dumps(info)
    if len(MAGIC) + _LEN.size + len(body) > HEADER_SIZE:
        raise ValueError(f"segment header of {len(body)} bytes does not fit {HEADER_SIZE}")
    buf[: len(MAGIC)] = MAGIC
    _LEN.pack_into(buf, len(MAGIC), len(body))
    start = len(MAGIC) + _LEN.size
    buf[start : start + len(body)] = body


def read_header(buf) -> dict | None:
    """The owner record of a segment, or None if it is not an msdata segment."""
    if len(buf) < len(MAGIC) + _LEN.size or bytes(buf[: len(MAGIC)]) != MAGIC:
        return None
    (n,) = _LEN.unpack_from(buf, len(MAGIC))
    start = len(MAGIC) + _LEN.size
    if n > HEADER_SIZE - start:
        return None
    try:
        info = orjson.loads(bytes(buf[start : start + n]))
    except orjson.JSONDecodeError:
        return None
    return info if isinstance(info, dict) else None


@dataclass(frozen=True, slots=True)
class FieldLayout:
    """Where one array lives in a slot: name, numpy dtype string, shape, byte offset from the slot start."""

    name: str
    dtype: str
    shape: tuple[int, ...]
    offset: int

    @property
    def nbytes(self) -> int:
        return math.prod(self.shape) * np.dtype(self.dtype).itemsize

    def to_wire(self) -> list:
        return [self.name, self.dtype, list(self.shape), self.offset]

    @classmethod
    def from_wire(cls, w) -> FieldLayout:
        name, dtype, shape, offset = w
        return cls(str(name), str(dtype), tuple(int(x) for x in shape), int(offset))


def layout_fields(specs, base: int = 0) -> tuple[list[FieldLayout], int]:
    """Lay out (name, dtype, shape) arrays back to back, each ALIGN-aligned; returns layouts and end offset."""
    out = []
    off = base
    for name, dtype, shape in specs:
        off = (off + ALIGN - 1) // ALIGN * ALIGN
        f = FieldLayout(name, np.dtype(dtype).str, tuple(int(s) for s in shape), off)
        out.append(f)
        off += f.nbytes
    return out, off


class SlotTable:
    """Which slots are free and which readers still hold each published slot (pure bookkeeping).

    Invariant: a slot is in ``free`` xor has a non-empty reader set in ``held`` xor is being written
    (acquired, not yet published). A slot returns to ``free`` only when its last reader released it.
    """

    __slots__ = ("free", "held", "slots")

    def __init__(self, slots: int):
        if slots < 1:
            raise ValueError(f"{slots=} must be >= 1")
        self.slots = slots
        self.free: deque[int] = deque(range(slots))
        self.held: dict[int, set] = {}

    def acquire(self) -> int | None:
        return self.free.popleft() if self.free else None

    def publish(self, slot: int, readers) -> None:
        readers = set(readers)
        if not readers:  # nobody to read it (all readers gone): straight back to free
            self.free.append(slot)
            return
        self.held[slot] = readers

    def abandon(self, slot: int) -> None:
        """An acquired slot that will not be published after all."""
        self.free.append(slot)

    def release(self, slot: int, reader) -> bool:
        """Reader is done with slot; True if the slot became free. Unknown pairs are ignored (idempotent)."""
        rs = self.held.get(slot)
        if rs is None or reader not in rs:
            return False
        rs.discard(reader)
        if rs:
            return False
        del self.held[slot]
        self.free.append(slot)
        return True

    def drop_reader(self, reader) -> list[int]:
        """A reader went away: release everything it held; returns the slots that became free."""
        freed = [s for s, rs in list(self.held.items()) if reader in rs]
        return [s for s in freed if self.release(s, reader)]

    @property
    def in_use(self) -> int:
        return self.slots - len(self.free)


_pagemap_fd: int | None = None
_dtype = functools.lru_cache(maxsize=64)(np.dtype)
_PRIVATE_PAGE = bytes(1 if (b & 0xA0) == 0x80 else 0 for b in range(256))


def _pagemap() -> int:
    """This process's /proc/self/pagemap (-1 if unreadable), opened once."""
    global _pagemap_fd
    if _pagemap_fd is None:
        try:
            _pagemap_fd = os.open("/proc/self/pagemap", os.O_RDONLY | os.O_CLOEXEC)
        except OSError:
            _pagemap_fd = -1
    return _pagemap_fd


class RingMap:
    """A reader's mapping of a whole ring: one private (copy-on-write) mapping, populated once at attach.

    Batches are numpy views into it, so taking a batch costs no system call and no page fault. Pages a
    reader never writes stay the server's shared pages and show every later batch of their slot; a page it
    wrote became private, so ``scrub`` (called when the slot is released) drops such pages with
    MADV_DONTNEED and the next batch in that slot reads the shared page again.
    """

    __slots__ = ("_anchor", "addr", "fd", "mm", "mv", "size")

    def __init__(self, fd: int, size: int):
        self.fd = fd
        self.size = size
        self.mm = mmap.mmap(fd, size, flags=mmap.MAP_PRIVATE, prot=mmap.PROT_READ | mmap.PROT_WRITE)
        try:
            self.mm.madvise(_MADV_POPULATE_READ)  # page tables now, without breaking copy-on-write
        except OSError as e:
            if e.errno not in (errno.EINVAL, errno.ENOSYS):
                raise
        self._anchor = np.frombuffer(self.mm, dtype=np.uint8)
        self.addr = int(self._anchor.ctypes.data)
        self.mv = memoryview(self.mm)

    def batch(self, slot_offset: int, fields: list) -> tuple[np.ndarray, dict[str, np.ndarray], int, int]:
        """Views of one batch from its wire layout ``[[name, dtype, shape, offset], ...]``: (owner, arrays,
        start, end). The arrays keep ``owner`` alive and nothing else does, so a finalizer on the owner learns
        when the batch's last view is gone. Hot path: one ndarray constructor per field, nothing else."""
        spans = []
        lo, hi = None, 0
        for name, dtype, shape, offset in fields:
            dt = _dtype(dtype)
            shape = tuple(shape)
            n = math.prod(shape) * dt.itemsize
            if offset < 0 or n < 0:
                raise ValueError(f"field {name!r} has a negative offset or size")
            spans.append((name, dt, shape, offset))
            lo = offset if lo is None or offset < lo else lo
            hi = offset + n if offset + n > hi else hi
        lo = lo or 0
        start, end = slot_offset + lo, slot_offset + max(hi, lo)
        if slot_offset < 0 or end > self.size:
            raise ValueError(f"batch [{start}, {end}) lies outside the ring of {self.size} bytes")
        owner = np.frombuffer(self.mv[start:end], dtype=np.uint8) if end > start else np.empty(0, np.uint8)
        arrays = {name: np.ndarray(shape, dt, owner, off - lo) for name, dt, shape, off in spans}
        return owner, arrays, start, end

    def scrub(self, start: int, end: int) -> bool:
        """Drop pages of [start, end) that this reader wrote (now private copies); True if any were."""
        first = start // PAGE * PAGE
        last = (end + PAGE - 1) // PAGE * PAGE
        if last <= first:
            return False
        npages = (last - first) // PAGE
        fd = _pagemap()
        if fd >= 0:
            try:
                raw = os.pread(fd, npages * 8, (self.addr + first) // PAGE * 8)
                # top byte of each entry: bit 63 present, bit 61 file page or shared; present and not
                # shared = a private copy this rank wrote
                if 1 not in raw[7::8].translate(_PRIVATE_PAGE):
                    return False
            except OSError:
                pass
        try:
            self.mm.madvise(mmap.MADV_DONTNEED, first, last - first)
        except (OSError, ValueError):
            return False
        return True
