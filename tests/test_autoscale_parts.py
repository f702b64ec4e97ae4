"""Source auto-partitioning: a source split into 1, 2 and 4 partitions (and merged back) while a job is being
planned and built delivers exactly the batches of one partition; old partitions are closed once drained.

Real loaders over real Parquet files, the real planner and its metadata view, as the single-node job runs
them (job.local.LocalPlanFeed: plan in a thread, count the plan's pieces, fetch them).
"""

from __future__ import annotations

import asyncio
import hashlib

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

import msdata_client as msd
from msdata_server.job.view import ThreadView
from msdata_server.loader import SourceLoader
from msdata_server.local.payloads import LocalPayloads
from msdata_server.planner import Planner
from msdata_server.planner.spec import planner_config
from msdata_server.sources import open_source

from .aio import LOOPS, run

STEPS = 24


@pytest.fixture
def data(tmp_path):
    rng = np.random.default_rng(5)
    for name, n in (("web", 3000), ("code", 2000)):
        (tmp_path / name).mkdir()
        for f in range(3):
            text = ["x" * int(rng.integers(20, 900)) + f"{name}{f}-{i}" for i in range(n // 3)]
            pq.write_table(pa.table({"text": text}), tmp_path / name / f"part-{f}.parquet", row_group_size=100)
    return tmp_path


def spec_of(data):
    g = msd.DGraph("parts", seed=11)
    g.source("web", "parquet", str(data / "web"))
    g.source("code", "parquet", str(data / "code"))
    g.mix({"web": 0.6, "code": 0.4}).pack(2048, rows=1, micro_batches=2).mesh(dp=2)
    return g.plan()


async def steps(spec, splits: dict[int, int]) -> tuple[list[str], dict, list[int]]:
    """Digest of every step's pieces; ``splits``: step -> partitions of "web" set just before planning it."""
    sources = await asyncio.to_thread(lambda: [open_source(s, seed=spec.seed) for s in spec.sources])
    loaders = [
        SourceLoader(src, None, transform=s.transform, seed=spec.seed, batch=8, readahead=16)
        for src, s in zip(sources, spec.sources)
    ]
    for ld in loaders:
        await ld.start()
    payloads = LocalPayloads(loaders)
    planner = Planner(planner_config(spec))
    view = ThreadView(payloads.lengths, asyncio.get_running_loop(), ask_vision=payloads.vision)
    digests, open_loaders = [], []
    try:
        for step in range(STEPS):
            if step in splits:
                await payloads.set_partitions("web", splits[step])
            plan = await asyncio.to_thread(planner.plan_step, view)
            payloads.planned(plan)
            toks = await payloads.fetch(plan.source, plan.ordinal, plan.offset, plan.length)
            h = hashlib.sha256()
            for a in (plan.source, plan.ordinal, plan.offset, plan.length, plan.row, plan.group):
                h.update(np.ascontiguousarray(a).tobytes())
            for t in toks:
                h.update(np.ascontiguousarray(t).tobytes())
            digests.append(h.hexdigest())
            open_loaders.append(len(payloads.parts[0].loaders()))
        return digests, payloads.status(None), open_loaders
    finally:
        view.close()
        await payloads.aclose()


@pytest.mark.parametrize("loop", LOOPS)
def test_split_live_into_1_2_4_partitions_delivers_the_same_batches(data, loop):
    spec = spec_of(data)
    whole, st1, _ = run(steps(spec, {}), loop)
    live, st, opened = run(steps(spec, {3: 2, 8: 4, 14: 2, 19: 1}), loop)
    assert live == whole  # every piece of every step, bit for bit
    assert st1["web"]["partitions"] == 1
    assert st["web"]["partitions"] == 1
    assert st["code"]["partitions"] == 1
    assert max(opened) >= 4  # the four partitions were open at once...
    assert opened[-1] < max(opened)  # ...and drained generations were closed


def test_partitions_are_validated(data):
    async def main():
        spec = spec_of(data)
        src = await asyncio.to_thread(open_source, spec.sources[0], seed=spec.seed)
        payloads = LocalPayloads([SourceLoader(src, None, transform=spec.sources[0].transform, seed=spec.seed)])
        try:
            with pytest.raises(ValueError, match=r"partitions n=0 must be an integer in \[1, 16\]"):
                await payloads.set_partitions("web", 0)
            with pytest.raises(KeyError, match="no source 'nope' in this job"):
                await payloads.set_partitions("nope", 2)
            assert await payloads.set_partitions("web", 1) is None
        finally:
            await payloads.aclose()

    run(main())
