"""WorkerPool: a resizable pool of transform worker processes (spawn/forkserver).

Each worker has a private socket pair (tasks and small results, pickled: only our own children are on it)
and an output shared-memory segment for large results. The segment is created by the pool, handed to the
worker as a descriptor and unlinked at once, so /dev/shm holds nothing even if a process is SIGKILLed.
Invariants: a worker runs one task at a time; the parent copies a task's arrays out of the worker's segment
before it sends that worker another task. A worker that dies is replaced and its task re-run elsewhere.

Sources share one pool (one warm forkserver, one set of segments) under per-source quotas with fair queueing
(``set_quotas``; ``_dispatch``), rather than a pool per source: a worker that one source gives back serves
another at once, with no fork and no import, and a source that bursts may borrow idle workers while every
source keeps the workers its quota guarantees. ``resize`` sets how many there are (the autoscaler's job).

This module keeps the workers (start, replace, resize, stop); ``_dispatch`` keeps the tasks (queue, answers,
re-runs), ``_workerproc`` one worker's socket and segment, ``_launch`` how processes start.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import time
from collections.abc import Mapping
from dataclasses import dataclass

import numpy as np

from ..errors import ClosedError, ConfigError, MsdataError
from ..sources.base import BadSample
from ..transforms import load_transform, run_transform
from .dispatch import Dispatcher, SourceUsage
from .launch import LAUNCHERS, STOP_TIMEOUT, kill
from .workerproc import Worker

__all__ = ["PoolStats", "WorkerPool"]

log = logging.getLogger(__name__)

_MAX_START_FAILURES = 3


@dataclass(frozen=True, slots=True, kw_only=True)
class PoolStats:
    """Size and work of the pool."""

    size: int  # target size
    alive: int  # workers started and not yet exited
    busy: int
    queued: int  # tasks waiting for a worker
    tasks_done: int
    samples_done: int
    bad_samples: int
    restarts: int  # workers replaced after dying
    shm_bytes: int  # output segments mapped
    bytes_via_shm: int
    bytes_inline: int
    worker_s: float  # integral of live workers over time since the pool started (worker-seconds provisioned)


class _Provisioned:
    """The integral of live workers over time: worker-seconds provisioned (what a bigger pool costs)."""

    def __init__(self) -> None:
        self.total, self.live, self.at = 0.0, 0, time.monotonic()

    def set(self, live: int) -> None:
        now = time.monotonic()
        self.total += self.live * (now - self.at)
        self.live, self.at = live, now

    def value(self) -> float:
        return self.total + self.live * (time.monotonic() - self.at)


class WorkerPool:
    """Resizable pool of transform worker processes (spawn/forkserver); results return through shared memory."""

    def __init__(
        self,
        size: int,
        *,
        shm_prefix: str = "msd",
        start_method: str = "forkserver",
        out_bytes: int = 1 << 20,
        max_task: int = 256,
    ):
        if isinstance(size, bool) or not isinstance(size, int) or size < 0:
            raise ConfigError(f"worker pool {size=} must be an integer >= 0")
        methods = tuple(LAUNCHERS)
        if start_method not in methods:
            raise ConfigError(f"worker pool {start_method=} must be one of {methods} (fork is unsafe with threads)")
        self._target = size
        self.shm_prefix = shm_prefix
        self.start_method = start_method
        self.out_bytes = int(out_bytes)
        self.max_task = int(max_task)
        self._launcher = LAUNCHERS[start_method]()
        self._workers: set[Worker] = set()
        self._wn = itertools.count()
        self._tasks: set[asyncio.Task] = set()
        self._jobs = Dispatcher(self._own)
        self._respawns: set[asyncio.Task] = set()
        self._started = self._closed = False
        self._start_failures = self._restarts = 0
        self._provisioned = _Provisioned()

    # ---- lifecycle ----
    @property
    def size(self) -> int:
        """The target number of workers."""
        return self._target

    async def start(self) -> None:
        """Start the workers and wait until each is ready. Idempotent."""
        if self._closed:
            raise ClosedError("worker pool is closed; make a new one")
        if self._started:
            return
        self._started = True
        await self._launcher.start()
        await self._grow(self._target)

    async def aclose(self) -> None:
        """Stop every worker (killing those that do not exit in time), fail pending tasks, unmap memory.
        Idempotent."""
        if self._closed:
            return
        self._closed = True
        err = ClosedError("worker pool closed")
        self._jobs.fail_all(err)
        workers = list(self._workers)
        try:
            for w in workers:
                self._stop(w)
            serves = [w.serve for w in workers if w.serve is not None and not w.serve.done()]
            if serves:
                _, pending = await asyncio.wait(serves, timeout=STOP_TIMEOUT)
                for w in workers:
                    if w.serve in pending:
                        log.warning(
                            "transform worker %d (pid %s) did not stop in %.1fs; killing it", w.n, w.pid, STOP_TIMEOUT
                        )
                        kill(w.pid)
                if pending:
                    await asyncio.wait(pending, timeout=STOP_TIMEOUT)
        finally:
            for t in list(self._tasks):
                t.cancel("worker pool closed")
            if self._tasks:
                await asyncio.gather(*self._tasks, return_exceptions=True)
            for w in workers:
                if w.pid is not None and w in self._workers:
                    kill(w.pid)
                self._discard(w, err)
            self._jobs.idle.clear()
            await self._launcher.aclose()

    async def wait_ready(self) -> None:
        """Wait until the replacements of dead workers have started (or failed to)."""
        while self._respawns:
            await asyncio.wait(set(self._respawns))

    async def __aenter__(self) -> WorkerPool:
        await self.start()
        return self

    async def __aexit__(self, *exc) -> None:
        await self.aclose()

    # ---- workers ----
    def _own(self, coro, name: str) -> asyncio.Task:
        t = asyncio.get_running_loop().create_task(coro, name=name)
        self._tasks.add(t)
        t.add_done_callback(self._tasks.discard)
        return t

    async def _grow(self, n: int) -> None:
        if n > 0:
            results = await asyncio.gather(*(self._spawn() for _ in range(n)), return_exceptions=True)
            errs = [r for r in results if isinstance(r, BaseException)]
            if errs:
                raise errs[0]

    async def _spawn(self) -> Worker:
        """Start one worker and wait for its ready message."""
        w = Worker(next(self._wn))
        self._workers.add(w)
        try:
            ready = await w.launch(self._launcher, self.shm_prefix, self.out_bytes)
            w.serve = self._own(self._serve(w), f"msdata-worker-{w.n}")
            await asyncio.shield(ready)
        except BaseException as e:
            self._stop(w)
            if w.pid is not None and (w.serve is None or not w.serve.done()):
                kill(w.pid)
                await self._launcher.reap(w.pid)
            self._discard(w, e)
            raise
        self._start_failures = 0
        self._tick()
        self._free(w)
        return w

    def _stop(self, w: Worker) -> None:
        """Ask a worker to exit (it finishes nothing more) and close our end."""
        if w.stopping:
            return
        self._jobs.forget(w)
        w.stop()
        self._tick()

    def _discard(self, w: Worker, err: BaseException | None = None) -> None:
        """Forget a worker that has exited: fail its task (given err), unmap its segment."""
        self._workers.discard(w)
        self._jobs.forget(w)
        w.close(err)
        self._tick()

    def _tick(self) -> None:
        """Account worker-seconds up to now (call after every change of the live workers)."""
        self._provisioned.set(sum(1 for w in self._workers if w.alive))

    def _free(self, w: Worker) -> None:
        """A worker became free: retire it, or let the dispatcher give it the next task or park it."""
        if w.stopping:
            return
        if w.retiring or self._closed:
            self._stop(w)
            return
        self._jobs.assign(w)

    async def _serve(self, w: Worker) -> None:
        """Read a worker's messages until it exits; then replace it if it died."""
        try:
            while True:
                msg = await w.receive()
                if msg[0] == "ready":
                    assert w.ready is not None, "a launched worker has its ready future"
                    w.ready.set_result(msg[1])
                    continue
                self._jobs.answered(w, msg)
                self._free(w)
        except (asyncio.IncompleteReadError, ConnectionError, OSError, EOFError):
            pass
        except asyncio.CancelledError:
            return
        except Exception:
            log.exception("transform worker %d: bad message; stopping it", w.n)
            self._stop(w)
        await self._exited(w)

    async def _exited(self, w: Worker) -> None:
        died = not w.stopping and not self._closed
        code = await self._launcher.reap(w.pid) if w.pid is not None else None
        task, w.task = w.task, None
        was_ready = w.was_ready
        self._discard(w)
        if not was_ready:
            return  # died while starting: its spawner sees the error and decides
        if self._closed:
            if task is not None and not task.future.done():
                task.future.set_exception(ClosedError("worker pool closed"))
                task.future.exception()  # marks it retrieved: its reader may be gone (see fail_all)
            return
        if task is not None:
            self._jobs.rerun(task)
        if died:
            log.warning("transform worker %d (pid %s) died (exit code %s); replacing it", w.n, w.pid, code)
            self._replace()

    def _replace(self) -> None:
        if self._closed or self._alive_or_starting() >= self._target:
            return
        if self._start_failures >= _MAX_START_FAILURES:
            err = MsdataError(f"transform workers failed to start {self._start_failures} times in a row; giving up")
            log.error("%s", err)
            self._jobs.fail_all(err)
            return
        self._restarts += 1
        t = self._own(self._respawn(), "msdata-respawn")
        self._respawns.add(t)
        t.add_done_callback(self._respawns.discard)

    async def _respawn(self) -> None:
        try:
            await self._spawn()
        except Exception as e:
            log.error("cannot start a transform worker: %s", e)
            self._start_failures += 1
            self._replace()

    def _alive_or_starting(self) -> int:
        return sum(1 for w in self._workers if not w.stopping and not w.retiring)

    # ---- the API ----
    async def transform(self, transform: str | None, records: list, *, seed: int, sample_ids, source: str = "") -> list:
        """Transform records in the workers; order preserved; a BadSample stays one, and a sample on which
        the transform raises becomes one. ``source`` names whose quota and profile the work counts against."""
        if self._closed:
            raise ClosedError("worker pool is closed")
        ids = np.asarray(sample_ids, dtype=np.int64).reshape(-1)
        if len(ids) != len(records):
            raise ValueError(f"{len(records)} records but {len(ids)} sample_ids")
        todo = [i for i, r in enumerate(records) if not isinstance(r, BadSample)]
        if not todo:
            return list(records)
        if transform is None:
            return run_transform(load_transform(None), records, seed=seed, sample_ids=ids)
        if self._target == 0:  # no workers: transform in a thread of this process
            return await asyncio.to_thread(run_transform, load_transform(transform), records, seed=seed, sample_ids=ids)
        await self.start()
        return await self._jobs.run(transform, records, todo, seed=seed, ids=ids, max_task=self.max_task, source=source)

    def set_quotas(self, quotas: Mapping[str, float] | None) -> None:
        """Workers guaranteed to each source (fair queueing; None: one FIFO queue for all, as a fixed pool)."""
        self._jobs.set_quotas(quotas)

    def usage(self) -> dict[str, SourceUsage]:
        """Per source: the cumulative CPU and worker seconds and samples of its tasks, its busy and queued tasks."""
        return self._jobs.usage()

    async def resize(self, size: int) -> None:
        """Grow or shrink to ``size`` workers while tasks are in flight: nothing is lost or repeated (a
        retiring worker finishes its task first)."""
        if isinstance(size, bool) or not isinstance(size, int) or size < 0:
            raise ConfigError(f"worker pool resize {size=} must be an integer >= 0")
        if self._closed:
            raise ClosedError("worker pool is closed")
        self._target = size
        if not self._started:
            return
        active = [w for w in self._workers if not w.stopping and not w.retiring]
        if len(active) < size:
            await self._grow(size - len(active))
            return
        excess = len(active) - size
        # retire idle workers first, then busy ones after their current task
        for w in sorted(active, key=lambda w: w.task is not None)[:excess]:
            w.retiring = True
            if w.task is None and w in self._jobs.idle:
                self._stop(w)

    def statistics(self) -> PoolStats:
        jobs = self._jobs
        return PoolStats(
            size=self._target,
            alive=sum(1 for w in self._workers if w.alive),
            busy=sum(1 for w in self._workers if w.task is not None),
            queued=jobs.queued,
            tasks_done=jobs.done,
            samples_done=jobs.samples,
            bad_samples=jobs.bad,
            restarts=self._restarts,
            shm_bytes=sum(w.seg.size for w in self._workers if w.seg is not None),
            bytes_via_shm=jobs.via_shm,
            bytes_inline=jobs.inline,
            worker_s=self.worker_seconds(),
        )

    def worker_seconds(self) -> float:
        """Integral of live workers over time since the pool started."""
        return self._provisioned.value()

    def pids(self) -> list[int]:
        """Process ids of the live workers (for tests and status)."""
        return sorted(w.pid for w in self._workers if w.pid is not None and not w.stopping)

    def retiring_pids(self) -> list[int]:
        """Process ids of workers that finish their task and then exit (a shrink under way)."""
        return sorted(w.pid for w in self._workers if w.pid is not None and w.retiring and not w.stopping)

    def helper_pids(self) -> list[int]:
        """Process ids of the pool's other processes (the forkserver), for memory accounting."""
        proc = getattr(self._launcher, "proc", None)
        return [proc.pid] if proc is not None and proc.poll() is None else []
