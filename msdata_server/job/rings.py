"""The shared-memory rings of one receiving group: slots, their readers, growth and retirement.

Bound: a ring has ``slots`` slots; a constructor waits for a free one (never drops or overwrites). A
micro-batch larger than the current slots makes a larger ring that replaces it; the old ring is closed once
its last slot is released. Every ring is announced to the group's readers with its descriptor.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable, Iterator
from dataclasses import dataclass

import numpy as np

from msdata_client.ring import HEADER_SIZE, FieldLayout, SlotTable

from ..errors import SlotSizeError
from ..shm import Segment, create_segment

__all__ = ["RingConfig", "RingSet", "ServerRing", "round_slot"]

log = logging.getLogger(__name__)


def round_slot(nbytes: int) -> int:
    """Slot sizes are powers of two of at least 64 KiB (page multiples, few distinct sizes)."""
    return max(1 << 16, 1 << (max(nbytes, 1) - 1).bit_length())


@dataclass(frozen=True, slots=True, kw_only=True)
class RingConfig:
    """How rings are made on this node: segment name prefix, slots per ring, largest slot."""

    prefix: str
    slots: int
    max_slot_mib: int


class ServerRing:
    """One segment of fixed-size slots and the bookkeeping of who still reads which slot."""

    def __init__(self, rid: int, seg: Segment, slots: int, slot_size: int):
        self.id = rid
        self.seg = seg
        self.slot_size = slot_size
        self.table = SlotTable(slots)
        self.freed = asyncio.Event()
        self.buf: np.ndarray | None = np.frombuffer(seg.mm, dtype=np.uint8)

    def describe(self) -> dict:
        return {"id": self.id, "slots": self.table.slots, "slot_size": self.slot_size, "base": HEADER_SIZE}

    def offset(self, slot: int) -> int:
        return HEADER_SIZE + slot * self.slot_size

    def views(self, slot: int, layouts: list[FieldLayout]) -> dict[str, np.ndarray]:
        assert self.buf is not None, "ring closed"
        base = self.offset(slot)
        out = {}
        for f in layouts:
            a = self.buf[base + f.offset : base + f.offset + f.nbytes].view(np.dtype(f.dtype))
            out[f.name] = a.reshape(f.shape)
        return out

    def close(self) -> None:
        self.buf = None
        self.seg.close()


class RingSet:
    """The rings of one group; ``announce(frame, fds)`` tells the group's readers of a ring coming or going."""

    def __init__(
        self, cfg: RingConfig, *, job: str, group: int, ids: Iterator[int], announce: Callable[[dict, list[int]], None]
    ):
        self.cfg = cfg
        self.job = job
        self.group = group
        self._ids = ids  # ring ids unique within the job (releases name them)
        self._announce = announce
        self.rings: dict[int, ServerRing] = {}
        self.current: ServerRing | None = None

    async def open(self, slot_size: int) -> None:
        """Make the first ring."""
        self.current = await self._new(slot_size)

    async def _new(self, slot_size: int) -> ServerRing:
        if slot_size > self.cfg.max_slot_mib << 20:
            raise SlotSizeError(
                f"a micro-batch of job {self.job!r} needs {slot_size / 2**20:.1f} MiB, more than "
                f"max_slot_mib={self.cfg.max_slot_mib}; lower rows/seq_len or raise [node] max_slot_mib"
            )
        seg = await asyncio.to_thread(
            create_segment,
            self.cfg.prefix,
            "ring",
            self.cfg.slots * slot_size,
            info={"job": self.job, "group": self.group},
            reader_fd=True,  # ranks get read-only descriptors: none can write into a batch its peers read
        )
        ring = ServerRing(next(self._ids), seg, self.cfg.slots, slot_size)
        self.rings[ring.id] = ring
        return ring

    async def acquire(self, nbytes: int) -> tuple[ServerRing, int]:
        """A free slot big enough for nbytes (waits for a release); a larger ring replaces the current one."""
        assert self.current is not None, "RingSet.open first"
        if nbytes > self.current.slot_size:
            old = self.current
            self.current = await self._new(round_slot(nbytes))
            log.info("job %s group %d: ring grown to %d KiB slots", self.job, self.group, self.current.slot_size >> 10)
            self._announce({"t": "ring", "ring": self.current.describe(), "fds": 1}, [self.current.seg.reader_fd])
            self._retire(old)
        ring = self.current
        while (slot := ring.table.acquire()) is None:
            ring.freed.clear()
            await ring.freed.wait()
        return ring, slot

    def _retire(self, ring: ServerRing) -> None:
        if ring is not self.current and ring.table.in_use == 0:
            self.rings.pop(ring.id, None)
            ring.close()
            self._announce({"t": "unring", "ring": ring.id}, [])

    def release(self, ring_id: int, slot: int, reader: int) -> bool:
        """A reader is done with a slot; False if the ring is not one of ours."""
        ring = self.rings.get(ring_id)
        if ring is None:
            return False
        if ring.table.release(slot, reader):
            ring.freed.set()
            self._retire(ring)
        return True

    def drop_reader(self, rank: int) -> None:
        """A reader left: free every slot it held so the other readers never stall."""
        for ring in list(self.rings.values()):
            if ring.table.drop_reader(rank):
                ring.freed.set()

    def describe(self) -> tuple[list[dict], list[int]]:
        """The live rings and their descriptors (for a reader's welcome)."""
        rings = list(self.rings.values())
        return [r.describe() for r in rings], [r.seg.reader_fd for r in rings]

    def status(self) -> list[dict]:
        return [
            {
                "group": self.group,
                "ring": r.id,
                "slots": r.table.slots,
                "in_use": r.table.in_use,
                "slot_size": r.slot_size,
            }
            for r in self.rings.values()
        ]

    def close(self) -> None:
        for ring in self.rings.values():
            ring.close()
        self.rings.clear()
