"""The systemd notify protocol (sd_notify(3)) without a dependency: one datagram per message to $NOTIFY_SOCKET.

Under ``Type=notify`` systemd waits for ``READY=1`` before it calls the unit started, and with ``WatchdogSec=``
it restarts a server that stops sending ``WATCHDOG=1``. The watchdog pings come from the event loop itself, so a
loop that is stuck (a blocking call, a busy callback) stops pinging and systemd notices. Everything is a no-op
when $NOTIFY_SOCKET is unset (a terminal, a container, a test), and sending never raises.
"""

from __future__ import annotations

import asyncio
import logging
import os
import socket
from collections.abc import Mapping
from typing import Self

__all__ = ["Notifier", "notify"]

log = logging.getLogger(__name__)


def _address(env: Mapping[str, str]) -> str | None:
    """$NOTIFY_SOCKET as a socket address: a path, or the abstract namespace when it starts with '@'."""
    path = env.get("NOTIFY_SOCKET", "")
    if not path:
        return None
    if path.startswith("@"):
        return "\0" + path[1:]
    return path


def _send(sock: socket.socket, addr: str, msg: str, *, warn: bool = True) -> bool:
    try:
        sock.sendto(msg.encode(), addr)
        return True
    except OSError as e:  # a full or vanished socket must never take the server down
        level = logging.WARNING if warn else logging.DEBUG
        log.log(level, "sd_notify %r to %r failed: %s", msg.split("\n", 1)[0], addr, e)
        return False


def notify(msg: str, *, env: Mapping[str, str] | None = None) -> bool:
    """Send one notify message (``"READY=1"``, ``"STATUS=..."``, several joined by newlines) with a fresh socket.

    Returns whether it was sent; False (and nothing done) when $NOTIFY_SOCKET is unset.
    """
    addr = _address(os.environ if env is None else env)
    if addr is None:
        return False
    with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM | socket.SOCK_CLOEXEC | socket.SOCK_NONBLOCK) as s:
        return _send(s, addr, msg)


class Notifier:
    """This process's channel to systemd: ``ready()``, ``status()``, ``watchdog()``, ``stopping()``, ``close()``.

    Reads the environment once. The watchdog is enabled when $WATCHDOG_USEC is set and $WATCHDOG_PID is unset or
    names this process (systemd sets it for the main PID; a child that inherited the variables must not ping).
    """

    def __init__(self, env: Mapping[str, str] | None = None):
        env = os.environ if env is None else env
        self._addr = _address(env)
        self._sock: socket.socket | None = None
        if self._addr is not None:
            self._sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM | socket.SOCK_CLOEXEC | socket.SOCK_NONBLOCK)
        self.watchdog_usec = _watchdog_usec(env)
        self._failing = False  # the last send failed: a warning was logged, repeats go to debug until one succeeds

    @property
    def enabled(self) -> bool:
        return self._sock is not None

    @property
    def watchdog_interval(self) -> float | None:
        """Seconds between pings: half of $WATCHDOG_USEC, as sd_watchdog_enabled(3) advises; None when off."""
        if not self.enabled or self.watchdog_usec is None:
            return None
        return self.watchdog_usec / 2e6

    def send(self, msg: str) -> bool:
        if self._sock is None or self._addr is None:
            return False
        sent = _send(self._sock, self._addr, msg, warn=not self._failing)
        if not sent and not self._failing:
            log.warning(
                "sd_notify: further failures to reach %r are logged at debug level until one succeeds", self._addr
            )
        self._failing = not sent
        return sent

    def ready(self, status: str | None = None) -> bool:
        """The server accepts clients (after binding its socket and starting its pool)."""
        return self.send("READY=1" if status is None else f"READY=1\nSTATUS={status}")

    def status(self, text: str) -> bool:
        """A one-line status that `systemctl status` shows."""
        return self.send(f"STATUS={text}")

    def watchdog(self) -> bool:
        return self.send("WATCHDOG=1")

    def stopping(self) -> bool:
        """The graceful shutdown began (systemd then waits up to TimeoutStopSec)."""
        return self.send("STOPPING=1")

    async def watchdog_loop(self, interval: float | None = None) -> None:
        """Ping every ``interval`` seconds (default: ``watchdog_interval``) until cancelled; returns at once when
        the watchdog is off. The pings are loop callbacks: while the loop is blocked, none is sent."""
        every = self.watchdog_interval if interval is None else interval
        if every is None or not self.enabled:
            return
        if every <= 0:
            raise ValueError(f"watchdog interval={every!r} must be > 0 seconds")
        while True:
            self.watchdog()
            await asyncio.sleep(every)

    def close(self) -> None:
        """Close the socket (idempotent); later messages are dropped."""
        if self._sock is not None:
            self._sock.close()
            self._sock = None

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _watchdog_usec(env: Mapping[str, str]) -> int | None:
    usec, pid = env.get("WATCHDOG_USEC", ""), env.get("WATCHDOG_PID", "")
    if not usec:
        return None
    if pid and pid != str(os.getpid()):
        log.debug("WATCHDOG_PID=%s is not this process (%d): the watchdog is off here", pid, os.getpid())
        return None
    try:
        value = int(usec)
    except ValueError:
        log.warning("ignoring WATCHDOG_USEC=%r: not an integer number of microseconds", usec)
        return None
    return value if value > 0 else None
