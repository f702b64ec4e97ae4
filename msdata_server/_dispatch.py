"""The task side of a WorkerPool: transform tasks queued in order, handed to idle workers, answered from the
workers' replies (arrays copied out of their segments), re-run when a worker dies.

Kept apart from the pool, which starts, replaces and retires the worker processes; this module never starts
or stops one. Invariants: a task is queued, on exactly one worker, or answered; an idle worker is neither
retiring nor stopping (the pool stops those instead of parking them).
"""

from __future__ import annotations

import asyncio
import itertools
import mmap
from collections import deque
from collections.abc import Callable, Coroutine

import numpy as np

from ._workerproc import Task, Worker
from .errors import ClosedError, ConfigError, MsdataError
from .sources.base import BadSample
from .transforms import VlmSample

__all__ = ["Dispatcher"]


class Dispatcher:
    """Queue and idle workers of one pool, and the counts of what its tasks produced.

    ``own(coro, name)`` starts a task the pool owns (and cancels when it closes)."""

    def __init__(self, own: Callable[[Coroutine, str], asyncio.Task]):
        self._own = own
        self.queue: deque[Task] = deque()
        self.idle: list[Worker] = []
        self._ids = itertools.count()
        self.done = self.samples = self.bad = self.via_shm = self.inline = 0

    async def run(
        self, transform: str, records: list, todo: list[int], *, seed: int, ids: np.ndarray, max_task: int
    ) -> list:
        """Transform ``records[todo]`` in tasks of at most ``max_task``; the others are returned as they are."""
        out = list(records)
        loop = asyncio.get_running_loop()
        tasks = []
        for lo in range(0, len(todo), max_task):
            idx = todo[lo : lo + max_task]
            t = Task(next(self._ids), transform, seed, ids[idx], [records[i] for i in idx], loop.create_future())
            tasks.append((idx, t))
            self._submit(t)
        for idx, t in tasks:
            res = await t.future
            for i, r in zip(idx, res):
                out[i] = r
        return out

    def assign(self, w: Worker) -> None:
        """A worker became free: give it the next task, or park it."""
        while self.queue:
            t = self.queue.popleft()
            if t.future.done():  # its caller went away
                continue
            w.send(t)
            return
        self.idle.append(w)

    def forget(self, w: Worker) -> None:
        """A worker is stopping or gone: it takes no more tasks."""
        if w in self.idle:
            self.idle.remove(w)

    def fail_all(self, err: BaseException) -> None:
        """Fail every queued task."""
        while self.queue:
            t = self.queue.popleft()
            if not t.future.done():
                t.future.set_exception(err)

    def answered(self, w: Worker, msg: tuple) -> None:
        """A worker's reply ``(task_id, items)``: resolve its task; MsdataError if it answers another task."""
        tid, items = msg
        task, w.task = w.task, None
        if task is None or task.id != tid:
            raise MsdataError(f"transform worker {w.n} answered task {tid}, not the one it was given")
        if isinstance(items, tuple) and items[0] == "error":
            if not task.future.done():
                task.future.set_exception(ConfigError(f"transform {task.transform!r} failed to load: {items[1]}"))
        else:
            results = self._unpack(w, items)
            self.done += 1
            self.samples += len(results)
            self.bad += sum(isinstance(r, BadSample) for r in results)
            if not task.future.done():
                task.future.set_result(results)

    def rerun(self, task: Task) -> None:
        """Put a dead worker's task back: whole, split into single samples, or (for a sample that keeps
        killing workers) answered with a bad sample."""
        task.deaths += 1
        if task.future.done():
            return
        if task.deaths < 2:
            self.queue.appendleft(task)
        elif len(task.records) > 1:
            self._own(self._split(task), f"msdata-split-{task.id}")
        else:
            bad = BadSample("worker_crash", f"sample {int(task.ids[0])}", f"killed {task.deaths} transform workers")
            task.future.set_result([bad])
            return
        self._kick()

    async def _split(self, task: Task) -> None:
        loop = asyncio.get_running_loop()
        subs = []
        for i in range(len(task.records)):
            one = slice(i, i + 1)
            t = Task(next(self._ids), task.transform, task.seed, task.ids[one], task.records[one], loop.create_future())
            t.deaths = 1
            subs.append(t)
            self._submit(t)
        try:
            parts = await asyncio.gather(*(t.future for t in subs))
        except BaseException as e:
            if not task.future.done():
                task.future.set_exception(e if isinstance(e, Exception) else ClosedError("worker pool closed"))
            raise
        if not task.future.done():
            task.future.set_result([p[0] for p in parts])

    def _kick(self) -> None:
        while self.queue and self.idle:
            self.assign(self.idle.pop())

    def _submit(self, t: Task) -> None:
        self.queue.append(t)
        self._kick()

    def _unpack(self, w: Worker, items: list) -> list:
        out: list = []
        mm = w.seg.mm if w.seg is not None else None
        for it in items:
            kind = it[0]
            if kind == "b":
                out.append(BadSample(it[1], it[2], it[3]))
            elif kind == "v":  # a picture document: its arrays, each from the segment or inline
                out.append(VlmSample.from_arrays({k: self._array(mm, item) for k, item in it[1]}))
            else:
                out.append(self._array(mm, it))
        return out

    def _array(self, mm: mmap.mmap | None, it: tuple) -> np.ndarray:
        """An "s" item copied out of the worker's segment, or an inline "a" item."""
        if it[0] == "a":
            self.inline += it[1].nbytes
            return it[1]
        _, off, dtype, shape = it
        assert mm is not None, "a segment item from a worker without a segment"
        count = int(np.prod(shape, dtype=np.int64))
        view = np.frombuffer(mm, dtype=np.dtype(dtype), count=count, offset=off)
        a = view.reshape(shape).copy()
        del view
        self.via_shm += a.nbytes
        return a
