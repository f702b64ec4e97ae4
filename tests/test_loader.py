"""SourceLoader: lengths and tokens by ordinal, the read-ahead bound, release, seek, partitions, bad data."""

from __future__ import annotations

import asyncio
import os
import secrets
import threading

import numpy as np
import orjson
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from msdata_client.graph import SourceSpec
from msdata_server import loader as loader_mod
from msdata_server.errors import BadSampleError, ClosedError, ConfigError, MsdataError
from msdata_server.loader import SourceLoader
from msdata_server.pool import WorkerPool
from msdata_server.sources import BadSample, ReadResult, open_source
from msdata_server.sources.synthetic import SyntheticSource
from msdata_server.transforms import byte_tokens

from .aio import LOOPS, run

BYTES = "msdata_server.transforms:byte_tokens"
HERE = __name__  # transforms defined here are named "<this module>:<function>" (workers import it too)


def synthetic(samples=2000, seed=11, name="syn"):
    return open_source(SourceSpec(name=name, format="synthetic", samples=samples, median=64.0, max_len=1000), seed=seed)


def test_all_is_sorted():
    assert loader_mod.__all__ == sorted(loader_mod.__all__)


@pytest.mark.parametrize("loop", LOOPS)
def test_synthetic_lengths_and_tokens(loop):
    src = synthetic()

    async def main():
        async with SourceLoader(src, None, transform=None, seed=11, readahead=256, batch=32) as ld:
            lens = await ld.lengths(0, 300)
            more = await ld.lengths(300, 5)
            toks = [await ld.tokens(o) for o in (0, 7, 299)]
            return lens, more, toks, ld.sample_ids([0, 7, 299]), ld.statistics()

    lens, more, toks, ids, st = run(main(), loop)
    assert np.array_equal(lens, src.lengths(np.arange(300)))
    assert np.array_equal(more, src.lengths(np.arange(300, 305)))
    docs = src.read([0, 7, 299])
    assert all(np.array_equal(a, b) for a, b in zip(toks, docs))
    assert np.array_equal(ids, src.sample_ids([0, 7, 299]))
    assert st.samples_done >= 305
    assert st.ready > 0
    assert st.memory_bytes > 0
    assert st.errors == 0
    assert st.bad_samples == {}


def test_figures_are_the_statistics_as_json():
    """figures() (status JSON, built field by field for speed) is what dataclasses.asdict of the statistics
    gives, scalars and tables only; ``ready`` is the statistics' count without building them."""
    import dataclasses

    src = synthetic()

    async def main():
        async with SourceLoader(src, None, transform=None, seed=0, readahead=40, batch=16) as ld:
            await ld.lengths(0, 20)
            await ld.wait_idle()
            return ld.statistics(), ld.ready

    st, ready = run(main())
    want = {k: v for k, v in dataclasses.asdict(st).items() if isinstance(v, (int, float, str, dict, type(None)))}
    got = st.figures()
    assert got == want
    assert "partition" not in got
    assert got["memory"]["read_ahead"] > 0
    assert got["memory"] is not st.memory
    assert got["bad_samples"] is not st.bad_samples
    assert ready == st.ready > 0


def test_readahead_is_bounded():
    src = synthetic()

    async def main():
        ld = SourceLoader(src, None, transform=None, seed=0, readahead=100, batch=16)
        await ld.start()
        await ld.wait_idle()
        first = ld.statistics()
        await ld.lengths(0, 50)  # highest asked: 49 -> reads up to 149 at most
        await ld.wait_idle()
        second = ld.statistics()
        await ld.aclose()
        return first, second

    first, second = run(main())
    # before any request: the batches wholly inside [0, 100)
    assert first.samples_done == 96
    assert first.cursor == 96
    # after asking for 0..49: batches ending at or before 149
    assert second.samples_done == 144
    assert second.cursor == 144
    assert second.ready == 144
    assert second.buffer_fill == pytest.approx(1.44)


def test_release_frees_payloads():
    src = synthetic()

    async def main():
        async with SourceLoader(src, None, transform=None, seed=0, readahead=0, batch=10) as ld:
            await ld.lengths(0, 30)
            held = ld.statistics()
            ld.release(np.arange(0, 15))
            half = ld.statistics()
            again3 = await ld.tokens(3)  # its batch was dropped: read again, once, holding nothing
            again12 = await ld.tokens(12)  # its batch is still held: read once, uncached
            t = await ld.tokens(20)
            ld.release(np.arange(15, 30))
            # tokens(3) re-read batch 0 uncached: its other samples were released and must stay so (before
            # the fix of the memory growth they were held again, and never released)
            assert ld.statistics().ready == 0
            ld.release(np.arange(0, 10))
            empty = ld.statistics()
            again = await ld.lengths(0, 10)  # released batches are read again on demand
            return held, half, empty, t, again, again3, again12

    held, half, empty, t, again, again3, again12 = run(main())
    assert np.array_equal(again3, src.read([3])[0])
    assert np.array_equal(again12, src.read([12])[0])
    assert held.ready == 30
    assert half.ready == 15
    assert empty.ready == 0
    assert empty.memory_bytes == 0
    assert half.memory_bytes < held.memory_bytes
    assert len(t) == src.lengths([20])[0]
    assert np.array_equal(again, src.lengths(np.arange(10)))


def test_seek_resumes_at_an_ordinal():
    src = synthetic()

    async def main():
        async with SourceLoader(src, None, transform=None, seed=0, readahead=64, batch=16) as ld:
            await ld.lengths(0, 40)
            ld.seek(1000)
            st = ld.statistics()
            lens = await ld.lengths(1000, 20)
            await ld.wait_idle()
            return st, lens, ld.statistics()

    st, lens, after = run(main())
    assert st.ready == 0  # batches before the seek point were dropped
    assert st.cursor == 992  # the batch holding ordinal 1000
    assert np.array_equal(lens, src.lengths(np.arange(1000, 1020)))
    assert after.cursor <= 1000 + 20 + 64 + 16


def test_partitions_split_the_work_without_changing_the_order():
    src = synthetic(samples=500)

    async def main():
        whole = SourceLoader(src, None, transform=None, seed=0, batch=8)
        parts = [SourceLoader(src, None, transform=None, seed=0, batch=8, partition=(k, 3)) for k in range(3)]
        ref = await whole.lengths(0, 240)
        got = np.zeros(240, dtype=np.int64)
        for b in range(30):
            k = b % 3
            got[b * 8 : (b + 1) * 8] = await parts[k].lengths(b * 8, 8)
        with pytest.raises(ValueError, match="ordinal 8 belongs to partition 1 of 3, not 0"):
            await parts[0].lengths(0, 16)
        for ld in [whole, *parts]:
            await ld.aclose()
        return ref, got

    ref, got = run(main())
    assert np.array_equal(ref, got)


def test_bad_arguments():
    src = synthetic()
    with pytest.raises(ConfigError, match="batch=0"):
        SourceLoader(src, None, transform=None, seed=0, batch=0)
    with pytest.raises(ConfigError, match="partition=\\(3, 3\\)"):
        SourceLoader(src, None, transform=None, seed=0, partition=(3, 3))
    with pytest.raises(ConfigError, match="must look like 'module:function'"):
        SourceLoader(src, None, transform="nonsense", seed=0)
    with pytest.raises(ConfigError, match="must look like 'module:function'"):
        SourceLoader(src, WorkerPool(1), transform="nonsense", seed=0)
    with pytest.raises(ConfigError, match="cannot import module 'no_such_module_xyz'"):
        SourceLoader(src, None, transform="no_such_module_xyz:f", seed=0)
    # with a pool, the transform is imported only in the workers
    SourceLoader(src, WorkerPool(1), transform="no_such_module_xyz:f", seed=0)


def raise_on_boom(record, **_):
    if "boom" in record:
        raise RuntimeError("transform exploded")
    return byte_tokens(record)


def write_messy_jsonl(path):
    lines = []
    good = []
    for i in range(60):
        if i % 10 == 3:
            lines.append(b"{broken json")
        elif i % 10 == 5:
            lines.append(b'{"text": "bad \xff utf8"}')
        elif i % 10 == 7:
            lines.append(orjson.dumps({"text": "boom " * 3}))
        elif i % 10 == 9:
            lines.append(orjson.dumps({"text": "y" * 300}))  # oversize
        else:
            good.append(f"good {i}")
            lines.append(orjson.dumps({"text": good[-1]}))
    path.write_bytes(b"\n".join(lines) + b"\n")
    return good


@pytest.mark.parametrize("with_pool", [False, True])
def test_bad_data_is_counted_and_skipped(tmp_path, with_pool):
    good = write_messy_jsonl(tmp_path / "m.jsonl")
    src = open_source(SourceSpec(name="m", format="jsonl", paths=(str(tmp_path),), max_sample_bytes=200), seed=0)

    async def main():
        pool = WorkerPool(2, shm_prefix="msdt" + secrets.token_hex(3)) if with_pool else None
        try:
            async with SourceLoader(src, pool, transform=f"{HERE}:raise_on_boom", seed=0, batch=20, readahead=0) as ld:
                lens = await ld.lengths(0, 60)
                toks = {}
                for o in range(60):
                    if lens[o]:
                        toks[o] = bytes((await ld.tokens(o))[:-1].astype(np.uint8)).decode()
                bad_o = int(np.flatnonzero(lens == 0)[0])
                with pytest.raises(BadSampleError, match=f"ordinal {bad_o} is a bad sample"):
                    await ld.tokens(bad_o)
                return lens, toks, ld.statistics()
        finally:
            if pool is not None:
                await pool.aclose()

    lens, toks, st = run(main())
    assert (lens == 0).sum() == 24
    assert sorted(toks.values()) == sorted(good)
    assert st.bad_samples == {"bad_json": 6, "invalid_utf8": 6, "transform_error": 6, "oversize": 6}
    assert st.errors == 0


def test_loader_with_pool_matches_in_process(tmp_path):
    rows = [f"document {i} " + "w" * (i * 37 % 3000) for i in range(400)]
    pq.write_table(pa.table({"text": rows}), tmp_path / "p.parquet", row_group_size=50)
    src = open_source(SourceSpec(name="p", format="parquet", paths=(str(tmp_path),)), seed=5)

    async def main():
        async with WorkerPool(2, shm_prefix="msdt" + secrets.token_hex(3)) as pool:
            a = SourceLoader(src, pool, transform=BYTES, seed=5, batch=32, readahead=128)
            b = SourceLoader(src, None, transform=BYTES, seed=5, batch=32, readahead=128)
            la, lb = await a.lengths(0, 800), await b.lengths(0, 800)
            ta, tb = await a.tokens(799), await b.tokens(799)
            await a.aclose()
            await b.aclose()
            return la, lb, ta, tb

    la, lb, ta, tb = run(main())
    assert np.array_equal(la, lb)
    assert np.array_equal(ta, tb)
    assert sorted(la[:400].tolist()) == sorted(len(r.encode()) + 1 for r in rows)


class GatedSource(SyntheticSource):
    """A synthetic source whose reads wait for a gate, or fail while told to."""

    def __init__(self, spec, *, seed):
        super().__init__(spec, seed=seed)
        self.gate = threading.Event()
        self.fail = 0

    def read_batch(self, ordinals):
        if self.fail:
            self.fail -= 1
            raise RuntimeError("disk on fire")
        self.gate.wait(30)
        return super().read_batch(ordinals)


def gated():
    return GatedSource(SourceSpec(name="g", format="synthetic", samples=100, median=20.0), seed=0)


def test_close_wakes_waiters():
    src = gated()

    async def main():
        ld = SourceLoader(src, None, transform=None, seed=0, readahead=0, batch=10)
        waiter = asyncio.ensure_future(ld.lengths(0, 5))
        await ld.start()
        await asyncio.sleep(0)  # let the waiter register
        assert not waiter.done()
        await ld.aclose()
        src.gate.set()
        with pytest.raises(ClosedError):
            await waiter
        with pytest.raises(ClosedError):
            await ld.start()

    run(main())


def test_a_failed_read_is_an_error_and_is_retried_when_asked_again(caplog):
    src = gated()
    src.gate.set()
    src.fail = 1

    async def main():
        async with SourceLoader(src, None, transform=None, seed=0, readahead=0, batch=10) as ld:
            with pytest.raises(MsdataError, match="disk on fire"):
                await ld.lengths(0, 5)
            first = ld.statistics()
            lens = await ld.lengths(0, 5)
            return first, lens

    first, lens = run(main())
    assert first.errors == 1
    assert np.array_equal(lens, src.lengths(np.arange(5)))
    assert any("batch 0" in r.getMessage() for r in caplog.records)


def test_no_threads_or_segments_left(tmp_path):
    before = set(os.listdir("/dev/shm"))
    src = synthetic()

    async def main():
        async with SourceLoader(src, None, transform=None, seed=0) as ld:
            await ld.lengths(0, 100)

    run(main())
    assert set(os.listdir("/dev/shm")) - before == set()


def test_read_result_is_exported():
    assert ReadResult([1], 3).nbytes == 3
    assert BadSample("oversize", "x").reason == "oversize"
