"""The worker pool under autoscaling: per-source profile figures measured in the workers, fair queueing by
quota, and a scale-down during which a worker is killed (nothing lost, nothing repeated).

The transforms below run in the worker processes (imported there as ``tests.test_autoscale_pool:<name>``).
"""

from __future__ import annotations

import asyncio
import os
import secrets
import signal
import time

import numpy as np
import pytest

from msdata_server.autoscale import Counters, SourceProfile
from msdata_server.pool import WorkerPool

from .aio import LOOPS, run

HERE = __name__


@pytest.fixture
def prefix():
    p = "msda" + secrets.token_hex(3)
    yield p
    left = [n for n in os.listdir("/dev/shm") if n.startswith(p)]
    assert left == [], f"shared memory left behind: {left}"


# ---- transforms run inside the workers ----
def burn(record, **_):
    """Spend ``record`` milliseconds of process CPU time (not wall time: a loaded machine changes nothing)."""
    end = time.process_time() + float(record) / 1e3
    x = 0
    while time.process_time() < end:
        x += 1
    return np.array([os.getpid(), x & 0xFF], dtype=np.int64)


def stamp(record, **_):
    """When this sample ran (ns); a single worker runs tasks one after another, so stamps give the order."""
    return np.array([time.monotonic_ns()], dtype=np.int64)


def block_on_fifos(record, **_):
    ready, go = record
    with open(ready, "w") as f:
        f.write(str(os.getpid()))
    with open(go) as f:
        f.read()
    return np.array([len(ready)], dtype=np.int64)


# ---- tests ----
def test_profile_figures_from_a_real_pool(prefix):
    """Two sources of known CPU cost through one pool: the pool counts each source's CPU seconds as the workers
    measured them, and the profile's smoothed CPU seconds per sample is that cost."""

    async def main():
        async with WorkerPool(2, shm_prefix=prefix, max_task=4) as pool:
            prof = SourceProfile(tau=1.0)
            t0 = time.monotonic()
            prof.observe(t0, Counters())
            before = pool.worker_seconds()
            await asyncio.gather(
                pool.transform(f"{HERE}:burn", ["20"] * 12, seed=0, sample_ids=np.arange(12), source="img"),
                pool.transform(f"{HERE}:burn", ["2"] * 12, seed=0, sample_ids=np.arange(12), source="txt"),
            )
            u = pool.usage()
            img = u["img"]
            prof.observe(
                time.monotonic(),
                Counters(samples_transformed=img.samples, cpu_s=img.cpu_s, worker_s=img.wall_s, samples_read=12),
            )
            return u, prof.figures(), pool.worker_seconds() - before, time.monotonic() - t0

    u, fig, worker_s, wall = run(main())
    assert u["img"].samples == 12
    assert u["txt"].samples == 12
    assert u["img"].tasks == 3
    assert 12 * 0.020 <= u["img"].cpu_s < 12 * 0.020 + 0.15  # burnt exactly, plus the tasks' overhead
    assert 12 * 0.002 <= u["txt"].cpu_s < 12 * 0.002 + 0.15
    assert u["img"].wall_s >= u["img"].cpu_s * 0.99  # a worker's wall time covers its CPU time
    assert fig.cpu_s_per_sample == pytest.approx(u["img"].cpu_s / 12)
    assert 0.020 <= fig.cpu_s_per_sample < 0.030
    assert u["img"].busy == 0
    assert u["img"].queued == 0
    assert 2 * wall * 0.9 <= worker_s <= 2 * wall * 1.1  # two workers alive the whole time


@pytest.mark.parametrize("loop", LOOPS)
def test_fair_queueing_serves_the_source_under_its_quota_first(prefix, tmp_path, loop):
    """One worker, held busy; then source a queues before source b. FIFO (no quotas) runs a first; with quotas
    that guarantee b the worker, b runs first although it queued later."""
    ready, go = str(tmp_path / "ready"), str(tmp_path / "go")
    os.mkfifo(ready)
    os.mkfifo(go)

    def hold() -> None:
        with open(ready) as f:
            f.read()

    def release() -> None:
        with open(go, "w") as f:
            f.write("1")

    async def order(pool: WorkerPool) -> list[str]:
        block = asyncio.ensure_future(
            pool.transform(f"{HERE}:block_on_fifos", [(ready, go)], seed=0, sample_ids=[0], source="x")
        )
        await asyncio.to_thread(hold)  # the only worker is busy now
        a = asyncio.ensure_future(pool.transform(f"{HERE}:stamp", ["a"] * 3, seed=0, sample_ids=[1, 2, 3], source="a"))
        b = asyncio.ensure_future(pool.transform(f"{HERE}:stamp", ["b"] * 3, seed=0, sample_ids=[4, 5, 6], source="b"))
        while pool.usage().get("b") is None or pool.usage()["b"].queued == 0:  # noqa: ASYNC110  (polls another process's state)
            await asyncio.sleep(0)
        await asyncio.to_thread(release)
        await block
        ta, tb = (int(r[0]) for r in (await a)[:1]), (int(r[0]) for r in (await b)[:1])
        return ["a", "b"] if next(ta) < next(tb) else ["b", "a"]

    async def main():
        async with WorkerPool(1, shm_prefix=prefix, max_task=3) as pool:
            fifo = await order(pool)
            pool.set_quotas({"a": 0.0, "b": 1.0, "x": 0.0})
            fair = await order(pool)
            quota = pool.usage()["b"].quota
            return fifo, fair, quota

    fifo, fair, quota = run(main(), loop)
    assert fifo == ["a", "b"]
    assert fair == ["b", "a"]
    assert quota == 1.0


def test_a_worker_killed_during_scale_down_loses_and_repeats_nothing(prefix, tmp_path):
    """Three workers, two busy; shrink to one (the idle one stops, a busy one retires after its task) and kill
    the retiring worker: its task runs again on the survivor, every other task completes once, and no
    replacement is started (the pool is meant to be smaller)."""
    fifos = {}
    for k in ("a", "b"):
        fifos[k] = (str(tmp_path / f"ready-{k}"), str(tmp_path / f"go-{k}"))
        for f in fifos[k]:
            os.mkfifo(f)

    def read_pid(k: str) -> int:
        with open(fifos[k][0]) as f:
            return int(f.read())

    def release(k: str) -> None:
        with open(fifos[k][1], "w") as f:
            f.write("1")

    async def main():
        async with WorkerPool(3, shm_prefix=prefix) as pool:
            calls = {
                k: asyncio.ensure_future(
                    pool.transform(f"{HERE}:block_on_fifos", [fifos[k]], seed=0, sample_ids=[i], source="img")
                )
                for i, k in enumerate(("a", "b"))
            }
            pids = {k: await asyncio.to_thread(read_pid, k) for k in calls}
            more = asyncio.ensure_future(
                pool.transform(f"{HERE}:stamp", [str(i) for i in range(40)], seed=0, sample_ids=np.arange(40))
            )
            await pool.resize(1)
            (victim,) = pool.retiring_pids()
            assert victim in pids.values()
            assert len(pool.pids()) == 2
            os.kill(victim, signal.SIGKILL)
            killed = next(k for k, p in pids.items() if p == victim)
            survivor = next(k for k in pids if k != killed)
            await asyncio.to_thread(release, survivor)  # the survivor finishes, then takes the re-run task
            again = await asyncio.to_thread(read_pid, killed)
            await asyncio.to_thread(release, killed)
            out = {k: await c for k, c in calls.items()}
            stamps = await more
            await pool.wait_ready()
            return pids, survivor, again, out, stamps, pool.statistics(), pool.pids()

    pids, survivor, again, out, stamps, st, left = run(main())
    assert again == pids[survivor]
    assert left == [pids[survivor]]
    assert {k: v[0].tolist() for k, v in out.items()} == {k: [len(f[0])] for k, f in fifos.items()}
    assert len(stamps) == 40
    assert len({int(s[0]) for s in stamps}) == 40
    # every sample answered exactly once: 2 blocking + 40 others, none twice; nothing restarted
    assert st.samples_done == 42
    assert st.restarts == 0
    assert st.size == 1


@pytest.mark.parametrize("loop", LOOPS)
def test_sources_served_leave_no_queue_behind(prefix, loop):
    """Tasks of many sources (a job of 1,024 sources queues one per source): each answered in full, counted per
    source, and the dispatcher keeps no empty queue (a free worker's pass over the queues costs those queued)."""

    async def main():
        async with WorkerPool(2, shm_prefix=prefix, max_task=2) as pool:
            got = await asyncio.gather(
                *(
                    pool.transform(
                        f"{HERE}:stamp", ["r"] * 3, seed=0, sample_ids=[3 * i, 3 * i + 1, 3 * i + 2], source=f"s{i}"
                    )
                    for i in range(50)
                )
            )
            return got, dict(pool._jobs.queues), pool.usage()

    got, queues, usage = run(main(), loop)
    assert [len(g) for g in got] == [3] * 50
    assert queues == {}
    assert sorted(usage) == sorted(f"s{i}" for i in range(50))
    assert all(u.samples == 3 and u.queued == 0 for u in usage.values())
