"""Many sources on one node (issue 29 item 3): the node-wide LRU of open file handles, the read-ahead budget the
loaders share, payloads past the plans kept as lengths only, file metadata in flat arrays, and the per-source
memory breakdown status reports. Real sources over real JSON Lines and Parquet files, real loaders."""

from __future__ import annotations

import os
import threading

import numpy as np
import orjson
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from msdata_client.graph import SourceSpec
from msdata_server.loader import SourceLoader
from msdata_server.loader.budget import MAX_SAMPLES, MIN_SAMPLES, ReadAheadBudget
from msdata_server.ops.memory import MEMORY_KINDS, node_sources_memory
from msdata_server.sources import open_source
from msdata_server.sources.base import Ragged
from msdata_server.sources.handles import node_handles

from .aio import LOOPS, run


def _jsonl_dir(d, files: int, rows: int, tag: str):
    d.mkdir(parents=True)
    for i in range(files):
        lines = b"".join(orjson.dumps({"text": f"{tag}{i}-{k}"}) + b"\n" for k in range(rows))
        (d / f"{i:03d}.jsonl").write_bytes(lines)
    return d


def _parquet_dir(d, files: int, rows: int):
    d.mkdir(parents=True)
    for i in range(files):
        pq.write_table(pa.table({"text": [f"p{i}-{k}" for k in range(rows)]}), d / f"{i}.parquet", row_group_size=10)
    return d


@pytest.fixture
def handle_limit(monkeypatch):
    def set_limit(n: int):
        monkeypatch.setattr(node_handles(), "limit", n)

    return set_limit


def _sources(tmp_path):
    specs = [
        SourceSpec(name="a", format="jsonl", paths=(str(_jsonl_dir(tmp_path / "a", 9, 7, "a")),)),
        SourceSpec(name="b", format="jsonl", paths=(str(_jsonl_dir(tmp_path / "b", 6, 5, "b")),)),
        SourceSpec(name="c", format="parquet", paths=(str(_parquet_dir(tmp_path / "c", 7, 30)),)),
    ]
    return [open_source(s, seed=4) for s in specs]


def _read_all(sources, step: int = 7) -> tuple[list[list], int]:
    """Every sample of every source, read in turns of ``step`` ordinals (the sources interleaved, so each read
    opens files while the others hold theirs); the most handles the node held open at once."""
    out: list[list] = [[] for _ in sources]
    most = 0
    for lo in range(0, max(s.num_samples for s in sources), step):
        for i, s in enumerate(sources):
            if lo < s.num_samples:
                out[i] += s.read(np.arange(lo, min(lo + step, s.num_samples)))
                most = max(most, len(node_handles()))
    return out, most


def test_open_handles_are_bounded_node_wide_and_reads_unchanged(tmp_path, handle_limit):
    handle_limit(10_000)
    free = _sources(tmp_path / "free")
    truth, _ = _read_all(free)
    for s in free:
        s.close()
    handle_limit(3)  # 22 files over three sources, 3 open at most on the node
    before = node_handles().evictions
    bounded = _sources(tmp_path / "bounded")
    got, most = _read_all(bounded)
    try:
        assert most <= 3
        assert sum(s.statistics().open_files for s in bounded) <= 3
        assert node_handles().evictions - before > 20  # handles were closed for the bound and opened again
        for t, g in zip(truth, got):
            assert [str(x).replace("free", "") for x in t] == [str(x).replace("bounded", "") for x in g]
        assert sorted(got[0]) == sorted(f"a{i}-{k}" for i in range(9) for k in range(7))  # every sample once
    finally:
        for s in bounded:
            s.close()
    assert all(s.statistics().open_files == 0 for s in bounded)


def test_a_reading_source_keeps_its_handles(tmp_path, handle_limit):
    """Another source's open never closes a handle whose owner is reading (its lock held): it passes it over."""
    handle_limit(1)
    a, b, c = _sources(tmp_path)
    try:
        a.read(np.arange(3))
        assert a.statistics().open_files == 1
        holding, done = threading.Event(), threading.Event()

        def reader():  # a stands for a read in progress: it holds its lock
            with a._lock:
                holding.set()
                done.wait(30)

        t = threading.Thread(target=reader)
        t.start()
        try:
            assert holding.wait(30)
            b.read(np.arange(3))
            assert a.statistics().open_files == 1  # passed over: the bound is exceeded for now
            assert len(node_handles()) == 2
        finally:
            done.set()
            t.join()
        b.read(np.arange(3, 30))  # the next opens close a's handle, now idle
        assert a.statistics().open_files == 0
        assert len(node_handles()) == 1
    finally:
        for s in (a, b, c):
            s.close()


def test_read_ahead_budget_shares():
    budget = ReadAheadBudget(samples=4096, nbytes=1 << 30)
    members = [_Member() for _ in range(1024)]
    assert budget.share().samples == MAX_SAMPLES  # nobody yet: one loader's ceiling
    for m in members[:64]:
        budget.join(m)
    assert budget.share().samples == 64  # up to 64 sources: what a loader always read ahead
    for m in members[64:]:
        budget.join(m)
    assert budget.share().samples == max(MIN_SAMPLES, 4096 // 1024) == 8
    assert budget.share().bytes == 1 << 20
    assert sum(m.woken for m in members) == 0  # shares only shrank
    for m in members[1:]:
        budget.leave(m)
    assert budget.share().samples == MAX_SAMPLES
    assert members[0].woken > 0  # the one left was told it may read on
    assert budget.figures()["loaders"] == 1


def test_read_ahead_budget_changes_once_for_many_leaves():
    """Leaves within ``changes()`` (a job's loaders closing) wake each loader left once, at the end."""
    budget = ReadAheadBudget(samples=4096, nbytes=1 << 30)
    members = [_Member() for _ in range(1024)]
    for m in members:
        budget.join(m)
    with budget.changes():
        for m in members[101:]:
            budget.leave(m)
        assert budget.share().samples == 8  # unchanged until the end
        with budget.changes():
            budget.leave(members[100])
        assert sum(m.woken for m in members) == 0
    assert budget.share().samples == 4096 // 100
    assert [m.woken for m in members[:100]] == [1] * 100
    assert budget.figures()["loaders"] == 100
    budget.leave(members[99])  # outside: at once, as before
    assert budget.share().samples == 4096 // 99
    assert [m.woken for m in members[:99]] == [2] * 99


class _Member:
    def __init__(self):
        self.woken = 0

    def budget_grew(self):
        self.woken += 1


def synthetic(name: str, samples: int = 4000):
    spec = SourceSpec(name=name, format="synthetic", samples=samples, median=64.0, max_len=1000)
    return open_source(spec, seed=3)


@pytest.mark.parametrize("loop", LOOPS)
def test_loaders_share_the_read_ahead_budget(loop):
    """Eight loaders on a budget of 64 samples read ahead 8 each: less than a batch, so a source nobody asked
    for holds nothing; when the others leave, the one left reads ahead its ceiling, woken by the budget."""

    async def main():
        budget = ReadAheadBudget(samples=64, nbytes=1 << 30)
        loaders = [SourceLoader(synthetic(f"s{i}"), None, transform=None, seed=3, budget=budget) for i in range(8)]
        for ld in loaders:
            await ld.start()
            await ld.wait_idle()
        many = [ld.statistics() for ld in loaders]
        await loaders[0].lengths(0, 10)  # asked: that batch is read, nothing beyond (10 + 8 < 64)
        await loaders[0].wait_idle()
        asked = loaders[0].statistics()
        for ld in loaders[1:]:
            await ld.aclose()
        await loaders[0].wait_idle()
        alone = loaders[0].statistics()
        await loaders[0].aclose()
        return many, asked, alone, budget.loaders

    many, asked, alone, left = run(main(), loop)
    assert all(st.readahead == 8 and st.samples_done == 0 and st.ready == 0 for st in many)
    assert asked.samples_done == 64
    assert asked.readahead == 8
    assert alone.readahead == MAX_SAMPLES
    assert alone.samples_done == 64  # batch 1 ends at 127 > 9 + 64: still not due
    assert left == 0


@pytest.mark.parametrize("loop", LOOPS)
def test_payloads_past_the_plans_are_read_again_unchanged(loop):
    """A loader that follows the plans holds payloads only up to its read-ahead past them; the others keep their
    lengths, and are read again (with the next ones) when asked for: the same tokens, the same dtype."""
    src, ref = synthetic("f"), synthetic("f")

    async def main():
        async with (
            SourceLoader(src, None, transform=None, seed=3, readahead=4, batch=32) as ld,
            SourceLoader(ref, None, transform=None, seed=3, readahead=4, batch=32) as whole,
        ):
            ld.follow_plans()
            lens = await ld.lengths(0, 64)
            held = ld.statistics()
            ld.planned_to(9)  # 0..9 planned: a new fill would keep 0..13
            toks = [await ld.tokens(o) for o in range(64)]
            after = ld.statistics(), src.statistics().rows_read
            want = [await whole.tokens(o) for o in range(64)]
            return lens, held, toks, after, want, await whole.lengths(0, 64)

    lens, held, toks, after, want, want_lens = run(main(), loop)
    assert np.array_equal(lens, want_lens)
    assert held.ready == 4  # of 64 read for their lengths: payloads up to readahead past -1
    assert held.memory["read_ahead"] == held.memory_bytes > 0
    assert all(a.dtype == b.dtype and np.array_equal(a, b) for a, b in zip(toks, want))
    stats, rows = after
    assert stats.ready == 64  # read again when asked, and held until released
    assert 64 + 60 <= rows <= 64 + 60 + 4  # 60 read again, in reads of up to 4 (each its own read)


def _fds() -> int:
    return len(os.listdir("/proc/self/fd"))


@pytest.mark.skipif(not os.path.isdir("/proc/self/fd"), reason="counts descriptors in /proc")
def test_parquet_descriptors_close_with_their_handles(tmp_path, handle_limit):
    """Local Parquet files are opened by the source (pa.OSFile), which ParquetFile would leave open: closing a
    handle (trim, the node bound, close) must close its descriptor."""
    handle_limit(2)
    d = _parquet_dir(tmp_path / "c", 7, 30)
    base = _fds()
    src = open_source(SourceSpec(name="c", format="parquet", paths=(str(d),)), seed=4)
    try:
        assert _fds() - base == src.statistics().open_files <= 2  # the scan kept what the bound allows
        got = src.read(np.arange(src.num_samples))
        assert sorted(got) == sorted(f"p{i}-{k}" for i in range(7) for k in range(30))
        assert _fds() - base == src.statistics().open_files <= 2  # the bound closed the others' descriptors
        src.trim()
        assert _fds() == base
        src.read(np.arange(5))
        assert _fds() > base
    finally:
        src.close()
    assert _fds() == base


@pytest.mark.parametrize("window", [7, 25, 64, 4096])
def test_groups_per_window_counts_the_row_groups_a_window_spans(tmp_path, window):
    """ParquetSource sizes its row-group cache by the most row groups one window spans, computed for all files
    at once: the same as counting them file by file, with empty, small and large row groups and a file of no
    rows."""
    d = tmp_path / "g"
    d.mkdir()
    rng = np.random.default_rng(window)
    schema = pa.schema([("text", pa.string())])
    for i in range(6):
        with pq.ParquetWriter(d / f"{i}.parquet", schema) as w:
            for n in rng.integers(0, 40, 5).tolist() if i != 3 else []:
                w.write_table(pa.table({"text": [f"{i}-{k}" for k in range(n)]}, schema=schema), row_group_size=n or 1)
    src = open_source(SourceSpec(name="g", format="parquet", paths=(str(d),), shuffle={"window": window}), seed=1)
    try:
        order, most = src.order, 1
        for f, cum in enumerate(src.unit_cum):  # each window: from the unit holding its first row to its last's
            lo, hi = int(order.offsets[f]), int(order.offsets[f + 1])
            ends = [*order.starts[lo + 1 : hi].tolist(), int(cum[-1])]
            for w0, w1 in zip(order.starts[lo:hi].tolist(), ends):
                first = int(np.searchsorted(cum, w0, side="right"))
                last = int(np.searchsorted(cum, w1 - 1, side="right"))
                most = max(most, last - first + 1)
        assert src._groups_per_window() == most
        assert src._groups.max_items == src.order.lanes * most + 8
    finally:
        src.close()


def test_metadata_is_flat_arrays(tmp_path):
    src = open_source(
        SourceSpec(name="m", format="jsonl", paths=(str(_jsonl_dir(tmp_path / "m", 50, 3, "m")),)), seed=1
    )
    try:
        assert isinstance(src.starts, Ragged)
        assert isinstance(src.ends, Ragged)
        assert isinstance(src.unit_cum, Ragged)
        assert len(src.starts) == 50
        assert src.starts[7].tolist() == [0, 16, 32]
        mem = src.memory()
        assert set(mem) == {"order", "metadata", "handles", "decoded"}
        assert mem["metadata"] == src.statistics().index_bytes
        assert src.starts.flat.size == src.ends.flat.size == 150  # one array for all 50 files
        assert mem["metadata"] <= 16 * 8 * 50  # about 15 int64 per file of 3 rows, counted
        src.read(np.arange(20))
        assert src.memory()["handles"] > 0
        assert src.memory()["order"] > 0
        src.trim()
        assert src.memory()["handles"] == 0
        assert src.memory()["order"] == 2 * 8 * 50  # the epoch's file order only: windows' and rows' dropped
    finally:
        src.close()


def test_node_totals_sum_the_sources():
    srcs = {"a": {"memory": dict.fromkeys(MEMORY_KINDS, 3)}, "b": {"memory": {"read_ahead": 10}}, "c": {}}
    got = node_sources_memory([{"sources": srcs}, {"sources": {}}])
    assert got["sources"]["read_ahead"] == 13
    assert got["sources"]["total"] == 3 * len(MEMORY_KINDS) + 10
    assert set(got) == {"sources", "read_ahead_budget", "open_files"}
    assert got["open_files"]["limit"] == node_handles().limit


def test_first_reads_are_started_a_few_at_a_time_in_the_order_asked():
    from msdata_server.loader.budget import WARM_READS

    budget, started = ReadAheadBudget(), []

    class Loader:
        def __init__(self, i: int, reads: bool):
            self.i, self.reads = i, reads

        def warm_read(self) -> bool:
            if self.reads:
                started.append(self.i)
            return self.reads

    loaders = [Loader(i, reads=i != 3) for i in range(40)]  # loader 3 had read already: it takes no slot
    for ld in loaders:
        budget.warm(ld)
    assert started == [i for i in range(WARM_READS + 1) if i != 3]
    for _ in range(5):
        budget.warm_done()
    assert started == [i for i in range(WARM_READS + 6) if i != 3]
    for _ in range(40):
        budget.warm_done()
    assert started == [i for i in range(40) if i != 3]


@pytest.mark.parametrize("loop", LOOPS)
def test_first_reads_of_a_batch_come_in_two_parts(loop):
    """A loader that follows the plans with less than a batch of read-ahead reads its first batch in two parts:
    its first HEAD samples when first asked, the rest when a sample beyond them is asked for; later batches whole.
    The lengths and tokens are those of one whole read, and each sample is read once."""
    from msdata_server.loader.loader import HEAD

    src, ref = synthetic("p"), synthetic("p")

    async def main():
        async with (
            SourceLoader(src, None, transform=None, seed=3, readahead=4, batch=64) as ld,
            SourceLoader(ref, None, transform=None, seed=3, readahead=4, batch=64) as whole,
        ):
            ld.follow_plans()  # the first batch's first part is read now (the budget's warm)
            await ld.wait_idle()
            warm = src.statistics().rows_read
            head = await ld.lengths(0, HEAD)
            after_head = src.statistics().rows_read, ld.statistics()
            ld.planned_to(HEAD + 8)
            lens = await ld.lengths(0, 64)  # the rest of batch 0
            after_rest = src.statistics().rows_read
            second = await ld.lengths(64, HEAD + 4)  # batch 1: read whole
            after_second = src.statistics().rows_read
            toks = [await ld.tokens(o) for o in range(64 + HEAD + 8)]
            rows = src.statistics().rows_read
            want = [await whole.tokens(o) for o in range(64 + HEAD + 8)]
            return warm, head, after_head, lens, after_rest, second, after_second, toks, rows, want, whole

    warm, head, (rows_head, st), lens, rows_rest, second, rows_second, toks, rows, want, _whole = run(main(), loop)
    ref_lens = ref.lengths(np.arange(128))
    assert warm == HEAD  # the warm read took the first part only
    assert np.array_equal(head, ref_lens[:HEAD])
    assert rows_head == HEAD
    assert st.ready == 4
    assert st.errors == 0
    assert np.array_equal(lens, ref_lens[:64])
    assert rows_rest == 64  # the rest read once: no sample read twice
    assert np.array_equal(second, ref_lens[64 : 64 + HEAD + 4])
    assert rows_second == 128
    assert all(a.dtype == b.dtype and np.array_equal(a, b) for a, b in zip(toks, want))
    assert rows > 128  # payloads kept as lengths only, read again
