"""Every shared-memory segment msdata creates, in one place: creation (private, reserved, touched),
the owner record in its header, and ``cleanup`` of segments whose creating server is gone.

Segment kinds: ``ring`` (batches for local ranks; the name is unlinked as soon as the server holds the
descriptor, so nothing outlives a crash) and ``pool`` (worker result buffers). Names are
``/{prefix}-{pid}-{kind}-{n}-{random}``; the header records prefix, pid, the process start time (so a
reused pid is not mistaken for the owner), uid and host.
"""

from __future__ import annotations

import contextlib
import errno
import itertools
import logging
import mmap
import os
import secrets
import shutil
import socket
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np
import posix_ipc

from msdata_client.ring import HEADER_SIZE, read_header, write_header

from .errors import ConfigError, ShmError

__all__ = [
    "SEGMENT_KINDS",
    "Segment",
    "cleanup",
    "create_segment",
    "list_segments",
    "owner_alive",
    "process_start_time",
]

log = logging.getLogger(__name__)

SEGMENT_KINDS = ("ring", "pool")
SHM_DIR = "/dev/shm"
_MADV_POPULATE_WRITE = 23
_counter = itertools.count()


def _fallocate(fd: int, size: int) -> None:
    os.posix_fallocate(fd, 0, size)


reserve: Callable[[int, int], None] = _fallocate  # how a segment's pages are reserved (tests' faults wrap it)


def process_start_time(pid: int) -> int | None:
    """Clock ticks since boot at which pid started (field 22 of /proc/pid/stat), or None if it is gone."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            stat = f.read()
    except OSError:
        return None
    # the command name (field 2) may contain spaces and parentheses: split after the last ')'
    rest = stat[stat.rfind(b")") + 2 :].split()
    return int(rest[19])


def owner_alive(info: dict) -> bool:
    """Whether the process that created a segment still runs (same pid and same start time)."""
    if info.get("host") != socket.gethostname():
        return True  # a /dev/shm shared with another host's server: never ours to judge
    pid = info.get("pid")
    if not isinstance(pid, int):
        return False
    start = process_start_time(pid)
    return start is not None and start == info.get("start")


@dataclass(slots=True, kw_only=True)
class Segment:
    """A created segment: the creator holds the descriptor and a shared mapping; it unlinks the name.

    ``reader_fd`` (rings: -1 otherwise) is a read-only descriptor of the same memory, the one handed to ranks:
    a rank can map it copy-on-write but never write into the batches its peers read (issue 25, item 3)."""

    name: str
    kind: str
    fd: int
    size: int
    mm: mmap.mmap
    reader_fd: int = -1
    linked: bool = True
    closed: bool = field(default=False)

    def unlink(self) -> None:
        if self.linked:
            self.linked = False
            with contextlib.suppress(posix_ipc.ExistentialError):
                posix_ipc.unlink_shared_memory(self.name)

    def close(self) -> None:
        """Unlink (if still linked), unmap and close the descriptor. Idempotent."""
        self.unlink()
        if self.closed:
            return
        self.closed = True
        try:
            self.mm.close()
        except BufferError:  # views still exported (a numpy array over it is alive): the GC unmaps later
            log.debug("segment %s still has views; leaving the unmap to the GC", self.name)
        for fd in (self.fd, self.reader_fd):
            if fd >= 0:
                with contextlib.suppress(OSError):
                    os.close(fd)


def _shm_free_bytes() -> int | None:
    try:
        return shutil.disk_usage(SHM_DIR).free
    except OSError:
        return None


def create_segment(
    prefix: str, kind: str, size: int, *, info: dict | None = None, unlink: bool = True, reader_fd: bool = False
) -> Segment:
    """Create, reserve and touch a 0600 segment of ``size`` bytes after a HEADER_SIZE header; with
    ``reader_fd`` also open a read-only descriptor of it (before the name is unlinked) for its readers.

    Fails at once with a ShmError naming the size and /dev/shm's free space when it cannot be reserved.
    """
    if kind not in SEGMENT_KINDS:
        raise ValueError(f"{kind=} must be one of {SEGMENT_KINDS}")
    if size < 0:
        raise ConfigError(f"segment {size=} must be >= 0")
    total = HEADER_SIZE + (size + mmap.PAGESIZE - 1) // mmap.PAGESIZE * mmap.PAGESIZE
    name = f"/{prefix}-{os.getpid()}-{kind}-{next(_counter)}-{secrets.token_hex(3)}"
    try:
        shm = posix_ipc.SharedMemory(name, posix_ipc.O_CREX, mode=0o600, size=0)
    except posix_ipc.Error as e:
        raise ShmError(f"cannot create shared memory {name!r}: {e}") from e
    fd = shm.fd
    seg = None
    try:
        try:
            reserve(fd, total)  # reserve now: ENOSPC here instead of SIGBUS later
        except OSError as e:
            if e.errno in (errno.ENOSPC, errno.EFBIG):
                free = _shm_free_bytes()
                raise ShmError(
                    f"cannot reserve {total / 2**20:.1f} MiB of shared memory for a {kind} "
                    f"({SHM_DIR} has {(free or 0) / 2**20:.1f} MiB free). Give the container more "
                    f"(docker --shm-size, or a larger /dev/shm mount) or use fewer/smaller ring slots."
                ) from None
            raise
        mm = mmap.mmap(fd, total, flags=mmap.MAP_SHARED, prot=mmap.PROT_READ | mmap.PROT_WRITE)
        seg = Segment(name=name, kind=kind, fd=fd, size=total, mm=mm)
        record = {
            "kind": kind,
            "prefix": prefix,
            "pid": os.getpid(),
            "start": process_start_time(os.getpid()),
            "uid": os.getuid(),
            "host": socket.gethostname(),
            "created": time.time(),
            "size": total,
        }
        record.update(info or {})
        write_header(mm, record)
        _touch(mm, total)
        if reader_fd:
            seg.reader_fd = os.open(SHM_DIR + name, os.O_RDONLY | os.O_CLOEXEC)
        if unlink:
            seg.unlink()
        return seg
    except BaseException:
        if seg is not None:
            seg.close()
        else:
            with contextlib.suppress(posix_ipc.ExistentialError):
                posix_ipc.unlink_shared_memory(name)
            os.close(fd)
        raise


def _touch(mm: mmap.mmap, total: int) -> None:
    """Fault every page in once, so later writes run at memcpy speed (ARCHITECTURE §9)."""
    try:
        mm.madvise(_MADV_POPULATE_WRITE)
        return
    except OSError:
        pass
    view = np.frombuffer(mm, dtype=np.uint8)
    view[HEADER_SIZE :: mmap.PAGESIZE] = 0
    del view


def list_segments(directory: str = SHM_DIR) -> list[tuple[str, dict]]:
    """Every msdata segment visible in /dev/shm with its owner record (recognised by the magic header)."""
    out: list[tuple[str, dict]] = []
    try:
        names = sorted(os.listdir(directory))
    except OSError:
        return out
    for n in names:
        path = os.path.join(directory, n)
        try:
            with open(path, "rb") as f:
                head = f.read(HEADER_SIZE)
        except OSError:
            continue
        info = read_header(head)
        if info is not None:
            out.append((n, info))
    return out


def cleanup(directory: str = SHM_DIR, *, prefix: str | None = None) -> tuple[list[str], list[str]]:
    """Remove every msdata segment (of ``prefix``, or any) whose creating process is gone; keep live ones.

    Returns (removed, kept) names.
    """
    removed, kept = [], []
    for n, info in list_segments(directory):
        if prefix is not None and info.get("prefix") != prefix:
            continue
        if owner_alive(info):
            kept.append(n)
            continue
        try:
            os.unlink(os.path.join(directory, n))
            removed.append(n)
        except FileNotFoundError:
            pass
        except OSError as e:
            log.warning("cannot remove stale segment %s: %s", n, e)
            kept.append(n)
    return removed, kept
