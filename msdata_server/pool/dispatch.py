"""The task side of a WorkerPool: transform tasks queued per source, handed to idle workers by fair queueing
under per-source quotas, answered from the workers' replies (arrays copied out of their segments), re-run when
a worker dies; and what each source's tasks cost (process CPU and wall seconds measured in the worker).

Kept apart from the pool, which starts, replaces and retires the worker processes; this module never starts
or stops one. Invariants: a task is queued, on exactly one worker, or answered; an idle worker is neither
retiring nor stopping (the pool stops those instead of parking them); ``busy[s]`` counts the tasks of source
s on a worker.

Fair queueing: a free worker takes the oldest task of the sources below their quota (the least served
relative to its quota first); when every source with work is at its quota it takes the oldest task of any
(work-conserving: a quota is a guarantee, never a cap that idles a worker). Without quotas this is FIFO.
"""

from __future__ import annotations

import asyncio
import itertools
import mmap
from collections import Counter, deque
from collections.abc import Callable, Coroutine, Mapping
from dataclasses import dataclass

import numpy as np

from ..document import VlmSample
from ..errors import ClosedError, ConfigError, MsdataError
from ..sources.base import BadSample
from .workerproc import Task, Worker

__all__ = ["Dispatcher", "SourceUsage"]

DEFAULT_QUOTA = 1  # a source the quotas do not name yet (a job that just started) is guaranteed one worker
TASK_S = 0.05  # a task holds about this much work (by the source's measured seconds per sample): an expensive
# source's batch is spread over the workers, and a cheap source never waits long behind it for a worker


@dataclass(frozen=True, slots=True, kw_only=True)
class SourceUsage:
    """Cumulative work of one source's tasks in the pool (counters since the pool started) and its queue now."""

    tasks: int
    samples: int
    cpu_s: float  # process CPU seconds in the workers
    wall_s: float  # seconds a worker spent on its tasks (the worker time a sample occupies)
    busy: int  # its tasks on a worker now
    queued: int  # its tasks waiting for a worker now
    quota: float | None  # its weight: workers it is served up to before others (None: no quotas, FIFO)


class _Counts:
    __slots__ = ("cpu_s", "samples", "tasks", "wall_s")

    def __init__(self) -> None:
        self.tasks = self.samples = 0
        self.cpu_s = self.wall_s = 0.0


class Dispatcher:
    """Queue and idle workers of one pool, and the counts of what its tasks produced.

    ``own(coro, name)`` starts a task the pool owns (and cancels when it closes)."""

    def __init__(self, own: Callable[[Coroutine, str], asyncio.Task]):
        self._own = own
        self.queues: dict[str, deque[Task]] = {}
        self.idle: list[Worker] = []
        self.busy: Counter[str] = Counter()
        self.quotas: dict[str, float] | None = None  # None: FIFO over all sources
        self._counts: dict[str, _Counts] = {}
        self._ids = itertools.count()
        self.done = self.samples = self.bad = self.via_shm = self.inline = 0

    @property
    def queued(self) -> int:
        return sum(len(q) for q in self.queues.values())

    def set_quotas(self, quotas: Mapping[str, float] | None) -> None:
        """Workers guaranteed to each source (None: plain FIFO); takes effect as workers come free."""
        self.quotas = None if quotas is None else {str(k): float(v) for k, v in quotas.items()}

    def usage(self) -> dict[str, SourceUsage]:
        """Per source: cumulative counts of its tasks and its share of the pool now."""
        names = set(self._counts) | {s for s, q in self.queues.items() if q} | {s for s, n in self.busy.items() if n}
        out = {}
        for s in sorted(names):
            c = self._counts.get(s) or _Counts()
            out[s] = SourceUsage(
                tasks=c.tasks,
                samples=c.samples,
                cpu_s=c.cpu_s,
                wall_s=c.wall_s,
                busy=self.busy[s],
                queued=len(self.queues.get(s, ())),
                quota=None if self.quotas is None else self.quotas.get(s, DEFAULT_QUOTA),
            )
        return out

    async def run(
        self,
        transform: str,
        records: list,
        todo: list[int],
        *,
        seed: int,
        ids: np.ndarray,
        max_task: int,
        source: str = "",
    ) -> list:
        """Transform ``records[todo]`` in tasks of at most ``max_task``; the others are returned as they are."""
        out = list(records)
        loop = asyncio.get_running_loop()
        tasks = []
        max_task = self._task_size(source, max_task)
        for lo in range(0, len(todo), max_task):
            idx = todo[lo : lo + max_task]
            t = Task(
                next(self._ids), transform, seed, ids[idx], [records[i] for i in idx], loop.create_future(), source
            )
            tasks.append((idx, t))
            self._submit(t)
        try:
            for idx, t in tasks:
                res = await t.future
                for i, r in zip(idx, res):
                    out[i] = r
        finally:  # the caller went away (its job closed) or a task failed: no worker starts the rest
            self.drop([t for _, t in tasks])
        return out

    def drop(self, tasks: list[Task]) -> None:
        """Cancel the tasks not answered yet and take them out of the queues (one running on a worker finishes
        there; its answer is discarded)."""
        gone = {t.id for t in tasks if not t.future.done()}
        for t in tasks:
            t.future.cancel()
        if not gone:
            return
        for s, q in list(self.queues.items()):
            if any(t.id in gone for t in q):
                left = deque(t for t in q if t.id not in gone)
                if left:
                    self.queues[s] = left
                else:
                    del self.queues[s]

    def _task_size(self, source: str, max_task: int) -> int:
        """Samples per task: about TASK_S of the source's measured work, at most ``max_task``."""
        c = self._counts.get(source)
        if c is None or c.samples == 0 or c.wall_s <= 0:
            return max_task
        return max(1, min(max_task, int(TASK_S * c.samples / c.wall_s)))

    def assign(self, w: Worker) -> None:
        """A worker became free: give it the next task (fair queueing, see the module docstring), or park it."""
        t = self._next()
        if t is None:
            self.idle.append(w)
            return
        self.busy[t.source] += 1
        w.send(t)

    def _next(self) -> Task | None:
        """Pop the task a free worker takes next, dropping those whose caller went away (and the queues left
        empty: only sources with tasks queued are kept, so a pass costs those, not every source the pool served;
        1,024 sources made each task's dispatch a pass over 1,024 queues)."""
        best: tuple | None = None
        empty = []
        for s, q in self.queues.items():
            while q and q[0].future.done():
                q.popleft()
            if not q:
                empty.append(s)
                continue
            if self.quotas is None:
                key: tuple = (q[0].id,)
            else:
                quota = self.quotas.get(s, DEFAULT_QUOTA)
                under = self.busy[s] < quota
                key = (not under, self.busy[s] / quota if under else 0.0, q[0].id)
            if best is None or key < best[0]:
                best = (key, s)
        for s in empty:
            del self.queues[s]
        if best is None:
            return None
        q = self.queues[best[1]]
        t = q.popleft()
        if not q:
            del self.queues[best[1]]
        return t

    def _unassigned(self, t: Task) -> None:
        """A task left its worker (answered, or its worker died)."""
        self.busy[t.source] -= 1
        if self.busy[t.source] <= 0:
            del self.busy[t.source]

    def forget(self, w: Worker) -> None:
        """A worker is stopping or gone: it takes no more tasks."""
        if w in self.idle:
            self.idle.remove(w)

    def fail_all(self, err: BaseException) -> None:
        """Fail every queued task (at close: a task whose reader was cancelled already is not logged as an
        exception nobody retrieved; a reader still waiting gets the error as before)."""
        for q in self.queues.values():
            while q:
                t = q.popleft()
                if not t.future.done():
                    t.future.set_exception(err)
                    t.future.exception()  # marks it retrieved

    def answered(self, w: Worker, msg: tuple) -> None:
        """A worker's reply ``(task_id, items, cpu_s, wall_s)``: resolve its task and count its cost;
        MsdataError if it answers another task."""
        tid, items, cpu_s, wall_s = msg
        task, w.task = w.task, None
        if task is None or task.id != tid:
            raise MsdataError(f"transform worker {w.n} answered task {tid}, not the one it was given")
        self._unassigned(task)
        c = self._counts.get(task.source)
        if c is None:
            c = self._counts[task.source] = _Counts()
        c.tasks += 1
        c.cpu_s += float(cpu_s)
        c.wall_s += float(wall_s)
        if isinstance(items, tuple) and items[0] == "error":
            if not task.future.done():
                task.future.set_exception(ConfigError(f"transform {task.transform!r} failed to load: {items[1]}"))
        else:
            results = self._unpack(w, items)
            c.samples += len(results)
            self.done += 1
            self.samples += len(results)
            self.bad += sum(isinstance(r, BadSample) for r in results)
            if not task.future.done():
                task.future.set_result(results)

    def rerun(self, task: Task) -> None:
        """Put a dead worker's task back: whole, split into single samples, or (for a sample that keeps
        killing workers) answered with a bad sample."""
        self._unassigned(task)
        task.deaths += 1
        if task.future.done():
            return
        if task.deaths < 2:
            self._queue(task.source).appendleft(task)
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
            t = Task(
                next(self._ids),
                task.transform,
                task.seed,
                task.ids[one],
                task.records[one],
                loop.create_future(),
                task.source,
            )
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
        while self.idle and self.queues:  # (queues are non-empty, but for tasks whose caller went: _next drops)
            self.assign(self.idle.pop())

    def _queue(self, source: str) -> deque[Task]:
        q = self.queues.get(source)
        if q is None:
            q = self.queues[source] = deque()
        return q

    def _submit(self, t: Task) -> None:
        self._queue(t.source).append(t)
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
