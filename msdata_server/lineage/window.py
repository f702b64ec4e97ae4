"""Replay a window: the micro-batches of steps [start, stop) exactly as one rank saw them, for a read-only client
(``DataClient(job, replay=(A, B))``), without touching the running job.

The plans come from the same replay as lineage; the pieces from the window's own loaders (``DataView``); each
micro-batch is built by ``batch.build_micro_batch`` into plain arrays and the rank's fields (its PP stage's, its
CP slice) travel as ``rbatch`` frames (dtype, shape, base64 of the bytes: exact, never pickled). The client asks
one step at a time, so the outbox holds at most one step of one rank.
"""

from __future__ import annotations

import asyncio
import base64
from collections.abc import Mapping

import numpy as np

from ..batch import BATCH_FIELDS, MicroBatchPieces, build_micro_batch, count_segments, field_specs
from ..document import cut_piece
from ..errors import ConfigError, MsdataError
from ..job.images import image_keys
from ..job.view import ThreadView
from ..planner import StepPlan
from ..planner.spec import planner_config
from .data import DataView
from .replay import replay
from .serve import job_states, serve_lineage, target

__all__ = ["MAX_WINDOW", "serve", "serve_replay"]

MAX_WINDOW = 16  # steps per replay request (the client asks one at a time)


def _fields(spec, rank: int, out: dict[str, np.ndarray]) -> list[list]:
    """The rank's fields of a built micro-batch as [name, dtype, shape, base64]: its stage's, its CP slice."""
    wanted, cp = set(spec.fields(rank, BATCH_FIELDS)), str(spec.mesh.coord(rank).cp)
    sent = []
    for key, arr in out.items():
        name, _, part = key.partition("@")
        if name in wanted and (not part or part == cp):
            sent.append([key, arr.dtype.str, list(arr.shape), base64.b64encode(arr.tobytes()).decode()])
    return sent


async def _micro_batches(spec, plan: StepPlan, group: int, data: DataView) -> list[tuple[int, dict[str, np.ndarray]]]:
    """The built micro-batches of ``group`` in ``plan``, in order."""
    mb, cp = spec.micro_batches, spec.mesh.cp
    key = plan.group.astype(np.int64) * mb + plan.micro
    out = []
    for m in range(mb):
        lo, hi = (int(x) for x in np.searchsorted(key, [group * mb + m, group * mb + m + 1]))
        src, ords = plan.source[lo:hi], plan.ordinal[lo:hi]
        toks = []
        for s, o, a, n in zip(src.tolist(), ords.tolist(), plan.offset[lo:hi].tolist(), plan.length[lo:hi].tolist()):
            toks.append(cut_piece(await data.loaders[s].tokens(o), a, n))
            data.loaders[s].release(np.array([o], np.int64))
        sids = np.empty(src.size, np.int64)
        for s in np.unique(src).tolist():
            sids[src == s] = data.sources[s].sample_ids(ords[src == s])
        pieces = MicroBatchPieces(row=plan.row[lo:hi], tokens=toks, sample_ids=sids, source_ids=src.astype(np.int64))
        nseg = count_segments(pieces, spec.rows, spec.seq_len)
        specs = field_specs(rows=spec.rows, seq_len=spec.seq_len, n_pieces=len(toks), n_segments=nseg, cp=cp)
        arrays = {name: np.zeros(shape, np.dtype(dt)) for name, dt, shape in specs}
        build_micro_batch(
            arrays, pieces, rows=spec.rows, seq_len=spec.seq_len, pad_id=spec.pad_id, cp=cp, step=plan.step, micro=m
        )
        out.append((m, arrays))
    return out


async def serve_replay(conn, frame: Mapping, jobs: Mapping, pool) -> None:
    """Answer one ``replay`` frame: an ``rbatch`` frame per micro-batch of the rank, then ``replay`` (done)."""
    rid = frame.get("id")
    try:
        job, query = target(frame, jobs, rank_required=True)
        spec, rank = job.spec, int(frame["rank"])
        if query.stop - query.start > MAX_WINDOW:
            raise ConfigError(f"replay {query.start}:{query.stop}: ask at most {MAX_WINDOW} steps at a time")
        if image_keys(spec) is not None:
            raise ConfigError(f"job {spec.name!r} has pictures; replaying its batches is not supported yet")
        base, held, _ = job_states(job, query)
        cfg = planner_config(spec)
        data = await DataView.open(spec, pool)
        view = ThreadView(data.lengths, asyncio.get_running_loop(), closed="replay stopped")
        try:
            sizes = data.sizes()
            plans = await asyncio.to_thread(
                lambda: list(replay(cfg, base, view, query.start, query.stop, held, sizes=sizes))
            )
            sent = 0
            for plan in plans:
                assert query.group is not None  # target() sets it: a rank was required
                for m, arrays in await _micro_batches(spec, plan, query.group, data):
                    conn.send(
                        {"t": "rbatch", "id": rid, "step": plan.step, "micro": m, "fields": _fields(spec, rank, arrays)}
                    )
                    sent += 1
        finally:
            view.close()
            await data.aclose()
        conn.send({"t": "replay", "id": rid, "batches": sent})
    except (MsdataError, KeyError, TypeError, ValueError) as e:
        conn.send({"t": "refused", "id": rid, "kind": type(e).__name__, "message": str(e)})


async def serve(conn, frame: Mapping, jobs: Mapping, pool) -> None:
    """The node's one entry for both replay requests: ``lineage`` (rows) and ``replay`` (a window's batches)."""
    await (serve_replay if frame["t"] == "replay" else serve_lineage)(conn, frame, jobs, pool)
