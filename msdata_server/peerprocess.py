"""The process at the other end of a local client socket, watched through a pidfd: a rank whose socket broke
while its process lives may come back; one whose process exited will not."""

from __future__ import annotations

import asyncio
import os
import select
from collections.abc import Callable

__all__ = ["PeerProcess"]


class PeerProcess:
    """The client's process, watched through a pidfd: whether it has exited, and a callback when it does.

    Nothing is known (``exited()`` False, ``watch`` refuses) when the kernel gave no pid (a client in another
    pid namespace) or pidfds are unavailable. Owns the pidfd: ``close()`` (idempotent) releases it.
    """

    def __init__(self, pid: int | None, loop: asyncio.AbstractEventLoop):
        self._loop = loop
        self._fd: int | None = None
        self._watching = False
        if pid:
            try:
                self._fd = os.pidfd_open(pid)
            except (OSError, AttributeError):
                self._fd = None

    @property
    def watching(self) -> bool:
        return self._watching

    def exited(self) -> bool:
        """True when the process is known to have exited (a pidfd turns readable then)."""
        if self._fd is None:
            return False
        readable, _, _ = select.select([self._fd], [], [], 0)
        return bool(readable)

    def watch(self, on_exit: Callable[[], None]) -> bool:
        """Call ``on_exit()`` once when the process exits; False when it cannot be watched."""
        if self._fd is None or self._watching:
            return False
        self._watching = True

        def fire() -> None:
            self.close()
            on_exit()

        self._loop.add_reader(self._fd, fire)
        return True

    def close(self) -> None:
        if self._fd is None:
            return
        if self._watching:
            self._watching = False
            self._loop.remove_reader(self._fd)
        os.close(self._fd)
        self._fd = None
