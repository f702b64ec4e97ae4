"""WorkerPool: results through shared memory, order, bad samples, dead workers, resizing, cleanup.

The transforms below run in the worker processes (imported there as ``test_pool:<name>``).
"""

from __future__ import annotations

import asyncio
import os
import secrets
import signal
import sys

import numpy as np
import pytest

from msdata_server import pool as pool_mod
from msdata_server.errors import ClosedError, ConfigError
from msdata_server.pool import WorkerPool
from msdata_server.sources import BadSample
from msdata_server.transforms import byte_tokens, run_transform

from .aio import LOOPS, run

BYTES = "msdata_server.transforms:byte_tokens"
HERE = __name__  # transforms defined here are named "<this module>:<function>" (workers import it too)


@pytest.fixture
def prefix():
    """A unique segment prefix; the test fails if anything with it is left in /dev/shm."""
    p = "msdt" + secrets.token_hex(3)
    yield p
    left = [n for n in os.listdir("/dev/shm") if n.startswith(p)]
    assert left == [], f"shared memory left behind: {left}"


def gone(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    return False


# ---- transforms run inside the workers ----
def pid_of(record, **_):
    return np.array([os.getpid(), len(record)], dtype=np.int64)


def raise_on_bad(record, **_):
    if record == "bad":
        raise ValueError("this record is bad")
    return byte_tokens(record)


def die_on(record, **_):
    if record == "die":
        os._exit(3)
    return byte_tokens(record)


def block_on_fifos(record, **_):
    """Tell the test our pid through one FIFO, then wait for a byte on another (deterministic 'in flight')."""
    ready, go = record
    with open(ready, "w") as f:
        f.write(str(os.getpid()))
    with open(go) as f:
        f.read()
    return np.array([os.getpid()], dtype=np.int64)


def torch_loaded(record, **_):
    return np.array([int("torch" in sys.modules)], dtype=np.int32)


def big_random(record, *, rng, **_):
    return rng.integers(0, 256, size=int(record), dtype=np.int32)


def worker_setting(record, **_):
    """The tokenizers thread setting this worker runs with."""
    return np.array([os.environ.get("TOKENIZERS_PARALLELISM") == "false"], dtype=np.int32)


def batch_size(record, **_):
    return np.array([-1], dtype=np.int64)  # one by one: what the batch path must not use


batch_size.needs_rng = False
batch_size.batch = lambda records: [np.array([len(records)], dtype=np.int64) for _ in records]


# ---- tests ----
def test_a_batch_transform_gets_a_task_per_call_on_one_thread(prefix, monkeypatch):
    """A transform's ``batch`` runs once per task in the worker (hf_tokenizer: one encode_batch), and a worker
    runs tokenizers on one thread (the pool is the parallelism)."""
    monkeypatch.delenv("TOKENIZERS_PARALLELISM", raising=False)

    async def main():
        async with WorkerPool(1, shm_prefix=prefix) as pool:
            sizes = await pool.transform(f"{HERE}:batch_size", ["a"] * 7, seed=0, sample_ids=np.arange(7))
            setting = await pool.transform(f"{HERE}:worker_setting", ["a"], seed=0, sample_ids=[0])
            return sizes, setting

    sizes, setting = run(main())
    assert [int(x[0]) for x in sizes] == [7] * 7
    assert setting[0].tolist() == [1]


@pytest.mark.parametrize("loop", LOOPS)
def test_results_in_order_through_shm_and_inline(prefix, loop):
    recs = ["x" * (i * 997 % 20000) for i in range(40)] + [b"\xff"]
    ids = np.arange(41) + 1000

    async def main():
        async with WorkerPool(2, shm_prefix=prefix) as pool:
            assert [n for n in os.listdir("/dev/shm") if n.startswith(prefix)] == []  # unlinked at once
            out = await pool.transform(BYTES, recs, seed=3, sample_ids=ids)
            st = pool.statistics()
            return out, st

    out, st = run(main(), loop)
    expected = run_transform(byte_tokens, recs, seed=3, sample_ids=ids)
    assert all(np.array_equal(a, b) for a, b in zip(out[:40], expected[:40]))
    assert isinstance(out[40], BadSample)
    assert out[40].reason == "invalid_utf8"
    assert st.bytes_via_shm > 0
    assert st.bytes_inline > 0
    assert st.samples_done == 41
    assert st.bad_samples == 1
    assert st.alive == 2
    assert st.shm_bytes > 0


def test_rng_matches_in_process_and_big_results_spill_inline(prefix):
    sizes = ["10", "100000", "5000", "3000000"]  # 12 MB of int32 results: more than the 1 MiB segment holds

    async def main():
        async with WorkerPool(1, shm_prefix=prefix, out_bytes=1 << 20) as pool:
            return await pool.transform(f"{HERE}:big_random", sizes, seed=9, sample_ids=[1, 2, 3, 4])

    out = run(main())
    expected = run_transform(big_random, sizes, seed=9, sample_ids=[1, 2, 3, 4])
    assert [len(o) for o in out] == [10, 100000, 5000, 3000000]
    assert all(np.array_equal(a, b) for a, b in zip(out, expected))


def test_a_raising_transform_spoils_one_sample_only(prefix):
    async def main():
        async with WorkerPool(2, shm_prefix=prefix) as pool:
            recs = ["a", "bad", BadSample("oversize", "f row 3"), "ccc"]
            out = await pool.transform(f"{HERE}:raise_on_bad", recs, seed=0, sample_ids=np.arange(4))
            # a transform that cannot be imported in the workers is a configuration error, not bad data
            with pytest.raises(ConfigError, match=r"no_such_module_xyz:f' failed to load.*cannot import"):
                await pool.transform("no_such_module_xyz:f", ["a"], seed=0, sample_ids=[0])
            return out

    out = run(main())
    assert out[0].tolist() == [97, 256]
    assert out[3].tolist() == [99, 99, 99, 256]
    assert out[1].reason == "transform_error"
    assert "this record is bad" in out[1].detail
    assert out[2] == BadSample("oversize", "f row 3")  # passed through, never sent to a worker


def test_workers_never_import_torch(prefix):
    async def main():
        async with WorkerPool(1, shm_prefix=prefix) as pool:
            return await pool.transform(f"{HERE}:torch_loaded", ["x"], seed=0, sample_ids=[0])

    assert run(main())[0].tolist() == [0]


@pytest.mark.parametrize("method", ["forkserver", "spawn"])
def test_killed_worker_is_replaced_and_its_task_rerun(prefix, tmp_path, method):
    ready, go = str(tmp_path / "ready"), str(tmp_path / "go")
    os.mkfifo(ready)
    os.mkfifo(go)

    def read_pid() -> int:
        with open(ready) as f:
            return int(f.read())

    def release() -> None:
        with open(go, "w") as f:
            f.write("1")

    async def main():
        async with WorkerPool(2, shm_prefix=prefix, start_method=method) as pool:
            before = pool.pids()
            task = asyncio.ensure_future(
                pool.transform(f"{HERE}:block_on_fifos", [(ready, go)], seed=0, sample_ids=[7])
            )
            first = await asyncio.to_thread(read_pid)  # the task is running in this worker now
            assert first in before
            os.kill(first, signal.SIGKILL)
            second = await asyncio.to_thread(read_pid)  # re-run on another worker
            assert second != first
            await asyncio.to_thread(release)
            out = await task
            await pool.wait_ready()
            st = pool.statistics()
            after = pool.pids()
            # the small transforms still run on the replaced pool
            more = await pool.transform(BYTES, ["ab"] * 5, seed=0, sample_ids=np.arange(5))
            return first, second, out, st, after, more

    first, second, out, st, after, more = run(main())
    assert out[0].tolist() == [second]
    assert st.restarts == 1
    assert st.samples_done == 1
    assert len(after) == 2
    assert first not in after
    assert all(m.tolist() == [97, 98, 256] for m in more)
    assert gone(first)
    assert all(gone(p) for p in after)


def test_a_sample_that_kills_workers_becomes_bad(prefix):
    async def main():
        async with WorkerPool(2, shm_prefix=prefix) as pool:
            out = await pool.transform(f"{HERE}:die_on", ["ok", "die", "fine"], seed=0, sample_ids=[1, 2, 3])
            await pool.wait_ready()
            return out, pool.statistics()

    out, st = run(main())
    assert out[0].tolist() == [111, 107, 256]
    assert out[2].tolist() == [102, 105, 110, 101, 256]
    assert isinstance(out[1], BadSample)
    assert out[1].reason == "worker_crash"
    assert st.restarts >= 3
    assert st.alive == 2


@pytest.mark.parametrize("loop", LOOPS)
def test_resize_under_load_loses_and_repeats_nothing(prefix, loop):
    n_tasks, per = 40, 16

    async def main():
        async with WorkerPool(2, shm_prefix=prefix) as pool:
            futs = [
                asyncio.ensure_future(
                    pool.transform(
                        f"{HERE}:pid_of",
                        [f"t{t}-{i}" for i in range(per)],
                        seed=0,
                        sample_ids=np.arange(t * per, (t + 1) * per),
                    )
                )
                for t in range(n_tasks)
            ]
            await asyncio.sleep(0)  # let the first tasks reach the workers
            assert pool.statistics().busy > 0
            await pool.resize(4)
            assert pool.size == 4
            assert len(pool.pids()) == 4
            await pool.resize(1)
            assert pool.size == 1
            await pool.resize(3)
            out = await asyncio.gather(*futs)
            st = pool.statistics()
            return out, st, pool.pids()

    out, st, pids = run(main(), loop)
    assert len(out) == n_tasks
    for t, res in enumerate(out):
        assert [int(r[1]) for r in res] == [len(f"t{t}-{i}") for i in range(per)]
    assert st.samples_done == n_tasks * per
    assert st.tasks_done == n_tasks
    assert st.restarts == 0
    assert len(pids) == 3
    assert st.size == 3
    workers_used = {int(r[0]) for res in out for r in res}
    assert len(workers_used) >= 2


def test_close_is_idempotent_and_leaves_nothing(prefix):
    async def main():
        pool = WorkerPool(2, shm_prefix=prefix)
        await pool.start()
        pids = pool.pids()
        await pool.aclose()
        await pool.aclose()
        with pytest.raises(ClosedError):
            await pool.transform(BYTES, ["a"], seed=0, sample_ids=[0])
        with pytest.raises(ClosedError):
            await pool.start()
        return pids

    pids = run(main())
    assert len(pids) == 2
    assert all(gone(p) for p in pids)


def test_pool_without_workers_and_identity(prefix):
    async def main():
        async with WorkerPool(0, shm_prefix=prefix) as pool:
            a = await pool.transform(BYTES, ["hi"], seed=0, sample_ids=[0])
            b = await pool.transform(None, [np.arange(3)], seed=0, sample_ids=[0])
            return a, b, pool.pids()

    a, b, pids = run(main())
    assert a[0].tolist() == [104, 105, 256]
    assert b[0].tolist() == [0, 1, 2]
    assert pids == []


def test_bad_arguments():
    with pytest.raises(ConfigError, match="size=-1"):
        WorkerPool(-1)
    with pytest.raises(ConfigError, match="start_method='fork'"):
        WorkerPool(1, start_method="fork")

    async def main():
        pool = WorkerPool(0)
        with pytest.raises(ConfigError, match="size=-2"):
            await pool.resize(-2)
        with pytest.raises(ValueError, match="2 records but 1 sample_ids"):
            await pool.transform(BYTES, ["a", "b"], seed=0, sample_ids=[0])
        await pool.aclose()

    run(main())


def test_all_is_sorted():
    assert pool_mod.__all__ == sorted(pool_mod.__all__)


def test_a_dead_forkserver_is_restarted(prefix):
    async def main():
        async with WorkerPool(1, shm_prefix=prefix) as pool:
            zygote = pool._launcher.proc
            os.kill(zygote.pid, signal.SIGKILL)
            await asyncio.to_thread(zygote.wait)
            await pool.resize(2)
            out = await asyncio.gather(*(pool.transform(BYTES, ["ab"], seed=0, sample_ids=[i]) for i in range(4)))
            return out, pool.pids(), pool._launcher.proc.pid != zygote.pid

    out, pids, restarted = run(main())
    assert restarted
    assert len(pids) == 2
    assert all(o[0].tolist() == [97, 98, 256] for o in out)
