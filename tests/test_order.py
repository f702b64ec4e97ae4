"""The read order of a source (sources/order.py, `[[source]] shuffle`): the mixed order's figure (any 1,000
consecutive ordinals of a source with >= 32 files come from >= min(files, 32) files), bijection, purity,
the fixed and file-local orders, and the spec key."""

from __future__ import annotations

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from msdata_client.errors import ConfigError as ClientConfigError
from msdata_client.graph import SourceSpec
from msdata_client.source import Shuffle
from msdata_server.sources import open_source
from msdata_server.sources.order import Order, lanes_for


def min_distinct(files: np.ndarray, run: int) -> int:
    """The fewest distinct values in any `run` consecutive entries of `files` (O(n): sample j counts for the
    runs starting after the previous occurrence of its file)."""
    n = len(files)
    if n < run:
        return len(np.unique(files))
    order = np.lexsort((np.arange(n), files))
    prev = np.full(n, -1, dtype=np.int64)
    same = files[order][1:] == files[order][:-1]
    prev[order[1:][same]] = order[:-1][same]
    j = np.arange(n)
    lo = np.maximum(prev + 1, j - run + 1).clip(0)
    hi = np.minimum(j, n - run)  # run starts i in [lo, hi] count sample j once
    ok = lo <= hi
    diff = np.zeros(n + 1, dtype=np.int64)
    np.add.at(diff, lo[ok], 1)
    np.add.at(diff, hi[ok] + 1, -1)
    return int(np.cumsum(diff)[: n - run + 1].min())


def test_min_distinct_helper_counts_runs():
    f = np.array([0, 0, 1, 2, 2, 2, 3])
    assert min_distinct(f, 3) == 1  # [2, 2, 2]
    assert min_distinct(f, 4) == 2
    assert min_distinct(f, 7) == 4
    assert min_distinct(np.arange(10) % 3, 3) == 3


def sharded(files: int, seed: int = 0) -> list[np.ndarray]:
    """Unit (row group) sizes of `files` files of unequal sizes: 1 to 6 groups of 200 to 1,500 rows."""
    rng = np.random.default_rng(seed)
    return [rng.integers(200, 1500, size=int(rng.integers(1, 7))) for _ in range(files)]


def uneven(files: int, low: int, high: int, seed: int = 0) -> list[np.ndarray]:
    """`files` files of `low` to `high` rows, in row groups of at most 300."""
    rng = np.random.default_rng(seed)
    out = []
    for c in rng.integers(low, high + 1, size=files).tolist():
        out.append(np.array([300] * (c // 300) + ([c % 300] if c % 300 else []), dtype=np.int64))
    return out


WORKLOADS = {
    "32 equal files": [np.array([300, 300, 100])] * 32,
    "32 files, 600 to 1,400 rows": uneven(32, 600, 1400),
    "33 files, 950 to 1,050 rows": uneven(33, 950, 1050, seed=1),
    "40 files, 1,000 to 1,800 rows": uneven(40, 1000, 1800, seed=3),
    "63 files, 500 to 1,500 rows": uneven(63, 500, 1500, seed=2),
    "256 files, 200 to 9,000 rows": sharded(256, seed=256),
}


@pytest.mark.parametrize("workload", list(WORKLOADS))
@pytest.mark.parametrize("seed", [0, 11])
def test_any_1000_consecutive_ordinals_come_from_min_files_32_files(workload, seed):
    """The issue 26 figure on the default order, within epochs and across the epoch boundaries."""
    units = WORKLOADS[workload]
    order = Order.from_units(seed=seed, name="web", units=units)
    n, files, lanes = order.num_samples, len(units), order.lanes
    _, f, _ = order.locate(np.arange(3 * n))  # three epochs: runs across both boundaries count too
    assert min_distinct(f, 1000) >= min(files, 32)
    # the exact guarantees of the module docstring, per round of `lanes` ordinals
    q = n // lanes
    rounds = [min_distinct(f[e * n : (e + 1) * n], lanes) for e in range(3)]
    if order.counts.max() < q:
        assert rounds == [lanes] * 3  # (a): no file holds q rows: lanes files per round
    if order.counts.min() > q:
        assert rounds == [files] * 3  # (b): every file holds q + 1 rows: every file in every round


def test_the_file_local_order_fails_the_figure():
    """What the issue measured: the file-local order reads one file for thousands of ordinals."""
    order = Order.from_units(seed=11, name="web", units=sharded(256), mode="file")
    _, f, _ = order.locate(np.arange(order.num_samples))
    assert min_distinct(f, 1000) <= 2


def test_lanes_follow_the_files():
    assert [lanes_for(f, 32) for f in (0, 1, 2, 16, 20, 32, 40, 63, 64, 1000)] == [1, 1, 32, 32, 40, 64, 64, 64, 32, 32]


def test_a_wider_spread_reads_more_files_at_once():
    order = Order.from_units(seed=2, name="w", units=sharded(256), spread=64)
    _, f, _ = order.locate(np.arange(order.num_samples))
    assert order.lanes == 64
    assert min_distinct(f, 64) == 64
    assert Order.from_units(seed=2, name="w", units=sharded(256)).lanes == 32


def test_a_dominant_file_fills_several_lanes():
    """A file holding more than 1/lanes of the rows is read by several lanes at once: fewer distinct files
    per run (the documented limit), but every file still comes round and the order stays a bijection."""
    units = [np.array([50_000])] + [np.array([500])] * 40  # one file of 50,000 rows beside 40 of 500
    order = Order.from_units(seed=5, name="d", units=units)
    n = order.num_samples
    _, f, r = order.locate(np.arange(n))
    assert len(set(zip(f.tolist(), r.tolist()))) == n
    big_share = int(np.count_nonzero(f[:32] == 0))
    assert 32 * 50_000 // n - 1 <= big_share <= 32 * 50_000 // n + 1  # its share of the lanes
    assert min_distinct(f, 1000) >= 32 - big_share  # the small files' lanes still differ


@settings(max_examples=60, deadline=None)
@given(
    units=st.lists(st.lists(st.integers(0, 90), min_size=0, max_size=4), min_size=1, max_size=40),
    window=st.integers(1, 64),
    spread=st.integers(2, 40),
    seed=st.integers(0, 2**40),
    epoch=st.integers(0, 3),
    mode=st.sampled_from(["mix", "file", "none"]),
)
def test_every_mode_is_a_pure_bijection_per_epoch(units, window, spread, seed, epoch, mode):
    arrs = [np.array(u, dtype=np.int64) for u in units]
    order = Order.from_units(seed=seed, name="p", units=arrs, window=window, mode=mode, spread=spread)
    n = order.num_samples
    if n == 0:
        return
    ords = np.arange(epoch * n, (epoch + 1) * n)
    e, f, r = order.locate(ords)
    assert (e == epoch).all()
    assert set(zip(f.tolist(), r.tolist())) == {(i, row) for i, a in enumerate(arrs) for row in range(int(a.sum()))}
    # a fresh Order (no caches) located backwards agrees, and so does any single ordinal: a pure function
    again = Order.from_units(seed=seed, name="p", units=arrs, window=window, mode=mode, spread=spread)
    assert np.array_equal(again.locate(ords[::-1])[2], r[::-1])
    k = len(ords) // 2
    assert again.locate(ords[k : k + 1])[1][0] == f[k]
    # the exact guarantee of the docstring: lanes consecutive ordinals, lanes files, if none holds n // lanes
    if order.lanes > 1 and order.counts.max() < n // order.lanes:
        assert min_distinct(f, order.lanes) == order.lanes


def test_lane_position_is_a_bijection():
    for n, lanes in [(1000, 32), (31, 32), (32, 32), (33, 32), (1, 32), (1025, 7)]:
        order = Order.from_units(seed=0, name="l", units=[np.array([n - n // 2]), np.array([n // 2])], spread=lanes)
        if order.lanes == 1:
            continue
        pos = order.lane_position(np.arange(n))
        assert np.array_equal(np.sort(pos), np.arange(n))


def test_epochs_seeds_and_names_change_the_mixed_order():
    units = sharded(64)
    a = Order.from_units(seed=1, name="a", units=units)
    n = a.num_samples
    ids = [a.locate(np.arange(e * n, e * n + 5000))[1:] for e in range(2)]
    assert not np.array_equal(ids[0][0], ids[1][0])
    b = Order.from_units(seed=2, name="a", units=units)
    c = Order.from_units(seed=1, name="c", units=units)
    for other in (b, c):
        assert not np.array_equal(other.locate(np.arange(5000))[1], ids[0][0])


def test_fixed_order_is_files_in_path_order_rows_in_file_order():
    units = [np.array([3, 4]), np.array([], dtype=np.int64), np.array([5])]
    order = Order.from_units(seed=9, name="x", units=units, mode="none")
    e, f, r = order.locate(np.arange(24))
    assert f[:12].tolist() == [0] * 7 + [2] * 5
    assert r[:12].tolist() == list(range(7)) + list(range(5))
    assert np.array_equal(f[12:], f[:12])
    assert np.array_equal(r[12:], r[:12])
    assert e[12:].tolist() == [1] * 12


def test_one_file_has_nothing_to_mix():
    units = [np.array([10_000])]
    mixed = Order.from_units(seed=4, name="one", units=units)
    local = Order.from_units(seed=4, name="one", units=units, mode="file")
    assert mixed.lanes == 1
    assert np.array_equal(mixed.locate(np.arange(20_000))[2], local.locate(np.arange(20_000))[2])


def test_order_caches_stay_bounded_over_a_long_mixed_walk():
    """Walking two epochs of 256 files keeps at most lanes + 8 row permutations and 2 * lanes file orders."""
    order = Order.from_units(seed=3, name="walk", units=sharded(256))
    for lo in range(0, 2 * order.num_samples, 7919):
        order.locate(np.arange(lo, lo + 7919))
    assert len(order._windows) <= order.lanes + 8
    assert len(order._files) <= 2 * order.lanes


# ---------------------------------------------------------------- real files


def write_shards(d, files: int, rows: int, group: int) -> dict[tuple[int, int], str]:
    d.mkdir()
    truth = {}
    for i in range(files):
        texts = [f"f{i}-r{r}" for r in range(rows)]
        pq.write_table(pa.table({"text": texts}), d / f"part-{i:03d}.parquet", row_group_size=group)
        truth.update({(i, r): t for r, t in enumerate(texts)})
    return truth


@pytest.mark.parametrize("shuffle", [True, {"spread": 40}, {"mode": "file"}, False])
def test_parquet_source_reads_the_order_it_locates(tmp_path, shuffle):
    """Every shuffle value reads each row once per epoch, the records its locate names; handles and decoded
    row groups stay within their LRU bounds (lanes + 4; lanes * the row groups of a window + 8)."""
    truth = write_shards(tmp_path / "p", 48, 120, 50)
    spec = SourceSpec(name="p", format="parquet", paths=(str(tmp_path / "p"),), shuffle=shuffle)
    with open_source(spec, seed=3) as src:
        n = src.num_samples
        assert n == 48 * 120
        lanes = src.order.lanes
        settings = spec.shuffle_settings()
        assert lanes == (lanes_for(48, settings.spread) if settings.mode == "mix" else 1)
        seen = []
        for lo in range(0, n, 1000):
            ords = np.arange(lo, min(lo + 1000, n))
            _, f, r = src.locate_many(ords)
            assert src.read(ords) == [truth[(a, b)] for a, b in zip(f.tolist(), r.tolist())]
            assert src.statistics().open_files <= lanes + 4
            assert len(src._groups.items) <= src._groups.max_items == lanes * 3 + 8  # 50-row groups, 120-row files
            seen += list(zip(f.tolist(), r.tolist()))
        assert sorted(seen) == sorted(truth)
        if shuffle is False:
            assert seen == sorted(truth)


# ---------------------------------------------------------------- the spec key


def test_shuffle_spec_values_and_round_trip():
    base = dict(name="s", format="jsonl", paths=("/data/a",))
    assert SourceSpec(**base).shuffle_settings() == Shuffle()
    assert "shuffle" not in SourceSpec(**base).to_dict()  # the default is not written: digests unchanged
    assert "shuffle" not in SourceSpec(**base, shuffle={}).to_dict()
    assert SourceSpec(**base, shuffle=False).shuffle_settings().mode == "none"
    s = SourceSpec(**base, shuffle={"spread": 64, "window": 1024})
    assert s.shuffle_settings() == Shuffle(spread=64, window=1024)
    assert s.to_dict()["shuffle"] == {"spread": 64, "window": 1024}
    assert SourceSpec.from_dict(s.to_dict()) == s
    f = SourceSpec(**base, shuffle=False)
    assert SourceSpec.from_dict(f.to_dict()) == f
    assert f.to_dict()["shuffle"] is False
    syn = SourceSpec(name="y", format="synthetic", shuffle=False)
    assert SourceSpec.from_dict(syn.to_dict()) == syn


@pytest.mark.parametrize(
    ("value", "message"),
    [
        ("yes", "must be true, false or a table"),
        ({"block": 4}, "unknown key 'block'"),
        ({"mode": "global"}, "mode='global' is not one of"),
        ({"spread": 1}, "spread=1 must be an integer in 2..1024"),
        ({"mode": "file", "spread": 8}, "spread is the mixed order's"),
        ({"mode": "none", "window": 8}, "a fixed order shuffles nothing"),
        ({"window": 0}, "window=0 must be an integer in 1.."),
    ],
)
def test_bad_shuffle_values_name_the_fix(value, message):
    with pytest.raises(ClientConfigError, match=message):
        SourceSpec(name="s", format="jsonl", paths=("/data/a",), shuffle=value)
