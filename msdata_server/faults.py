"""Fault injection for tests, in one place: lost frames, a broken link, a leader that stalls mid-change.

Only a server started with ``MSDATA_TEST_FAULTS=1`` installs it (``install``); production paths carry no
test branches. Once installed, a ``fault`` peer frame (sent by a test that holds the cluster token) arms:

- ``drop_plans: n`` / ``drop_cuts: n``: the next n ``plan`` / ``mixcut`` frames to ``node`` are lost;
- ``close: true``: our link to ``node`` is closed;
- ``stall_mix: true``: a ``mixcut`` never leaves (the leader stalls with every node held, until killed);
- ``slow_reads: x`` (no ``node`` needed; ``source``: only that one): slow storage as the autoscaler sees it:
  the read seconds per sample this node reports to the leader are x times those measured (the leader splits).

A disk fault needs no frame: with ``MSDATA_TEST_DISK_FULL`` naming a flag file, writes to the state_dir fail
with ENOSPC while that file exists (``arm_disk``, called by ``statedir.StateStore``). Likewise
``MSDATA_TEST_SHM_FULL``: creating shared memory fails with ENOSPC while its flag file exists (``arm_shm``,
called by the node server at start), as a full ``/dev/shm`` does.

The cluster faults arm on the job layer's ``ClusterContext``: its RPC's ``send`` (every job-layer frame
leaves by it) and its autoscaler's ``report`` are wrapped; the ``fault`` frame handler is added to the layer's.
"""

from __future__ import annotations

import asyncio
import errno
import logging
import os
from collections.abc import Awaitable, Callable, MutableMapping
from typing import Any, Protocol

from .tasks import TaskSet

__all__ = ["DISK_FULL_ENV", "ENV", "SHM_FULL_ENV", "arm_disk", "arm_shm", "install"]

log = logging.getLogger(__name__)

ENV = "MSDATA_TEST_FAULTS"
DISK_FULL_ENV = "MSDATA_TEST_DISK_FULL"
SHM_FULL_ENV = "MSDATA_TEST_SHM_FULL"


Handler = Callable[[str, dict, memoryview | None], Awaitable[None]]


class _Rpc(Protocol):
    async def send(self, nid: str, frame: dict, payload: Any = None) -> None: ...


class _Scaler(Protocol):
    def report(self) -> dict: ...


class _Link(Protocol):
    async def aclose(self) -> None: ...


class FaultHost(Protocol):
    """What the cluster faults arm on: ``cluster.context.ClusterContext`` (not imported: the state store, which
    the cluster layer uses, arms its disk fault here)."""

    @property
    def node_id(self) -> str: ...

    @property
    def rpc(self) -> _Rpc: ...

    @property
    def tasks(self) -> TaskSet: ...

    @property
    def autoscaler(self) -> _Scaler | None: ...

    def link(self, nid: str) -> _Link | None: ...


class _Faults:
    def __init__(self, ctx: FaultHost) -> None:
        self.ctx = ctx
        self.node_id = ctx.node_id
        self.drop: dict[tuple[str, str], int] = {}  # (frame type, node) -> frames still to lose
        self.stall_mix = False
        self.slow_reads = 1.0
        self.slow_source: str | None = None  # None: every source
        self._send = ctx.rpc.send
        self._report: Callable[[], dict] | None = None
        scaler = ctx.autoscaler
        if scaler is not None:
            self._report = scaler.report
            scaler.report = self.report  # type: ignore[method-assign]  # fault injection wraps the method

    async def send(self, nid: str, frame: dict, payload: Any = None) -> None:
        t = frame.get("t", "")
        if self.drop.get((t, nid), 0) > 0:
            self.drop[(t, nid)] -= 1
            if t == "plan":
                log.warning(
                    "node %s: test fault: dropped the plan of step %s to %s", self.node_id, frame.get("step"), nid
                )
            else:
                log.warning("node %s: test fault: dropped a mixcut (cut %s) to %s", self.node_id, frame.get("cut"), nid)
            return
        if t == "mixcut" and self.stall_mix:
            log.warning("node %s: test fault: the mixture change stalls with every node held", self.node_id)
            await asyncio.Event().wait()
        await self._send(nid, frame, payload)

    def report(self) -> dict:
        """The autoscaler's report to the leader, its read seconds scaled by ``slow_reads``."""
        if self._report is None:
            raise RuntimeError("no autoscaler report to scale (the node has no worker pool)")
        rep = self._report()
        for name, fig in rep["sources"].items():
            if fig.get("read_s_per_sample") and self.slow_source in (None, name):
                fig["read_s_per_sample"] *= self.slow_reads
        return rep

    async def on_fault(self, peer: str, frame: dict, payload: memoryview | None) -> None:
        if "slow_reads" in frame:
            self.slow_reads, self.slow_source = float(frame["slow_reads"]), frame.get("source")
            log.warning(
                "node %s: test fault: read seconds of %s reported x %g",
                self.node_id,
                self.slow_source or "every source",
                self.slow_reads,
            )
            if "node" not in frame:
                return
        nid = str(frame["node"])
        self.drop[("plan", nid)] = int(frame.get("drop_plans", 0))
        self.drop[("mixcut", nid)] = int(frame.get("drop_cuts", 0))
        self.stall_mix = bool(frame.get("stall_mix", False))
        link = self.ctx.link(nid)
        if frame.get("close") and link is not None:
            self.ctx.tasks.spawn(link.aclose(), name="fault-close")
        log.warning(
            "node %s: test fault: next %d plan(s) to %s dropped%s",
            self.node_id,
            self.drop[("plan", nid)],
            nid,
            ", link closed" if frame.get("close") else "",
        )


def install(ctx: FaultHost, handlers: MutableMapping[str, Handler]) -> bool:
    """Arm fault injection on a node's job layer (its context, its frame handlers) when the environment asks
    for it; True if it did."""
    if os.environ.get(ENV) != "1":
        return False
    faults = _Faults(ctx)
    ctx.rpc.send = faults.send  # type: ignore[method-assign]  # every job-layer frame leaves by it
    handlers["fault"] = faults.on_fault
    log.warning("node %s: test fault injection is armed (%s=1); never set it in production", ctx.node_id, ENV)
    return True


def arm_disk(store) -> bool:
    """A state store's writes fail with ENOSPC while the flag file ``$MSDATA_TEST_DISK_FULL`` exists (with
    ``MSDATA_TEST_FAULTS=1``); True if armed."""
    flag = os.environ.get(DISK_FULL_ENV)
    if os.environ.get(ENV) != "1" or not flag:
        return False
    write = store.write

    def full(path: str, data: bytes) -> None:
        if os.path.exists(flag):
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), path)
        write(path, data)

    store.write = full
    log.warning("test fault: state_dir writes fail with ENOSPC while %s exists", flag)
    return True


def arm_shm(shm) -> bool:
    """Reserving shared memory (``shm.reserve``) fails with ENOSPC while the flag file ``$MSDATA_TEST_SHM_FULL``
    exists (with ``MSDATA_TEST_FAULTS=1``): /dev/shm full, mid-run, on demand; True if armed."""
    flag = os.environ.get(SHM_FULL_ENV)
    if os.environ.get(ENV) != "1" or not flag:
        return False
    reserve = shm.reserve

    def full(fd: int, size: int) -> None:
        if os.path.exists(flag):
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), "/dev/shm")
        reserve(fd, size)

    shm.reserve = full
    log.warning("test fault: shared memory cannot be reserved while %s exists", flag)
    return True
