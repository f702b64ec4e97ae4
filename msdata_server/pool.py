"""WorkerPool: a resizable pool of transform worker processes (spawn/forkserver).

Each worker has a private socket pair (tasks and small results, pickled: only our own children are on it)
and an output shared-memory segment for large results. The segment is created by the pool, handed to the
worker as a descriptor and unlinked at once, so /dev/shm holds nothing even if a process is SIGKILLed.
Invariants: a worker runs one task at a time; the parent copies a task's arrays out of the worker's segment
before it sends that worker another task. A worker that dies is replaced and its task re-run elsewhere.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import os
import pickle
import select
import signal
import socket
import struct
import subprocess
import sys
from collections import deque
from dataclasses import dataclass

import numpy as np

from .errors import ClosedError, ConfigError, MsdataError
from .shm import Segment, create_segment
from .sources.base import BadSample
from .transforms import load_transform, run_transform

__all__ = ["PoolStats", "WorkerPool"]

log = logging.getLogger(__name__)

_HDR = struct.Struct("!i")
_HDR_BIG = struct.Struct("!Q")
_DATA_START = 4096  # after the segment's owner header (msdata_client.ring.HEADER_SIZE)
_STOP_TIMEOUT = 3.0  # seconds a worker gets to exit before it is killed
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


class _Task:
    __slots__ = ("id", "transform", "seed", "ids", "records", "future", "deaths")

    def __init__(self, tid: int, transform: str, seed: int, ids: np.ndarray, records: list, future: asyncio.Future):
        self.id = tid
        self.transform = transform
        self.seed = seed
        self.ids = ids
        self.records = records
        self.future = future
        self.deaths = 0


class _Worker:
    __slots__ = ("n", "pid", "reader", "writer", "seg", "task", "retiring", "stopping", "ready", "serve")

    def __init__(self, n: int):
        self.n = n
        self.pid: int | None = None
        self.reader: asyncio.StreamReader | None = None
        self.writer: asyncio.StreamWriter | None = None
        self.seg: Segment | None = None
        self.task: _Task | None = None
        self.retiring = False  # stop after the current task (shrink)
        self.stopping = False  # told to stop: its EOF is not a death
        self.ready: asyncio.Future | None = None
        self.serve: asyncio.Task | None = None


def _child_env() -> dict[str, str]:
    """The environment of worker processes: the server's, with its sys.path (so transforms import the same
    modules the server validated, as multiprocessing's spawn does)."""
    env = dict(os.environ)
    paths = [p or os.getcwd() for p in sys.path]
    env["PYTHONPATH"] = os.pathsep.join(dict.fromkeys(paths))
    return env


class _Spawner:
    """Starts each worker as a fresh interpreter."""

    def __init__(self) -> None:
        self.procs: dict[int, subprocess.Popen] = {}

    async def start(self) -> None:
        pass

    def _popen(self, sock_fd: int, seg_fd: int, seg_size: int) -> subprocess.Popen:
        fds = (sock_fd,) if seg_fd < 0 else (sock_fd, seg_fd)
        args = ["worker", str(sock_fd), str(seg_fd), str(seg_size), str(_DATA_START)]
        return subprocess.Popen(
            [sys.executable, "-m", "msdata_server._worker", *args], pass_fds=fds, stdin=subprocess.DEVNULL, env=_child_env()
        )

    async def launch(self, sock_fd: int, seg_fd: int, seg_size: int) -> int:
        p = await asyncio.to_thread(self._popen, sock_fd, seg_fd, seg_size)
        self.procs[p.pid] = p
        return p.pid

    async def reap(self, pid: int) -> int | None:
        """Wait for an exited worker (its socket reached EOF) and return its exit code."""
        p = self.procs.pop(pid, None)
        if p is None:
            return None
        try:
            return await asyncio.to_thread(p.wait, _STOP_TIMEOUT)
        except subprocess.TimeoutExpired:
            p.kill()
            return await asyncio.to_thread(p.wait)

    async def aclose(self) -> None:
        for pid in list(self.procs):
            await self.reap(pid)


class _Zygote(_Spawner):
    """Forks workers from one warm process per pool (a forkserver that preloaded the imports)."""

    def __init__(self) -> None:
        super().__init__()
        self.proc: subprocess.Popen | None = None
        self.sock: socket.socket | None = None
        self.lock = asyncio.Lock()

    async def start(self) -> None:
        ours, theirs = socket.socketpair()
        try:
            self.proc = await asyncio.to_thread(
                subprocess.Popen,
                [sys.executable, "-m", "msdata_server._worker", "zygote", str(theirs.fileno())],
                pass_fds=(theirs.fileno(),),
                stdin=subprocess.DEVNULL,
                env=_child_env(),
            )
        except BaseException:
            ours.close()
            raise
        finally:
            theirs.close()
        self.sock = ours

    def _fork(self, sock_fd: int, seg_fd: int, seg_size: int) -> int:
        fds = [sock_fd] if seg_fd < 0 else [sock_fd, seg_fd]
        socket.send_fds(self.sock, [b"F %d %d" % (seg_size, _DATA_START)], fds)
        reply = self.sock.recv(64)
        if not reply.startswith(b"P "):
            raise MsdataError("the transform forkserver exited; see its error output above")
        return int(reply[2:])

    async def launch(self, sock_fd: int, seg_fd: int, seg_size: int) -> int:
        async with self.lock:
            try:
                return await asyncio.to_thread(self._fork, sock_fd, seg_fd, seg_size)
            except (OSError, MsdataError) as e:
                log.warning("the transform forkserver is gone (%s); starting a new one", e)
            await self.aclose()
            await self.start()
            return await asyncio.to_thread(self._fork, sock_fd, seg_fd, seg_size)

    async def reap(self, pid: int) -> int | None:
        """Wait until the worker has exited (the kernel reaps it: SIGCHLD is ignored in the forkserver)."""
        await asyncio.to_thread(_wait_gone, pid, _STOP_TIMEOUT)
        return None

    async def aclose(self) -> None:
        if self.sock is not None:
            self.sock.close()  # the forkserver exits on EOF
            self.sock = None
        if self.proc is not None:
            try:
                await asyncio.to_thread(self.proc.wait, _STOP_TIMEOUT)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                await asyncio.to_thread(self.proc.wait)
            self.proc = None


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
        methods = ("forkserver", "spawn")
        if start_method not in methods:
            raise ConfigError(f"worker pool {start_method=} must be one of {methods} (fork is unsafe with threads)")
        self._target = size
        self.shm_prefix = shm_prefix
        self.start_method = start_method
        self.out_bytes = int(out_bytes)
        self.max_task = int(max_task)
        self._launcher = _Zygote() if start_method == "forkserver" else _Spawner()
        self._workers: set[_Worker] = set()
        self._idle: list[_Worker] = []
        self._queue: deque[_Task] = deque()
        self._ids = itertools.count()
        self._wn = itertools.count()
        self._tasks: set[asyncio.Task] = set()
        self._respawns: set[asyncio.Task] = set()
        self._started = False
        self._closed = False
        self._start_failures = 0
        self._done = self._samples = self._bad = self._restarts = self._via_shm = self._inline = 0

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
        while self._queue:
            t = self._queue.popleft()
            if not t.future.done():
                t.future.set_exception(err)
        workers = list(self._workers)
        try:
            for w in workers:
                self._stop(w)
            serves = [w.serve for w in workers if w.serve is not None and not w.serve.done()]
            if serves:
                _, pending = await asyncio.wait(serves, timeout=_STOP_TIMEOUT)
                for w in workers:
                    if w.serve in pending:
                        log.warning("transform worker %d (pid %s) did not stop in %.1fs; killing it", w.n, w.pid, _STOP_TIMEOUT)
                        _kill(w.pid)
                if pending:
                    await asyncio.wait(pending, timeout=_STOP_TIMEOUT)
        finally:
            for t in list(self._tasks):
                t.cancel("worker pool closed")
            if self._tasks:
                await asyncio.gather(*self._tasks, return_exceptions=True)
            for w in workers:
                if w.pid is not None and w in self._workers:
                    _kill(w.pid)
                self._discard(w, err)
            self._idle.clear()
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

    async def _spawn(self) -> _Worker:
        """Start one worker and wait for its ready message."""
        w = _Worker(next(self._wn))
        loop = asyncio.get_running_loop()
        w.ready = loop.create_future()
        ours, theirs = socket.socketpair()
        self._workers.add(w)
        try:
            if self.out_bytes:
                w.seg = create_segment(self.shm_prefix, "pool", self.out_bytes, info={"worker": w.n}, unlink=True)
            seg_fd, seg_size = (w.seg.fd, w.seg.size) if w.seg is not None else (-1, 0)
            w.pid = await self._launcher.launch(theirs.fileno(), seg_fd, seg_size)
            theirs.close()
            w.reader, w.writer = await asyncio.open_connection(sock=ours)
            w.serve = self._own(self._serve(w), f"msdata-worker-{w.n}")
            await asyncio.shield(w.ready)
        except BaseException as e:
            theirs.close()
            if w.writer is None:
                ours.close()
            self._stop(w)
            if w.pid is not None and (w.serve is None or not w.serve.done()):
                _kill(w.pid)
                await self._launcher.reap(w.pid)
            self._discard(w, e)
            raise
        self._start_failures = 0
        self._dispatch(w)
        return w

    def _stop(self, w: _Worker) -> None:
        """Ask a worker to exit (it finishes nothing more) and close our end."""
        if w.stopping:
            return
        w.stopping = True
        if w in self._idle:
            self._idle.remove(w)
        if w.writer is not None and not w.writer.is_closing():
            try:
                w.writer.write(_frame(pickle.dumps(None)))
                w.writer.close()
            except (ConnectionError, RuntimeError):
                pass

    def _discard(self, w: _Worker, err: BaseException | None = None) -> None:
        """Forget a worker that has exited: fail or requeue its task, unmap its segment."""
        self._workers.discard(w)
        if w in self._idle:
            self._idle.remove(w)
        if w.ready is not None and not w.ready.done():
            w.ready.set_exception(err or MsdataError(f"transform worker {w.n} exited before it was ready"))
            w.ready.exception()  # retrieved: the spawner re-raises it
        if w.task is not None and not w.task.future.done():
            if err is not None:
                w.task.future.set_exception(err)
        w.task = None
        if w.writer is not None and not w.writer.is_closing():
            w.writer.close()
        if w.seg is not None:
            w.seg.close()
            w.seg = None

    async def _serve(self, w: _Worker) -> None:
        """Read a worker's messages until it exits; then replace it if it died."""
        try:
            while True:
                msg = pickle.loads(await _read_frame(w.reader))
                if msg[0] == "ready":
                    w.ready.set_result(msg[1])
                    continue
                tid, items = msg
                task, w.task = w.task, None
                if task is None or task.id != tid:
                    raise MsdataError(f"transform worker {w.n} answered task {tid}, not the one it was given")
                if isinstance(items, tuple) and items[0] == "error":
                    if not task.future.done():
                        task.future.set_exception(ConfigError(f"transform {task.transform!r} failed to load: {items[1]}"))
                else:
                    results = self._unpack(w, items)
                    self._done += 1
                    self._samples += len(results)
                    self._bad += sum(isinstance(r, BadSample) for r in results)
                    if not task.future.done():
                        task.future.set_result(results)
                self._dispatch(w)
        except (asyncio.IncompleteReadError, ConnectionError, OSError, EOFError):
            pass
        except asyncio.CancelledError:
            return
        except Exception:
            log.exception("transform worker %d: bad message; stopping it", w.n)
            self._stop(w)
        await self._exited(w)

    async def _exited(self, w: _Worker) -> None:
        died = not w.stopping and not self._closed
        code = await self._launcher.reap(w.pid) if w.pid is not None else None
        task, w.task = w.task, None
        was_ready = w.ready is not None and w.ready.done() and not w.ready.cancelled() and w.ready.exception() is None
        self._discard(w)
        if not was_ready:
            return  # died while starting: its spawner sees the error and decides
        if self._closed:
            if task is not None and not task.future.done():
                task.future.set_exception(ClosedError("worker pool closed"))
            return
        if task is not None:
            self._rerun(task, w)
        if died:
            log.warning("transform worker %d (pid %s) died (exit code %s); replacing it", w.n, w.pid, code)
            self._replace()

    def _rerun(self, task: _Task, w: _Worker) -> None:
        """Put a dead worker's task back: whole, split into single samples, or (for a sample that keeps
        killing workers) answered with a bad sample."""
        task.deaths += 1
        if task.future.done():
            return
        if task.deaths < 2:
            self._queue.appendleft(task)
        elif len(task.records) > 1:
            self._own(self._split(task), f"msdata-split-{task.id}")
        else:
            bad = BadSample("worker_crash", f"sample {int(task.ids[0])}", f"killed {task.deaths} transform workers")
            task.future.set_result([bad])
            return
        self._kick()

    async def _split(self, task: _Task) -> None:
        loop = asyncio.get_running_loop()
        subs = []
        for i in range(len(task.records)):
            one = slice(i, i + 1)
            t = _Task(next(self._ids), task.transform, task.seed, task.ids[one], task.records[one], loop.create_future())
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

    def _replace(self) -> None:
        if self._closed or self._alive_or_starting() >= self._target:
            return
        if self._start_failures >= _MAX_START_FAILURES:
            err = MsdataError(f"transform workers failed to start {self._start_failures} times in a row; giving up")
            log.error("%s", err)
            while self._queue:
                t = self._queue.popleft()
                if not t.future.done():
                    t.future.set_exception(err)
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

    # ---- tasks ----
    def _dispatch(self, w: _Worker) -> None:
        """A worker became free: retire it, give it the next task, or park it."""
        if w.stopping:
            return
        if w.retiring or self._closed:
            self._stop(w)
            return
        while self._queue:
            t = self._queue.popleft()
            if t.future.done():  # its caller went away
                continue
            self._send(w, t)
            return
        self._idle.append(w)

    def _kick(self) -> None:
        while self._queue and self._idle:
            self._dispatch(self._idle.pop())

    def _send(self, w: _Worker, t: _Task) -> None:
        w.task = t
        msg = (t.id, t.transform, t.seed, t.ids, t.records)
        w.writer.write(_frame(pickle.dumps(msg, protocol=pickle.HIGHEST_PROTOCOL)))

    def _submit(self, t: _Task) -> None:
        self._queue.append(t)
        self._kick()

    def _unpack(self, w: _Worker, items: list) -> list:
        out = []
        mm = w.seg.mm if w.seg is not None else None
        for it in items:
            kind = it[0]
            if kind == "s":
                _, off, dtype, shape = it
                dt = np.dtype(dtype)
                count = int(np.prod(shape, dtype=np.int64))
                view = np.frombuffer(mm, dtype=dt, count=count, offset=off)
                a = view.reshape(shape).copy()
                del view
                self._via_shm += a.nbytes
                out.append(a)
            elif kind == "a":
                self._inline += it[1].nbytes
                out.append(it[1])
            else:
                out.append(BadSample(it[1], it[2], it[3]))
        return out

    async def transform(self, transform: str | None, records: list, *, seed: int, sample_ids) -> list:
        """Transform records in the workers; order preserved; a BadSample stays one, and a sample on which
        the transform raises becomes one."""
        if self._closed:
            raise ClosedError("worker pool is closed")
        ids = np.asarray(sample_ids, dtype=np.int64).reshape(-1)
        if len(ids) != len(records):
            raise ValueError(f"{len(records)} records but {len(ids)} sample_ids")
        out = list(records)
        todo = [i for i, r in enumerate(records) if not isinstance(r, BadSample)]
        if not todo:
            return out
        if transform is None:
            return run_transform(load_transform(None), records, seed=seed, sample_ids=ids)
        if self._target == 0:  # no workers: transform in a thread of this process
            return await asyncio.to_thread(run_transform, load_transform(transform), records, seed=seed, sample_ids=ids)
        await self.start()
        loop = asyncio.get_running_loop()
        tasks = []
        for lo in range(0, len(todo), self.max_task):
            idx = todo[lo : lo + self.max_task]
            t = _Task(next(self._ids), transform, seed, ids[idx], [records[i] for i in idx], loop.create_future())
            tasks.append((idx, t))
            self._submit(t)
        for idx, t in tasks:
            res = await t.future
            for i, r in zip(idx, res):
                out[i] = r
        return out

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
            if w.task is None and w in self._idle:
                self._stop(w)

    def statistics(self) -> PoolStats:
        return PoolStats(
            size=self._target,
            alive=sum(1 for w in self._workers if w.pid is not None and not w.stopping),
            busy=sum(1 for w in self._workers if w.task is not None),
            queued=len(self._queue),
            tasks_done=self._done,
            samples_done=self._samples,
            bad_samples=self._bad,
            restarts=self._restarts,
            shm_bytes=sum(w.seg.size for w in self._workers if w.seg is not None),
            bytes_via_shm=self._via_shm,
            bytes_inline=self._inline,
        )

    def pids(self) -> list[int]:
        """Process ids of the live workers (for tests and status)."""
        return sorted(w.pid for w in self._workers if w.pid is not None and not w.stopping)

    def helper_pids(self) -> list[int]:
        """Process ids of the pool's other processes (the forkserver), for memory accounting."""
        proc = getattr(self._launcher, "proc", None)
        return [proc.pid] if proc is not None and proc.poll() is None else []


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


def _wait_gone(pid: int, timeout: float) -> None:
    """Block until a process that is not our child has exited (pidfd), killing it after timeout."""
    try:
        fd = os.pidfd_open(pid)
    except ProcessLookupError:
        return
    try:
        if not select.select([fd], [], [], timeout)[0]:
            log.warning("transform worker pid %s did not exit in %.1fs; killing it", pid, timeout)
            signal.pidfd_send_signal(fd, signal.SIGKILL)
            select.select([fd], [], [], timeout)
    finally:
        os.close(fd)


def _kill(pid: int | None) -> None:
    if pid is None:
        return
    try:
        os.kill(pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
