"""The data-change rule at a run's start (both modes): the files each source lists now against the listings the
planner state was planned over (``planner.listings``), before any batch.

Unchanged files (or a state saved before listings were kept): the run goes on as before. Changed files: with
``[job] on_data_change = "error"`` (the default) a CheckpointError names the source, what changed and the fix;
with ``"continue"`` the run goes on from the saved position over the new files (each source's cursor, the
absolute ordinal epoch * num_samples + pos, is kept and located in the new file order) and the state records
the change (the step it took effect and the new digest) for lineage.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable, Mapping, Sequence

from msdata_client.spec import JobSpec

from .errors import CheckpointError
from .planner.listings import Listings
from .planner.state import K_LISTING, K_STEP
from .sources import Listing, list_source
from .sources.listing import describe_change
from .statedir import ListingManifests

__all__ = ["check_listings", "data_start", "listings_now"]

log = logging.getLogger(__name__)


def listings_now(spec: JobSpec) -> tuple[list[Listing | None], Listings]:
    """Every source's listing now (None: a source without files) and their digests and counts (blocking I/O:
    one stat per file)."""
    found = [list_source(s) for s in spec.sources]
    return found, Listings(
        digests=tuple(x.digest if x is not None else "" for x in found),
        files=tuple(x.files if x is not None else 0 for x in found),
    )


def check_listings(
    spec: JobSpec,
    state: Mapping | None,
    now: Listings,
    new: Sequence[Listing | None],
    old_manifest: Callable[[str], Listing | None],
) -> Listings:
    """The listings to plan on with from ``state`` (None: a new run) given the files ``now``; CheckpointError
    when they changed and the job says ``on_data_change = "error"``."""
    if state is None:
        return now
    names = spec.source_names()
    if K_LISTING not in state:
        log.info(
            "job %s: the state of step %s was saved before file listings were kept; its files are not checked",
            spec.name,
            state.get(K_STEP),
        )
        return now
    saved = Listings.from_dict(state[K_LISTING], len(names))
    changed = saved.differing(now)
    if not changed:
        return Listings(digests=now.digests, files=now.files, changes=saved.changes)
    what = "; ".join(_describe(names[i], saved, i, new[i], old_manifest) for i in changed)
    step = int(state[K_STEP])
    if spec.on_data_change == "error":
        raise CheckpointError(
            f"job {spec.name!r}: the files changed since the state of step {step} was saved: {what}. Restore the "
            'files, or set [job] on_data_change = "continue" to go on from the saved position over the new files '
            "(the rows of earlier steps then refer to the old file list)"
        )
    log.warning(
        "job %s: the files changed since the state of step %d was saved: %s; going on from the saved position over "
        'the new files ([job] on_data_change = "continue")',
        spec.name,
        step,
        what,
    )
    return saved.went_on(now, step, names)


def _describe(name: str, saved: Listings, i: int, new: Listing | None, old_manifest: Callable) -> str:
    if new is None:
        return f"source {name!r}: it was saved with {saved.files[i]} files and now reads none"
    old = old_manifest(saved.digests[i]) if saved.digests[i] else None
    return describe_change(name, old, new, old_digest=saved.digests[i] or "none", old_files=saved.files[i])


async def data_start(spec: JobSpec, state: Mapping | None, manifests: ListingManifests | None) -> Listings:
    """``check_listings`` with the files listed now (in a thread), keeping their manifests in ``manifests``."""

    def run() -> Listings:
        new, now = listings_now(spec)
        if manifests is not None:
            for x in new:
                if x is not None:
                    manifests.save(x.to_manifest())

        def old(digest: str) -> Listing | None:
            raw = manifests.load(digest) if manifests is not None else None
            try:
                return Listing.from_manifest(raw) if raw is not None else None
            except (ValueError, TypeError, KeyError) as e:
                log.warning("ignoring the file listing %s of the state_dir: %s", digest, e)
                return None

        return check_listings(spec, state, now, new, old)

    return await asyncio.to_thread(run)
