"""Shared-memory rings: fixed-size slots in one POSIX segment, written once by the server, read by ranks.

Layout of a segment: a 4 KiB header (magic, then the length and orjson bytes of a dict that records the
owner, for ``msdata-server cleanup``), then ``slots`` slots of ``slot_size`` bytes (page multiples). The
server creates the segment with mode 0600, reserves and touches every page once (a too-small /dev/shm fails
here, clearly, not with a SIGBUS later), and unlinks the name as soon as it holds the descriptor: clients
receive the descriptor over their Unix socket, so even a SIGKILL leaves nothing in /dev/shm.

Readers map a slot per batch with MAP_PRIVATE: views are writable copy-on-write, and a reader's writes
never reach the producer or other readers. Slot accounting (who still reads which slot) is the server's
``SlotTable``; this module imports numpy only, never torch.
"""

from __future__ import annotations

import errno
import mmap
import struct
from collections import deque
from dataclasses import dataclass

import numpy as np
import orjson

__all__ = [
    "ALIGN",
    "HEADER_SIZE",
    "MAGIC",
    "FieldLayout",
    "MappedBatch",
    "SlotTable",
    "layout_fields",
    "map_batch",
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
        return int(np.prod(self.shape, dtype=np.int64)) * np.dtype(self.dtype).itemsize

    def to_wire(self) -> list:
        return [self.name, self.dtype, list(self.shape), self.offset]

    @classmethod
    def from_wire(cls, w) -> "FieldLayout":
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


class MappedBatch:
    """A private (copy-on-write) mapping of the part of one slot a reader uses, and numpy views into it.

    The views keep ``mm`` (the mmap object) alive; when the last view is gone, the mapping is collected
    and a finalizer on it (the client's) releases the slot.
    """

    __slots__ = ("arrays", "mm", "nbytes")

    def __init__(self, fd: int, slot_offset: int, fields: list[FieldLayout], populate: bool = True):
        lo = min(f.offset for f in fields) if fields else 0
        hi = max(f.offset + f.nbytes for f in fields) if fields else 1
        start = (slot_offset + lo) // PAGE * PAGE
        length = max(slot_offset + hi - start, 1)
        mm = mmap.mmap(fd, length, flags=mmap.MAP_PRIVATE, prot=mmap.PROT_READ | mmap.PROT_WRITE, offset=start)
        if populate and length >= (256 << 10):
            try:  # map the pages now (one call) instead of a fault per 64 KiB later; keeps COW intact
                mm.madvise(_MADV_POPULATE_READ)
            except OSError as e:  # older kernel: EINVAL; fall back to lazy faults
                if e.errno not in (errno.EINVAL, errno.ENOSYS):
                    raise
        base = np.frombuffer(mm, dtype=np.uint8)
        self.mm = mm  # the object the views keep alive: put a finalizer on it to learn when they are gone
        self.nbytes = length
        shift = slot_offset - start
        arrays = {}
        for f in fields:
            n = f.nbytes
            a = base[shift + f.offset : shift + f.offset + n].view(np.dtype(f.dtype))
            arrays[f.name] = a.reshape(f.shape)
        self.arrays = arrays


def map_batch(fd: int, slot_offset: int, fields: list[FieldLayout]) -> MappedBatch:
    return MappedBatch(fd, slot_offset, fields)

