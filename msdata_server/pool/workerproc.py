"""One transform worker process as the parent sees it: its private socket, its output segment, its task.

The parent's half of the protocol that ``_worker.py`` describes: frames in multiprocessing.Connection's
format, pickled (only our own child is on the socket). Kept apart from the pool so that the pool deals in
workers and tasks, not in sockets, frames and segments.
"""

from __future__ import annotations

import asyncio
import pickle
import socket
import struct
from typing import TYPE_CHECKING

import numpy as np

from ..errors import MsdataError
from ..shm import Segment, create_segment

if TYPE_CHECKING:
    from .launch import Spawner

__all__ = ["Task", "Worker"]

_HDR = struct.Struct("!i")
_HDR_BIG = struct.Struct("!Q")


class Task:
    """Records of one source to transform in one worker; ``deaths`` counts the workers that died running it."""

    __slots__ = ("deaths", "future", "id", "ids", "records", "seed", "source", "transform")

    def __init__(
        self,
        tid: int,
        transform: str,
        seed: int,
        ids: np.ndarray,
        records: list,
        future: asyncio.Future,
        source: str = "",
    ):
        self.id = tid
        self.transform = transform
        self.seed = seed
        self.ids = ids
        self.records = records
        self.future = future
        self.deaths = 0
        self.source = source  # whose quota and profile the task counts against (fair queueing)


class Worker:
    """A worker process: started by ``launch``, told to exit by ``stop``, forgotten by ``close``."""

    __slots__ = ("n", "pid", "reader", "ready", "retiring", "seg", "serve", "stopping", "task", "writer")

    def __init__(self, n: int):
        self.n = n
        self.pid: int | None = None
        self.reader: asyncio.StreamReader | None = None
        self.writer: asyncio.StreamWriter | None = None
        self.seg: Segment | None = None
        self.task: Task | None = None
        self.retiring = False  # stop after the current task (shrink)
        self.stopping = False  # told to stop: its EOF is not a death
        self.ready: asyncio.Future | None = None
        self.serve: asyncio.Task | None = None

    @property
    def alive(self) -> bool:
        """Started and not told to stop."""
        return self.pid is not None and not self.stopping

    @property
    def was_ready(self) -> bool:
        """Whether it said it was ready (and so started cleanly)."""
        r = self.ready
        return r is not None and r.done() and not r.cancelled() and r.exception() is None

    async def launch(self, launcher: Spawner, shm_prefix: str, out_bytes: int) -> asyncio.Future:
        """Map its output segment, start the process and connect to it; returns ``ready``, which resolves on
        its hello."""
        self.ready = ready = asyncio.get_running_loop().create_future()
        ours, theirs = socket.socketpair()
        try:
            if out_bytes:
                self.seg = create_segment(shm_prefix, "pool", out_bytes, info={"worker": self.n}, unlink=True)
            seg_fd, seg_size = (self.seg.fd, self.seg.size) if self.seg is not None else (-1, 0)
            self.pid = await launcher.launch(theirs.fileno(), seg_fd, seg_size)
            theirs.close()
            self.reader, self.writer = await asyncio.open_connection(sock=ours)
        except BaseException:
            theirs.close()
            if self.writer is None:
                ours.close()
            raise
        return ready

    def send(self, t: Task) -> None:
        """Give it a task (it runs one at a time)."""
        self.task = t
        msg = (t.id, t.transform, t.seed, t.ids, t.records)
        assert self.writer is not None, "a task goes only to a launched worker"
        self.writer.write(_frame(pickle.dumps(msg, protocol=pickle.HIGHEST_PROTOCOL)))

    async def receive(self) -> tuple:
        """Its next message: ``("ready", pid)`` or ``(task_id, items, cpu_s, wall_s)``."""
        assert self.reader is not None, "a message comes only from a launched worker"
        return pickle.loads(await _read_frame(self.reader))

    def stop(self) -> None:
        """Ask it to exit (it finishes nothing more) and close our end."""
        self.stopping = True
        if self.writer is not None and not self.writer.is_closing():
            try:
                self.writer.write(_frame(pickle.dumps(None)))
                self.writer.close()
            except (ConnectionError, RuntimeError):
                pass

    def close(self, err: BaseException | None = None) -> None:
        """It has exited: fail its start, fail its task (given ``err``), unmap its segment."""
        if self.ready is not None and not self.ready.done():
            self.ready.set_exception(err or MsdataError(f"transform worker {self.n} exited before it was ready"))
            self.ready.exception()  # retrieved: the spawner re-raises it
        if self.task is not None and not self.task.future.done() and err is not None:
            self.task.future.set_exception(err)
        self.task = None
        if self.writer is not None and not self.writer.is_closing():
            self.writer.close()
        if self.seg is not None:
            self.seg.close()
            self.seg = None


def _frame(payload: bytes) -> bytes:
    """A multiprocessing.Connection frame, so the worker can use recv_bytes."""
    n = len(payload)
    if n > 0x7FFFFFFF:
        return _HDR.pack(-1) + _HDR_BIG.pack(n) + payload
    return _HDR.pack(n) + payload


async def _read_frame(reader: asyncio.StreamReader) -> bytes:
    (n,) = _HDR.unpack(await reader.readexactly(4))
    if n == -1:
        (n,) = _HDR_BIG.unpack(await reader.readexactly(8))
    return await reader.readexactly(n)
