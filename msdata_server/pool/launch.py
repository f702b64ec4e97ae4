"""How a WorkerPool starts its worker processes: each a fresh interpreter (spawn), or forked from one warm
per-pool forkserver (the zygote) that preloaded the imports. Never from the server's own process image.

Kept apart from the pool because it is process plumbing (Popen, descriptor passing, pidfd waits) that the
pool's bookkeeping of workers and tasks does not need to see.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import select
import signal
import socket
import subprocess
import sys

from ..errors import MsdataError

__all__ = ["DATA_START", "LAUNCHERS", "STOP_TIMEOUT", "Spawner", "Zygote", "kill"]

log = logging.getLogger(__name__)

DATA_START = 4096  # after the segment's owner header (msdata_client.ring.HEADER_SIZE)
STOP_TIMEOUT = 3.0  # seconds a worker gets to exit before it is killed


def _child_env() -> dict[str, str]:
    """The environment of worker processes: the server's, with its sys.path (so transforms import the same
    modules the server validated, as multiprocessing's spawn does)."""
    env = dict(os.environ)
    paths = [p or os.getcwd() for p in sys.path]
    env["PYTHONPATH"] = os.pathsep.join(dict.fromkeys(paths))
    return env


class Spawner:
    """Starts each worker as a fresh interpreter."""

    def __init__(self) -> None:
        self.procs: dict[int, subprocess.Popen] = {}

    async def start(self) -> None:
        pass

    def _popen(self, sock_fd: int, seg_fd: int, seg_size: int) -> subprocess.Popen:
        fds = (sock_fd,) if seg_fd < 0 else (sock_fd, seg_fd)
        args = ["worker", str(sock_fd), str(seg_fd), str(seg_size), str(DATA_START)]
        cmd = [sys.executable, "-m", "msdata_server.pool.worker", *args]
        return subprocess.Popen(cmd, pass_fds=fds, stdin=subprocess.DEVNULL, env=_child_env())

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
            return await asyncio.to_thread(p.wait, STOP_TIMEOUT)
        except subprocess.TimeoutExpired:
            p.kill()
            return await asyncio.to_thread(p.wait)

    async def aclose(self) -> None:
        for pid in list(self.procs):
            await self.reap(pid)


class Zygote(Spawner):
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
                [sys.executable, "-m", "msdata_server.pool.worker", "zygote", str(theirs.fileno())],
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
        assert self.sock is not None, "the zygote is started before it forks"
        socket.send_fds(self.sock, [b"F %d %d" % (seg_size, DATA_START)], fds)
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
        await asyncio.to_thread(_wait_gone, pid, STOP_TIMEOUT)
        return None

    async def aclose(self) -> None:
        if self.sock is not None:
            self.sock.close()  # the forkserver exits on EOF
            self.sock = None
        if self.proc is not None:
            try:
                await asyncio.to_thread(self.proc.wait, STOP_TIMEOUT)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                await asyncio.to_thread(self.proc.wait)
            self.proc = None


LAUNCHERS: dict[str, type[Spawner]] = {"forkserver": Zygote, "spawn": Spawner}  # by WorkerPool start_method


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


def kill(pid: int | None) -> None:
    """SIGKILL a worker that may already be gone."""
    if pid is None:
        return
    with contextlib.suppress(ProcessLookupError):
        os.kill(pid, signal.SIGKILL)
