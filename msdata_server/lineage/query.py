"""One lineage query: steps [start, stop), all data groups or one, optionally only where one sample went.

The same function answers the server (states from the running job's saved ones, the node's worker pool) and
the offline CLI (a job TOML, from its beginning or a trainer's saved state): the replay runs in a thread and
reads lengths through ``ThreadView`` from a ``DataView`` on the event loop, as the job's own planner does.
"""

from __future__ import annotations

import asyncio
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import numpy as np

from msdata_client.spec import JobSpec

from ..errors import ConfigError
from ..job.view import ThreadView
from ..planner.listings import Listings
from ..planner.spec import planner_config
from ..planner.state import K_LISTING
from .data import DataView
from .replay import replay
from .rows import join_columns, plan_columns

__all__ = ["MAX_STEPS", "Query", "answer", "check_files"]

MAX_STEPS = 1 << 16  # steps one query may replay: a --sample search is bounded by its step range


def _int(frame: Mapping, key: str, minimum: int, optional: bool = False) -> int | None:
    v = frame.get(key)
    if v is None and optional:
        return None
    if isinstance(v, bool) or not isinstance(v, int) or v < minimum:
        raise ConfigError(f"lineage {key}={v!r} must be an int >= {minimum}")
    return v


@dataclass(frozen=True, slots=True, kw_only=True)
class Query:
    """Steps [start, stop) (half-open); ``group``: one data group's (dp_rank's) rows only; ``sample``: only the
    rows of that sample id."""

    start: int
    stop: int
    group: int | None = None
    sample: int | None = None

    def __post_init__(self) -> None:
        if not 0 <= self.start < self.stop:
            raise ConfigError(f"lineage steps {self.start}:{self.stop} must be A:B with 0 <= A < B (B excluded)")
        if self.stop - self.start > MAX_STEPS:
            raise ConfigError(f"lineage steps {self.start}:{self.stop} span more than {MAX_STEPS} steps; ask less")

    @classmethod
    def from_frame(cls, frame: Mapping) -> Query:
        start, stop = _int(frame, "start", 0), _int(frame, "stop", 1)
        assert start is not None
        assert stop is not None
        return cls(start=start, stop=stop, group=_int(frame, "group", 0, True), sample=_int(frame, "sample", 0, True))


def _skipped(step: int, skips: Sequence[Sequence[int]]) -> bool:
    return any(a <= step < b for a, b in skips)


def check_files(spec: JobSpec, query: Query, states: Sequence[Mapping | None]) -> None:
    """ConfigError when ``query`` asks for steps planned over another file list than the one a job went on
    with (``[job] on_data_change = "continue"``): their rows refer to the old files, which a replay over
    today's files would name wrongly."""
    n = len(spec.sources)
    changes = {
        (c.step, c.source, c.was, c.now): c
        for st in states
        if st is not None and K_LISTING in st
        for c in Listings.from_dict(st[K_LISTING], n).changes_after(query.start)
    }
    if changes:
        c = min(changes.values(), key=lambda c: c.step)
        raise ConfigError(
            f"steps before {c.step} of job {spec.name!r} were read from another file list of source {c.source!r} "
            f"(digest {c.was[:12] or 'unknown'}; from step {c.step} on: {c.now[:12]}; [job] on_data_change = "
            f'"continue"): their rows refer to the old files and cannot be replayed over today\'s; ask for steps '
            f">= {c.step}, or restore the old files and replay offline"
        )


async def answer(
    spec: JobSpec,
    query: Query,
    data: DataView,
    *,
    base: Mapping | None,
    held: Mapping[int, Mapping] | None = None,
    skips: Sequence[Sequence[int]] = (),
) -> dict:
    """The lineage columns of ``query`` (wire form: numeric columns, sources, files per source), replayed from
    ``base`` (None: the beginning) with ``held`` later states; steps inside ``skips`` are marked skipped."""
    check_files(spec, query, [base, *(held or {}).values()])
    cfg = planner_config(spec)
    if query.group is not None and query.group >= cfg.dp:
        raise ConfigError(f"lineage dp_rank {query.group} is outside job {spec.name!r}'s {cfg.dp} data groups")
    view = ThreadView(data.lengths, asyncio.get_running_loop(), closed="lineage query stopped", ask_vision=data.vision)

    def compute() -> dict[str, np.ndarray]:
        parts = []
        for plan in replay(cfg, base, view, query.start, query.stop, held, sizes=data.sizes()):
            cols = plan_columns(
                plan,
                data,
                seq_len=cfg.seq_len,
                micro_batches=cfg.micro_batches,
                rows=cfg.rows,
                skipped=_skipped(plan.step, skips),
                group=query.group,
            )
            if query.sample is not None:
                m = cols["sample_id"] == query.sample
                cols = {k: v[m] for k, v in cols.items()}
            parts.append(cols)
        return join_columns(parts)

    try:
        cols = await asyncio.to_thread(compute)
    finally:
        view.close()
    return {
        "columns": cols,
        "sources": list(spec.source_names()),
        "files": [data.files(s) for s in range(len(spec.sources))],
    }
