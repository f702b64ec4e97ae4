"""The server's answer to a ``lineage`` request on its Unix socket: replay from the job's saved states.

The job's plan feed holds a planner state for every recent step (memory) and the node's stored ones (state_dir
on one node); the replay starts from the newest at or before the first step asked for, so a recent step costs
one plan. Refusals go back as ``refused`` frames, like a rank's state or mixture request.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping

from ..errors import ConfigError, MsdataError
from ..planner.spec import planner_config
from .data import DataView
from .query import Query, answer

__all__ = ["job_lineage", "job_states", "serve_lineage", "target"]

log = logging.getLogger(__name__)


def job_states(job, query: Query) -> tuple[dict | None, dict[int, dict], list[list[int]]]:
    """What a replay of ``query``'s steps starts from on this node: the base state (None: the beginning), the
    later states held, and the skipped step ranges; ConfigError when the node cannot replay them."""
    feed = job.feed
    if feed is None:
        raise ConfigError(
            f"job {job.name!r} has not started here (its ranks are still registering); give --job the job's "
            "TOML file to replay offline"
        )
    found, held = feed.saved_states(query.start, query.stop)
    base = found[1] if found is not None else None
    if found is None and feed.start_step > 0:
        raise ConfigError(
            f"the server holds no planner state at or before step {query.start} of job {job.name!r}; replay "
            "offline from an earlier trainer checkpoint (--job job.toml --state FILE)"
        )
    newest = feed.newest_state() or base or {}
    return base, held, [list(r) for r in newest.get("skips", [])]


async def job_lineage(job, query: Query, pool) -> dict:
    """Lineage of a running (or finished but still registered) job on this node."""
    base, held, skips = job_states(job, query)
    data = await DataView.open(job.spec, pool, vision=planner_config(job.spec).vlm_cost is not None)
    try:
        return await answer(job.spec, query, data, base=base, held=held, skips=skips)
    finally:
        await data.aclose()


async def serve_lineage(conn, frame: Mapping, jobs: Mapping, pool) -> None:
    """Answer one ``lineage`` frame on ``conn`` (``jobs``: the node's jobs by name)."""
    rid = frame.get("id")
    try:
        job, query = target(frame, jobs)
        conn.send({"t": "lineage", "id": rid, **await job_lineage(job, query, pool)})
    except (MsdataError, KeyError, TypeError, ValueError) as e:
        log.info("lineage request refused: %s", e)
        conn.send({"t": "refused", "id": rid, "kind": type(e).__name__, "message": str(e)})


def target(frame: Mapping, jobs: Mapping, *, rank_required: bool = False):
    """The job and Query a ``lineage`` or ``replay`` frame names (a rank: its data group); ConfigError."""
    name = frame.get("job")
    job = jobs.get(name)
    if job is None:
        raise ConfigError(f"no job {name!r} on this server (jobs: {sorted(jobs)}); give --job a job TOML to "
                          "replay offline")  # fmt: skip
    rank, world = frame.get("rank"), job.spec.mesh.world_size
    if rank is None and rank_required:
        raise ConfigError(f"replay needs the rank whose micro-batches to send (0..{world - 1})")
    group = None
    if rank is not None:
        if isinstance(rank, bool) or not isinstance(rank, int) or not 0 <= rank < world:
            raise ConfigError(f"rank={rank!r} is outside job {name!r}'s {world} ranks")
        group = job.spec.group_of(rank)
    return job, Query.from_frame({**frame, "group": group})
