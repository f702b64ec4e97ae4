"""The NodeServer: one per node. Owns the event loop's tasks, the local client endpoint, the transform
worker pool and every job; shuts down in stages (stop accepting, tell clients, close jobs and rings, stop
the pool) within a bounded time, and ``aclose()`` always releases shared memory even when that fails."""

from __future__ import annotations

import asyncio
import logging
import os
import time
from typing import TYPE_CHECKING, Protocol

from msdata_client.graph import JobSpec
from msdata_client.wire import PROTOCOL_VERSION

from .config import ServerConfig
from .endpoint import ClientConn, UnixEndpoint
from .errors import ConfigError, MsdataError, ProtocolError
from .job import Job, RankPosition
from .job.local import LocalStarter
from .job.rings import RingConfig
from .metrics import proc_memory, tree_memory
from .ops.prometheus import start_metrics_server
from .ops.sdnotify import Notifier
from .shm import cleanup
from .tasks import TaskSet

if TYPE_CHECKING:
    from .cluster.jobs import ClusterJobs
    from .cluster.runtime import ClusterNode
    from .pool import WorkerPool

__all__ = ["NodeServer"]

log = logging.getLogger(__name__)


class JobStarter(Protocol):
    """Who starts jobs: a ``LocalStarter`` on one node, the cluster job layer (``ClusterJobs``) in a cluster."""

    async def ranks_changed(self, job: Job) -> None:
        """A rank of this job came or went, or the job closed: start it (or report it) when its time comes."""
        ...


class NodeServer:
    """Hosts source loaders, constructors and (single node: always) the planner for several jobs at once."""

    def __init__(self, config: ServerConfig):
        self.config = config
        self.jobs: dict[str, Job] = {}
        self.pending: dict[str, Job] = {}  # a new run of a job whose previous run is still winding down
        self.tasks = TaskSet("node")
        self.endpoint = UnixEndpoint(config.node.socket, self._handle)
        self.pool: WorkerPool | None = None
        self.cluster: ClusterNode | None = None  # when node.toml has [cluster]
        self.cluster_jobs: ClusterJobs | None = None  # its job layer
        self._starter: JobStarter | None = None  # set by start()
        self.started = time.monotonic()
        self.ready = asyncio.Event()
        self.notifier = Notifier()  # systemd: READY, WATCHDOG from this loop, STOPPING (no-ops without systemd)
        self.metrics_server: asyncio.Server | None = None
        self.metrics_port: int | None = None
        self._stopping = asyncio.Event()
        self.failure: BaseException | None = None  # set by fatal(): the CLI exits non-zero
        self._closed = False

    @property
    def starter(self) -> JobStarter:
        """Who starts jobs here (set by ``start()``, before the first client can register one)."""
        if self._starter is None:
            raise RuntimeError("the node server has no job starter yet; call start() first")
        return self._starter

    @property
    def role(self) -> str:
        return self.cluster.role if self.cluster is not None else self.config.role

    async def start(self) -> None:
        """Clean up after a previous instance, bind the socket, start the pool and the accept loop."""
        cfg = self.config.node
        removed, _ = cleanup(prefix=cfg.shm_prefix)
        if removed:
            log.warning("removed %d stale shared-memory segment(s) of a previous server: %s", len(removed), removed)
        self.endpoint.bind()
        if cfg.workers > 0:
            from .pool import WorkerPool

            self.pool = WorkerPool(cfg.workers, shm_prefix=cfg.shm_prefix)
            await self.pool.start()
        if self.config.cluster is not None:
            from .cluster.jobs import ClusterJobs
            from .cluster.runtime import ClusterNode

            self.cluster = ClusterNode(self.config, on_fatal=self.fatal)
            await self.cluster.start()
            self.cluster_jobs = self._starter = ClusterJobs(self)
            await self.cluster_jobs.start()
        else:
            self._starter = LocalStarter(pool=self.pool, state_dir=cfg.state_path, ring_slots=cfg.ring_slots)
        self.tasks.spawn(self.endpoint.serve(self.tasks), name="accept")
        if cfg.metrics:  # a bad address or a port in use is a ConfigError (the CLI prints it)
            self.metrics_server, self.metrics_port = await start_metrics_server(cfg.metrics, self.status)
        self.tasks.spawn(self.notifier.watchdog_loop(), name="sd-watchdog")
        self.notifier.ready(f"serving on {cfg.socket} (role {self.role})")
        self.ready.set()
        log.info("node %s serving on %s (role %s, %d workers)", cfg.id, cfg.socket, self.role, cfg.workers)

    async def serve_forever(self) -> None:
        await self._stopping.wait()

    def request_stop(self) -> None:
        self._stopping.set()

    def fatal(self, exc: BaseException) -> None:
        """This server cannot go on consistently (a role change failed half-way): stop, and exit non-zero so
        that the supervisor (systemd, the DaemonSet) starts it again clean."""
        log.critical("node %s stops after a fatal error: %r", self.config.node.id, exc)
        self.failure = exc
        self._stopping.set()

    # ---- clients ---------------------------------------------------------------------------------------
    async def _handle(self, conn: ClientConn) -> None:
        try:
            async for frame in conn.frames():
                await self._dispatch(conn, frame)
        except ProtocolError as e:
            log.warning("%r sent a malformed frame: %s", conn, e)
            conn.send({"t": "error", "kind": "ProtocolError", "message": str(e)})
        except MsdataError as e:
            conn.send({"t": "error", "kind": type(e).__name__, "message": str(e)})
        finally:
            job = conn.job
            if job is not None:
                job.detach(conn)
                await self.starter.ranks_changed(job)
                if job.ranks.connected == 0 and self.jobs.get(job.name) is job:
                    log.info("job %s: every rank left; closing it", job.name)
                    self.forget(job)
                    nxt = self.pending.pop(job.name, None)
                    if nxt is not None:
                        self.jobs[job.name] = nxt
                    await job.aclose()
                    if nxt is not None:
                        nxt.may_start.set()
                elif job.ranks.connected == 0 and self.pending.get(job.name) is job:
                    del self.pending[job.name]
                    await job.aclose()

    async def _dispatch(self, conn: ClientConn, frame: dict) -> None:
        t = frame["t"]
        if t == "release":
            job = conn.job
            if job is None:
                raise ProtocolError("release before hello")
            for ring, slot in frame.get("s", ()):
                job.release(conn, int(ring), int(slot))
            if frame.get("w"):  # how long each next() of this rank waited (ops.waits; ProtocolError if malformed)
                job.waits.record(conn.rank, frame["w"], step=frame.get("step"))
        elif t == "hello":
            await self._hello(conn, frame)
        elif t in ("state", "mixture"):
            job = conn.job
            if job is None:
                raise ProtocolError(f"{t} request before hello")
            job.tasks.spawn(self._request(conn, job, frame), name=f"{t}-request")
        elif t == "status":
            conn.send({"t": "status", "status": self.status()})
        elif t == "ping":
            conn.send({"t": "pong"})
        elif t == "bye":
            conn.close()
        else:
            raise ProtocolError(f"unknown frame type {t!r}")

    async def _hello(self, conn: ClientConn, frame: dict) -> None:
        """Register a rank: check the frame, then pick the job it joins (the running one, a pending next run,
        or a new one) and hand it to the starter. Long because the job-identity cases read best as one rule."""
        if conn.job is not None:
            raise ProtocolError("hello sent twice on one connection")
        v = frame.get("v")
        if v != PROTOCOL_VERSION:
            raise ProtocolError(
                f"client speaks protocol {v!r}, this server {PROTOCOL_VERSION}; upgrade msdata on one side"
            )
        try:
            spec = JobSpec.from_dict(frame["job"])
            rank, world = int(frame["rank"]), int(frame["world_size"])
            pos = frame.get("position") or {}
            position = RankPosition(int(pos.get("step", 0)), int(pos.get("micro", 0)))
            state = frame.get("state")
            resume = bool(frame.get("resume", False))
        except (KeyError, TypeError, ValueError) as e:
            if isinstance(e, ConfigError):
                raise
            raise ProtocolError(f"malformed hello: {e!r}") from None
        digest = spec.digest()
        if frame.get("digest") != digest:
            raise ConfigError(
                f"job digest mismatch: client {frame.get('digest')!r}, server {digest!r} "
                "(client and server msdata versions differ?)"
            )
        job = self.jobs.get(spec.name)
        if job is not None and job.digest != digest:
            live = job.ranks.live_ranks()
            if live:
                raise ConfigError(
                    f"job {spec.name!r} is running here with another definition "
                    f"(digest {job.digest[:12]}, yours {digest[:12]}) and {len(live)} rank(s) connected; "
                    "every rank must register the same job: stop the old run or give the new job "
                    "another name"
                )
            self.forget(job)
            await job.aclose()
            job = None
        if job is not None and job.state == "running" and not resume:
            # a new run of this job (it brings a state or none): never join the old run's stream
            live = job.ranks.live_ranks()
            if rank in live:
                job.ranks.check_rank(rank, world)  # the same rank of the old run is still there: refuse clearly
            if not live:
                self.forget(job)
                await job.aclose()
                job = None
            else:
                nxt = self.pending.get(spec.name)
                if nxt is None or nxt.digest != digest:
                    nxt = self.pending[spec.name] = self._new_job(spec, digest, hold=True)
                    log.warning(
                        "job %s: a new run registers while %d rank(s) of the previous run are still "
                        "connected; it starts when they leave",
                        spec.name,
                        len(job.ranks.live_ranks()),
                    )
                job = nxt
        if job is None:
            job = self.jobs[spec.name] = self._new_job(spec, digest)
            log.info("job %s registered (digest %s, %d ranks)", spec.name, digest[:12], spec.mesh.world_size)
        job.ranks.check_rank(rank, world)
        job.ranks.check_state(state)
        await job.attach(conn, rank, position, state=state, resume=resume)
        if job.state == "waiting":
            await self.starter.ranks_changed(job)

    def _new_job(self, spec: JobSpec, digest: str, hold: bool = False) -> Job:
        cfg = self.config.node
        rings = RingConfig(prefix=cfg.shm_prefix, slots=cfg.ring_slots, max_slot_mib=cfg.max_slot_mib)
        return Job(spec, digest, node_id=cfg.id, rings=rings, forget=self.forget, hold=hold)

    async def _request(self, conn: ClientConn, job: Job, frame: dict) -> None:
        """Answer a rank's state or mixture request; a refusal goes back to that rank only."""
        t, rid = frame["t"], frame.get("id")
        try:
            if t == "state":
                step = int(frame["step"])
                conn.send(
                    {
                        "t": "state",
                        "id": rid,
                        "step": step,
                        "planner": await job.state_at(step),
                        "layout": job.spec.layout(),
                    }
                )
            else:
                weights = frame.get("weights")
                if not isinstance(weights, dict):
                    raise ConfigError(f"set_mixture weights must be a mapping of source -> weight, got {weights!r}")
                conn.send({"t": "mixture", "id": rid, "step": await job.set_mixture(weights)})
        except (MsdataError, KeyError, TypeError, ValueError) as e:
            conn.send({"t": "refused", "id": rid, "kind": type(e).__name__, "message": str(e)})

    def forget(self, job: Job) -> None:
        """A job closes: it no longer takes ranks (the starter hears of it: a cluster reports it)."""
        if self.jobs.get(job.name) is job:
            del self.jobs[job.name]
        self.tasks.spawn(self.starter.ranks_changed(job), name=f"forget-{job.name}")

    # ---- status ----------------------------------------------------------------------------------------
    def status(self) -> dict:
        cfg = self.config.node
        pids = [os.getpid()] + (self.pool.pids() + self.pool.helper_pids() if self.pool is not None else [])
        mem = tree_memory(pids)
        return {
            "node": cfg.id,
            "role": self.role,
            "pid": os.getpid(),
            "socket": cfg.socket,
            "uptime_s": round(time.monotonic() - self.started, 3),
            "workers": self.pool.size if self.pool is not None else 0,
            "memory": {"server_pss": proc_memory()["pss"], "total_pss": mem["pss"], "total_uss": mem["uss"]},
            "jobs": [j.status() for j in self.jobs.values()],
            **(
                {"cluster": {**self.cluster.status(), "runs": self.cluster_jobs.status() if self.cluster_jobs else []}}
                if self.cluster is not None
                else {}
            ),
        }

    # ---- shutdown --------------------------------------------------------------------------------------
    async def aclose(self) -> None:
        """Stop accepting, tell clients, close jobs (rings unlinked), stop the pool. Idempotent."""
        if self._closed:
            return
        self._closed = True
        self.notifier.stopping()
        if self.metrics_server is not None:
            self.metrics_server.close()
        timeout = self.config.node.drain_timeout
        self.endpoint.close()
        for conn in list(self.endpoint.conns):
            conn.send({"t": "shutdown", "message": "the node server is shutting down"})
        try:
            async with asyncio.timeout(timeout):
                for job in list(self.jobs.values()) + list(self.pending.values()):
                    await job.aclose()
        except TimeoutError:
            log.warning("jobs did not close within %.1fs", timeout)
        finally:
            for job in list(self.jobs.values()):
                job.close_rings()  # whatever happened above, never leave shared memory behind
            self.jobs.clear()
            self.pending.clear()
            for conn in list(self.endpoint.conns):
                conn.close()
            await self.tasks.cancel_all("node shutting down", timeout=timeout)
            if self.cluster_jobs is not None:
                try:
                    await asyncio.wait_for(self.cluster_jobs.aclose(), timeout)
                except (TimeoutError, MsdataError, OSError) as e:
                    log.warning("closing the cluster job layer did not finish cleanly: %s", e)
            if self.cluster is not None:
                try:
                    await asyncio.wait_for(self.cluster.aclose(), timeout)
                except (TimeoutError, MsdataError, OSError) as e:
                    log.warning("leaving the cluster did not finish cleanly: %s", e)
            if self.pool is not None:
                await self.pool.aclose()
            if self.metrics_server is not None:
                await self.metrics_server.wait_closed()
            self.notifier.close()
        log.info("node %s stopped", self.config.node.id)
