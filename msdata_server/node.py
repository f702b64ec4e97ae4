"""The NodeServer: one per node. Owns the event loop's tasks, the local client endpoint, the transform
worker pool and every job; shuts down in stages (stop accepting, tell clients, close jobs and rings, stop
the pool) within a bounded time, and ``aclose()`` always releases shared memory even when that fails."""

from __future__ import annotations

import asyncio
import logging
import os
import time
from typing import TYPE_CHECKING

from msdata_client.graph import JobSpec
from msdata_client.wire import PROTOCOL_VERSION

from . import faults, shm
from .admission import Admission
from .config import ServerConfig
from .endpoint import ClientConn, ClientLimits, UnixEndpoint
from .errors import ClosedError, ConfigError, MsdataError, ProtocolError
from .job import Job, RankPosition
from .job.rings import RingConfig
from .job.table import JobStarter, JobTable
from .loader.budget import node_budget
from .local.starter import LocalStarter
from .ops.memory import node_sources_memory, proc_memory, tree_memory
from .ops.prometheus import start_metrics_server
from .ops.sdnotify import Notifier
from .shm import cleanup
from .sources.handles import node_handles
from .statedir import probe
from .storage import configure as configure_storage
from .tasks import TaskSet
from .transforms import MAX_IMAGE_PIXELS_ENV

if TYPE_CHECKING:
    from .autoscale import Autoscaler
    from .cluster.jobs import ClusterJobs
    from .cluster.net.runtime import ClusterNode
    from .pool import WorkerPool

__all__ = ["NodeServer"]

log = logging.getLogger(__name__)


class NodeServer:
    """Hosts source loaders, constructors and (single node: always) the planner for several jobs at once."""

    def __init__(self, config: ServerConfig):
        self.config = config
        self.tasks = TaskSet("node")
        self.table = JobTable(self._new_job, lambda: self.starter, self.tasks.spawn)
        self.jobs = self.table.jobs  # by name; the same dicts as the table's
        self.pending = self.table.pending  # a new run of a job whose previous run is still winding down
        self.endpoint = UnixEndpoint(config.node.socket, self._handle, ClientLimits.of(config.node))
        self.admission = Admission(config.node)  # [node] allow_transforms and data_roots
        self.storage = configure_storage(
            config.storage, config.node.state_path
        )  # [storage]: sources in object storage, node-wide
        self.pool: WorkerPool | None = None
        self.autoscaler: Autoscaler | None = None  # with a pool: sizes it and shares it out ([autoscale])
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
        faults.arm_shm(shm)  # tests only: a no-op unless their fault switch is on (faults.py)
        removed, _ = cleanup(prefix=cfg.shm_prefix)
        if removed:
            log.warning("removed %d stale shared-memory segment(s) of a previous server: %s", len(removed), removed)
        self.endpoint.bind()
        os.environ[MAX_IMAGE_PIXELS_ENV] = str(cfg.max_image_pixels)  # transforms here and in workers read it
        node_budget().configure(cfg.readahead_samples, cfg.readahead_mib << 20)  # shared by every loader here
        node_handles().limit = cfg.open_files
        if cfg.workers > 0:
            from .autoscale import Autoscaler
            from .autoscale.controller import initial_size
            from .pool import WorkerPool

            size = initial_size(self.config.autoscale, cfg.workers)
            self.pool = WorkerPool(size, shm_prefix=cfg.shm_prefix)
            await self.pool.start()
            self.autoscaler = Autoscaler(
                self.pool,
                self.config.autoscale,
                lambda: list(self.jobs.values()),
                cluster=self.config.cluster is not None,  # a cluster: it follows the leader's targets
            )
            self.tasks.spawn(self.autoscaler.run(), name="autoscale")
        if self.config.cluster is not None:
            from .cluster.jobs import ClusterJobs
            from .cluster.leader.coordinator import Coordinator
            from .cluster.net.runtime import ClusterNode

            self.cluster = ClusterNode(self.config, on_fatal=self.fatal)
            await self._unless_stopped(self.cluster.start())  # waits while etcd is unreachable
            self.cluster_jobs = self._starter = ClusterJobs(
                self.cluster,
                self.config,
                table=self.table,
                leader=Coordinator,
                pool=self.pool,
                autoscaler=self.autoscaler,
            )
            if self.autoscaler is not None:  # profile to the leader with each decision; its targets back
                self.autoscaler.on_step.append(self.cluster_jobs.reports.changed)
                self.cluster_jobs.handlers["scale"] = self._follow_targets
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

    async def _follow_targets(self, peer: str, frame: dict, payload) -> None:
        """A ``scale`` frame from the leader (the runtime's fence dropped it if its token is stale)."""
        if self.autoscaler is not None:
            self.autoscaler.follow(frame)

    async def _unless_stopped(self, coro) -> None:
        """Await ``coro``, unless a stop is requested first (SIGTERM while etcd is unreachable): ClosedError."""
        task = asyncio.ensure_future(coro)
        stop = asyncio.ensure_future(self._stopping.wait())
        try:
            await asyncio.wait({task, stop}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            stop.cancel()
        if not task.done():
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)
            raise ClosedError("stopped before the server could join the cluster (etcd did not answer)")
        task.result()

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
            conn.refuse("ProtocolError", str(e))
        except MsdataError as e:
            log.warning("%r refused: %s", conn, e)
            conn.refuse(type(e).__name__, str(e))
        finally:
            job = conn.job
            if job is not None:
                job.detach(conn)
                await self.starter.ranks_changed(job)
                await self.table.left(job)

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
        elif t in ("lineage", "replay"):  # msdata-server lineage, loader.lineage(), DataClient(replay=): replays
            from .lineage.window import serve

            self.tasks.spawn(serve(conn, frame, self.jobs, self.pool), name=f"{t}-request")
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
            client, held = frame.get("client"), frame.get("held", [])  # one DataClient across its reconnects
            latest = frame.get("latest") if resume else None  # the newest state a reconnecting rank carries
        except (KeyError, TypeError, ValueError, AttributeError) as e:
            if isinstance(e, ConfigError):
                raise
            raise ProtocolError(f"malformed hello: {e!r}") from None
        digest = spec.digest()
        if frame.get("digest") != digest:
            raise ConfigError(
                f"job digest mismatch: client {frame.get('digest')!r}, server {digest!r} "
                "(client and server msdata versions differ?)"
            )
        await self.admission.check(spec, digest)  # before anything of the job is imported or opened
        job = await self.table.join(spec, digest, rank, world, resume=resume)
        job.ranks.check_rank(rank, world, client)
        job.ranks.check_state(state)
        job.ranks.check_state(latest)
        await job.attach(conn, rank, position, state=state, resume=resume, client=client, held=held, latest=latest)
        if job.state == "waiting":
            await self.starter.ranks_changed(job)

    def _new_job(self, spec: JobSpec, digest: str, hold: bool = False) -> Job:
        cfg = self.config.node
        rings = RingConfig(prefix=cfg.shm_prefix, slots=cfg.ring_slots, max_slot_mib=cfg.max_slot_mib)
        job = Job(
            spec,
            digest,
            node_id=cfg.id,
            rings=rings,
            forget=self.table.forget,
            hold=hold,
            reconnect_grace=cfg.reconnect_grace,
            on_idle=lambda j: self.tasks.spawn(self.table.left(j), name=f"left-{j.name}"),
        )
        if self.autoscaler is not None:
            job.mixture_listeners.append(self.autoscaler.mixture_changed)
        return job

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

    # ---- status ----------------------------------------------------------------------------------------
    def status(self) -> dict:
        cfg = self.config.node
        pids = [os.getpid()] + (self.pool.pids() + self.pool.helper_pids() if self.pool is not None else [])
        mem = tree_memory(pids)
        jobs = [j.status() for j in self.jobs.values()]
        return {
            "node": cfg.id,
            "role": self.role,
            "pid": os.getpid(),
            "socket": cfg.socket,
            "uptime_s": round(time.monotonic() - self.started, 3),
            "workers": self.pool.size if self.pool is not None else 0,
            "autoscale": self.autoscaler.status() if self.autoscaler is not None else {"enabled": False, "sources": {}},
            "memory": {
                "server_pss": proc_memory()["pss"],
                "total_pss": mem["pss"],
                "total_uss": mem["uss"],
                **node_sources_memory(jobs),
            },
            "jobs": jobs,
            "state_dir": self._state_dir_status(),
            "storage": self.storage.stats.snapshot(),  # node-wide, cumulative since the server started
            **(
                {"cluster": {**self.cluster.status(), "runs": self.cluster_jobs.status() if self.cluster_jobs else []}}
                if self.cluster is not None
                else {}
            ),
        }

    def _state_dir_status(self) -> dict:
        """Where planner states are saved here and why they cannot be now (None: they can); a cluster keeps
        them in etcd. ``health`` fails while ``error`` is set: a job that starts would wait for it."""
        if self.config.cluster is not None:
            return {"path": None, "error": None}
        path = self.config.node.state_path
        failing = [j.saving.failing for j in self.jobs.values() if j.saving is not None and j.saving.failing]
        return {"path": path, "error": failing[0] if failing else probe(path)}

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
                    await job.aclose(why="the server is shutting down")
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
