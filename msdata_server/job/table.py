"""A node's jobs by name, and the one rule of which job a registering rank joins.

A rank's hello names a job spec. It joins the job of that name that is running or waiting here, or a
*pending* next run (registered while ranks of the previous run are still connected; it starts when they
leave), or a new job. A job closes once no rank is connected or expected back; its pending successor then
takes its place. Both the single-node and the cluster starter see every change (``ranks_changed``).
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Protocol

from msdata_client.graph import JobSpec

from ..errors import ConfigError
from .job import Job

__all__ = ["JobStarter", "JobTable"]

log = logging.getLogger(__name__)


class JobStarter(Protocol):
    """Who starts jobs: a ``LocalStarter`` on one node, the cluster job layer (``ClusterJobs``) in a cluster."""

    async def ranks_changed(self, job: Job) -> None:
        """A rank of this job came or went, or the job closed: start it (or report it) when its time comes."""
        ...


class JobTable:
    """The jobs of one node: ``jobs`` (by name: running or waiting for its ranks) and ``pending`` (by name: a
    new run of a job whose previous run is still winding down). ``make(spec, digest, hold)`` builds a job;
    ``starter()`` is who hears of rank changes; ``spawn(coro, name)`` runs a task owned by the node."""

    def __init__(
        self, make: Callable[[JobSpec, str, bool], Job], starter: Callable[[], JobStarter], spawn: Callable[..., object]
    ):
        self.jobs: dict[str, Job] = {}
        self.pending: dict[str, Job] = {}
        self._make = make
        self._starter = starter
        self._spawn = spawn

    async def join(self, spec: JobSpec, digest: str, rank: int, world: int, *, resume: bool) -> Job:
        """The job a rank of ``spec`` registers with (ConfigError when another definition of it is running)."""
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
            await job.aclose(why="a new run of the job registered")
            job = None
        if job is not None and job.state == "running" and not resume:
            # a new run of this job (it brings a state or none): never join the old run's stream
            live = job.ranks.live_ranks()
            if rank in live:
                job.ranks.check_rank(rank, world)  # the same rank of the old run is still there: refuse clearly
            if not live:
                self.forget(job)
                await job.aclose(why="a new run of the job registered")
                job = self.jobs.get(spec.name)  # another rank of the new run may have registered it meanwhile
                if job is not None and (job.digest != digest or job.state != "waiting"):
                    job = None
            else:
                nxt = self.pending.get(spec.name)
                if nxt is None or nxt.digest != digest:
                    nxt = self.pending[spec.name] = self._make(spec, digest, True)
                    log.warning(
                        "job %s: a new run registers while %d rank(s) of the previous run are still "
                        "connected; it starts when they leave",
                        spec.name,
                        len(live),
                    )
                job = nxt
        if job is None:
            job = self.jobs[spec.name] = self._make(spec, digest, False)
            log.info("job %s registered (digest %s, %d ranks)", spec.name, digest[:12], spec.mesh.world_size)
        return job

    async def left(self, job: Job) -> None:
        """A rank left: close the job once no rank is connected or expected back (``ranks.away``)."""
        if job.ranks.connected or job.ranks.away:
            return
        if self.jobs.get(job.name) is job:
            log.info("job %s: every rank left; closing it", job.name)
            self.forget(job)
            nxt = self.pending.pop(job.name, None)
            if nxt is not None:
                self.jobs[job.name] = nxt
            await job.aclose(why="every rank left")
            if nxt is not None:
                nxt.may_start.set()
        elif self.pending.get(job.name) is job:
            del self.pending[job.name]
            await job.aclose(why="every rank left")

    def forget(self, job: Job) -> None:
        """A job closes: it no longer takes ranks (the starter hears of it: a cluster reports it)."""
        if self.jobs.get(job.name) is job:
            del self.jobs[job.name]
        self._spawn(self._starter().ranks_changed(job), name=f"forget-{job.name}")
