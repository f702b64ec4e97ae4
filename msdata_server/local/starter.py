"""A single node's job starter: the start barrier and start point of a job here (every rank registered here),
its loaders, and its plan feed (``feed.py``).
"""

from __future__ import annotations

import asyncio
import logging
import os
from concurrent.futures import ThreadPoolExecutor
from typing import TYPE_CHECKING, Any

from msdata_client.spec import JobSpec

from ..checkpoint import Carried, StateStore, carried_start, start_point
from ..datachange import data_start
from ..job import Job
from ..job.images import source_transform
from ..lineage.skip import skip_ahead
from ..loader import SourceLoader
from ..planner import Planner
from ..planner.spec import planner_config
from ..planner.state import K_LISTING
from ..sources import open_source
from ..statedir import ListingManifests
from .feed import LocalPlanFeed
from .payloads import LocalPayloads

if TYPE_CHECKING:
    from ..pool import WorkerPool

__all__ = ["LocalStarter"]

log = logging.getLogger(__name__)


class LocalStarter:
    """Starts jobs on one node: when every rank of a job's mesh registered here, from the start point the
    ranks and the node's checkpoints give (``checkpoint.start_point``)."""

    def __init__(self, *, pool: WorkerPool | None, state_dir: str, ring_slots: int):
        self.pool = pool
        self.state_dir = state_dir
        self.ring_slots = ring_slots

    async def ranks_changed(self, job: Job) -> None:
        if job.state != "waiting" or not job.ranks.complete():
            return
        await job.may_start.wait()
        await job.start_with(lambda: self._prepare(job))

    async def _prepare(self, job: Job) -> tuple[LocalPlanFeed, LocalPayloads, dict]:
        spec = job.spec
        store = StateStore(self.state_dir, spec.name, job.digest)
        job.saving = store  # status says so while it cannot be written (planning waits for it)
        starts = job.ranks.starts()
        sp = start_point(starts, spec.layout())
        if sp.clear:
            store.clear()  # a new run (or one from the ranks' states): what the node remembers does not apply
        state, skip, defer = sp.planner, sp.skip, sp.defer
        carried: Carried | None = None
        if sp.load_at is not None:
            found = store.load_at_or_before(sp.load_at)
            if found is not None:
                log.info(
                    "job %s: continuing from the node's checkpoint of step %d (ranks at step %d)",
                    spec.name,
                    found[0],
                    sp.load_at,
                )
                state = found[1]
            elif (carried := carried_start(starts, sp.load_at)) is not None:
                state, skip, defer = carried.planner, carried.skip, carried.defer
                log.info(
                    "job %s: no checkpoint at or before step %d here; continuing from the state the ranks carry "
                    "(step %s, %d later mixture change(s))",
                    spec.name,
                    sp.load_at,
                    state["step"] if state is not None else 0,
                    len(carried.overrides),
                )
            else:
                log.warning(
                    "job %s: no checkpoint at or before step %d; replaying from the beginning", spec.name, sp.load_at
                )
        planner = Planner(planner_config(spec), state=state)  # a state that does not fit fails before any I/O
        # the files each source lists now against those the state was planned over (datachange.py)
        listing = await data_start(spec, state, ListingManifests(self.state_dir))
        if state is not None:  # skip_ahead plans from the state: it carries the listing on
            state = {**state, K_LISTING: listing.to_dict()}
        if skip:  # loader.skip: plan the skipped steps, deliver from the step after them
            state, skipped = await skip_ahead(spec, state, skip, self.pool, defer=defer)
            for step, st in skipped.items():
                await store.persist(step, st)  # lineage replays the skipped steps from these
            planner = Planner(planner_config(spec), state=state)
            log.info("job %s: skipped steps %d..%d (loader.skip)", spec.name, planner.step - skip, planner.step - 1)
        planner.set_listing(listing)  # a new run (or one after a skip) records the files it plans over too
        if carried is not None:  # set_mixture calls the ranks' carried state records after its step
            for at, weights in carried.overrides:
                if at >= planner.step:
                    planner.set_mixture(at, weights)
            state = planner.state_dict()
        loaders = await self._open_loaders(spec, state)
        job.source_sizes = {ld.name: ld.source.num_samples for ld in loaders}  # status: epochs completed
        payloads = LocalPayloads(loaders)
        keep = max(64, spec.prefetch_steps + self.ring_slots + 4)
        return LocalPlanFeed(planner, store, payloads, keep=keep, name=spec.name), payloads, sp.positions

    async def _open_loaders(self, spec: JobSpec, state: dict | None) -> list[SourceLoader]:
        # sources open in threads: opening many files must not stall the loop
        sources = await asyncio.to_thread(open_sources, spec)
        loaders = [
            SourceLoader(src, self.pool, transform=source_transform(spec, s), seed=spec.seed)
            for src, s in zip(sources, spec.sources)
        ]
        cursor = (state or {}).get("cursor") or [0] * len(loaders)
        for ld, at in zip(loaders, cursor):
            ld.seek(int(at))  # a resumed job reads on from its position (carried pieces: on demand)
            await ld.start()
        return loaders


def open_sources(spec: JobSpec) -> list[Any]:
    """Every source of a job opened (files listed, indexed), in order; several at once when there are many (1,024
    sources of 16 Parquet files: 16,384 footers, whose parsing leaves the GIL). If one fails, those opened are
    closed and its error raised."""

    def one(s: Any) -> Any:
        return open_source(s, seed=spec.seed, on_read_error=spec.on_read_error)

    threads = min(4, os.cpu_count() or 1, max(1, len(spec.sources) // 16))
    if threads == 1:
        return [one(s) for s in spec.sources]
    with ThreadPoolExecutor(threads, thread_name_prefix="msdata-open") as ex:
        futures = [ex.submit(one, s) for s in spec.sources]
    out, error = [], None
    for f in futures:
        try:
            out.append(f.result())
        except BaseException as e:
            error = error or e
    if error is not None:
        for src in out:
            src.close()
        raise error
    return out
