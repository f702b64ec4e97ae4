"""Source readers: round trips of real files, the deterministic order, locate/read consistency, bad data."""

from __future__ import annotations

import errno
import logging
import os

import numpy as np
import orjson
import pyarrow as pa
import pyarrow.feather as feather
import pyarrow.parquet as pq
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from msdata_client.graph import SourceSpec
from msdata_server.errors import ConfigError
from msdata_server.sources import FORMATS, BadSample, Source, open_source
from msdata_server.sources import base as base_mod
from msdata_server.sources import jsonl as jsonl_mod
from msdata_server.sources.order import Order, stable_seed, window_starts
from msdata_server.sources.synthetic import EOS, SyntheticSource


def texts(n: int, tag: str = "") -> list[str]:
    return [f"{tag}doc {i} " + "é" * (i % 5) + "x" * (i % 13) for i in range(n)]


def write_parquet(path, rows, row_group_size=37, column="text", **kw):
    pq.write_table(pa.table({column: rows, "other": list(range(len(rows)))}), path, row_group_size=row_group_size, **kw)


def write_arrow(path, rows, chunk=41):
    feather.write_feather(pa.table({"text": rows}), path, chunksize=chunk, compression="uncompressed")


def write_jsonl(path, rows, field="text"):
    with open(path, "wb") as f:
        for r in rows:
            f.write(orjson.dumps({field: r, "n": 1}) + b"\n")


WRITERS = {"parquet": (write_parquet, "parquet"), "arrow": (write_arrow, "arrow"), "jsonl": (write_jsonl, "jsonl")}


def make_source(tmp_path, fmt, *, seed=7, n_files=3, rows_per_file=(120, 0, 95), name="src", **spec_kw):
    """Files of a format in tmp_path/fmt; returns (source, {(file_index, row): text})."""
    write, ext = WRITERS[fmt]
    d = tmp_path / fmt
    d.mkdir(exist_ok=True)
    truth = {}
    for i in range(n_files):
        n = rows_per_file[i % len(rows_per_file)]
        rows = texts(n, tag=f"f{i}-")
        write(d / f"part-{i:02d}.{ext}", rows)
        for r, t in enumerate(rows):
            truth[(i, r)] = t
    spec = SourceSpec(name=name, format=fmt, paths=(str(d),), **spec_kw)
    return open_source(spec, seed=seed), truth


# ---------------------------------------------------------------- round trips and order


@pytest.mark.parametrize("fmt", ["parquet", "arrow", "jsonl"])
def test_round_trip_every_row_once_per_epoch(tmp_path, fmt):
    src, truth = make_source(tmp_path, fmt)
    with src:
        n = src.num_samples
        assert n == len(truth) == 215
        for epoch in range(2):
            ords = np.arange(epoch * n, (epoch + 1) * n)
            recs = src.read(ords)
            ids = src.sample_ids(ords)
            assert len(set(ids.tolist())) == n  # every row exactly once
            e, f, r = src.locate_many(ords)
            assert (e == epoch).all()
            assert np.array_equal(ids, (f << 32) | r)
            assert recs == [truth[(int(a), int(b))] for a, b in zip(f, r)]
            assert sorted(recs) == sorted(truth.values())
        stats = src.statistics()
        assert stats.rows_read == 2 * n
        assert stats.bytes_read > 0
        assert stats.bad_samples == {}
        assert stats.files == 3
        assert stats.index_bytes > 0


@pytest.mark.parametrize("fmt", ["parquet", "jsonl"])
def test_order_reproducible_and_differs_by_seed_and_epoch(tmp_path, fmt):
    a, _ = make_source(tmp_path, fmt, seed=1)
    b, _ = make_source(tmp_path, fmt, seed=1)
    c, _ = make_source(tmp_path, fmt, seed=2)
    n = a.num_samples
    ords = np.arange(n)
    assert np.array_equal(a.sample_ids(ords), b.sample_ids(ords))
    assert not np.array_equal(a.sample_ids(ords), c.sample_ids(ords))
    assert not np.array_equal(a.sample_ids(ords), a.sample_ids(ords + n))  # epochs differ
    assert not np.array_equal(a.sample_ids(ords + n), a.sample_ids(ords + 2 * n))
    for s in (a, b, c):
        s.close()


def test_order_differs_by_source_name(tmp_path):
    a, _ = make_source(tmp_path, "jsonl", name="one")
    b, _ = make_source(tmp_path, "jsonl", name="two")
    ords = np.arange(a.num_samples)
    assert not np.array_equal(a.sample_ids(ords), b.sample_ids(ords))


@pytest.mark.parametrize("fmt", ["parquet", "arrow", "jsonl"])
def test_locate_is_consistent_with_read_in_any_order(tmp_path, fmt):
    src, truth = make_source(tmp_path, fmt, seed=3)
    rng = np.random.default_rng(0)
    ords = rng.integers(0, 5 * src.num_samples, size=150)
    recs = src.read(ords)  # random access, several epochs at once
    for o, rec in zip(ords.tolist(), recs):
        e, f, r = src.locate(o)
        assert e == o // src.num_samples
        assert rec == truth[(f, r)]
    # reading in pieces (as partitions do) yields the same records as one read
    whole = src.read(np.arange(src.num_samples))
    pieces = []
    for lo in range(0, src.num_samples, 64):
        pieces += src.read(np.arange(lo, min(lo + 64, src.num_samples)))
    assert pieces == whole


def test_windows_keep_reads_local(tmp_path):
    """The file-local order (shuffle = { mode = "file" }): consecutive ordinals stay inside one file and one
    window: bounded-window shuffling, not global. (The default mixes files: tests/test_order.py.)"""
    src, _ = make_source(tmp_path, "jsonl", rows_per_file=(3000,), n_files=2, shuffle={"mode": "file"})
    src.order  # noqa: B018
    _, f, r = src.locate_many(np.arange(0, 256))
    assert len(set(f.tolist())) == 1
    assert r.max() - r.min() < 3000
    assert not np.array_equal(np.sort(r), r)  # shuffled inside the window


@settings(max_examples=40, deadline=None)
@given(
    units=st.lists(st.lists(st.integers(0, 60), min_size=0, max_size=5), min_size=1, max_size=6),
    window=st.integers(1, 50),
    seed=st.integers(0, 2**40),
    epoch=st.integers(0, 3),
)
def test_order_is_a_bijection_per_epoch(units, window, seed, epoch):
    arrs = [np.array(u, dtype=np.int64) for u in units]
    order = Order.from_units(seed=seed, name="p", units=arrs, window=window)
    n = order.num_samples
    if n == 0:
        return
    e, f, r = order.locate(np.arange(epoch * n, (epoch + 1) * n))
    assert (e == epoch).all()
    pairs = set(zip(f.tolist(), r.tolist()))
    expected = {(i, row) for i, a in enumerate(arrs) for row in range(int(a.sum()))}
    assert pairs == expected
    # a fresh Order (no caches) agrees: a pure function
    again = Order.from_units(seed=seed, name="p", units=arrs, window=window)
    assert np.array_equal(again.locate(np.arange(epoch * n, (epoch + 1) * n))[2][::-1], r[::-1])


def test_order_window_cache_stays_bounded_over_a_long_walk():
    """A long run walks window after window: the order keeps the newest _WINDOW_CACHE permutations, as int32
    (16 KiB per 4096-row window), so a source's order cache tops out near 0.5 MiB however long the run."""
    from msdata_server.sources import order as order_mod

    order = Order.from_units(seed=3, name="long", units=[np.array([400_000])], window=4096)
    rows = []
    for lo in range(0, 400_000, 5_000):
        rows.append(order.locate(np.arange(lo, lo + 5_000))[2])
    assert np.array_equal(np.sort(np.concatenate(rows)), np.arange(400_000)), "one epoch is not a bijection"
    cached = list(order._windows.values())
    assert len(cached) == order_mod._WINDOW_CACHE
    assert all(a.dtype == np.int32 for a in cached)
    assert sum(a.nbytes for a in cached) <= order_mod._WINDOW_CACHE * 4096 * 4


def test_window_starts_follow_units():
    assert window_starts(np.array([10, 10, 10, 10]), target=20).tolist() == [0, 20]
    assert window_starts(np.array([50]), target=20).tolist() == [0, 20, 40]
    assert window_starts(np.array([5, 0, 50, 5]), target=20).tolist() == [0, 5, 25, 45, 55]
    assert window_starts(np.array([], dtype=np.int64)).tolist() == []


def test_stable_seed_is_stable():
    assert stable_seed(1, "web", 0) == stable_seed(1, "web", 0)
    assert stable_seed(1, "web", 0) != stable_seed(1, "web", 1)
    assert stable_seed(1, "1") != stable_seed(1, 1)
    assert stable_seed(np.int64(5), "a") == stable_seed(5, "a")


# ---------------------------------------------------------------- synthetic


def synth(seed=5, name="syn", **kw):
    return open_source(SourceSpec(name=name, format="synthetic", **kw), seed=seed)


def test_synthetic_documents():
    s = synth(samples=4000, median=200.0, sigma=1.0, min_len=16, max_len=3000)
    assert isinstance(s, SyntheticSource)
    assert s.num_samples == 4000
    ords = np.arange(4000)
    lens = s.lengths(ords)
    assert lens.min() >= 16
    assert lens.max() <= 3000
    assert 170 <= np.median(lens) <= 230
    docs = s.read(ords[:300])
    assert [len(d) for d in docs] == lens[:300].tolist()
    for d in docs:
        assert d.dtype == np.int32
        assert d[-1] == EOS
        assert d[:-1].min() >= 0
        assert d[:-1].max() < 256
    assert len({d.tobytes() for d in docs}) == 300


def test_synthetic_is_pure_and_seeded():
    a, b, c = synth(samples=500), synth(samples=500), synth(seed=6, samples=500)
    ords = np.arange(500)
    da, db = a.read(ords), b.read(ords)
    assert all(np.array_equal(x, y) for x, y in zip(da, db))
    assert not np.array_equal(a.lengths(ords), c.lengths(ords))
    # a row's content is the same in every epoch; the order is not
    e0, e1 = a.read(ords), a.read(ords + 500)
    by_id0 = {int(i): d.tobytes() for i, d in zip(a.sample_ids(ords), e0)}
    by_id1 = {int(i): d.tobytes() for i, d in zip(a.sample_ids(ords + 500), e1)}
    assert by_id0 == by_id1
    assert not np.array_equal(a.sample_ids(ords), a.sample_ids(ords + 500))
    assert sorted(by_id0) == list(range(500))


def test_synthetic_constant_length_and_bad_options():
    s = synth(samples=10, median=50.0, sigma=0.0, min_len=1, max_len=100)
    assert s.lengths(np.arange(10)).tolist() == [50] * 10
    with pytest.raises(ConfigError, match="samples"):
        SyntheticSource(_Spec(name="x", format="synthetic", samples=0), seed=0)
    with pytest.raises(ConfigError, match="min_len"):
        SyntheticSource(_Spec(name="x", format="synthetic", min_len=10, max_len=5), seed=0)


class _Spec:
    """A spec that skips SourceSpec's own validation, to test the source's."""

    def __init__(self, **kw):
        defaults = dict(
            paths=(),
            column="text",
            transform=None,
            max_sample_bytes=64 << 20,
            samples=100,
            median=64.0,
            sigma=1.0,
            min_len=16,
            max_len=1024,
        )
        defaults.update(kw)
        self.__dict__.update(defaults)


# ---------------------------------------------------------------- paths and configuration errors


def test_formats_table():
    assert sorted(FORMATS) == ["arrow", "jsonl", "parquet", "synthetic", "webdataset"]
    assert all(issubclass(c, Source) for c in FORMATS.values())
    with pytest.raises(ConfigError, match="unknown format 'csv'"):
        open_source(_Spec(name="x", format="csv"), seed=0)


def test_paths_dirs_globs_and_hidden_files(tmp_path):
    (tmp_path / "d" / "sub").mkdir(parents=True)
    write_jsonl(tmp_path / "d" / "b.jsonl", ["b"])
    write_jsonl(tmp_path / "d" / "sub" / "a.jsonl", ["a"])
    write_jsonl(tmp_path / "d" / ".hidden.jsonl", ["h"])
    write_jsonl(tmp_path / "d" / "_SUCCESS.jsonl", ["s"])
    (tmp_path / "d" / "notes.txt").write_text("x")
    write_jsonl(tmp_path / "c.jsonl", ["c"])
    src = open_source(
        SourceSpec(
            name="p", format="jsonl", paths=(str(tmp_path / "d"), str(tmp_path / "*.jsonl"), str(tmp_path / "c.jsonl"))
        ),
        seed=0,
    )
    assert [os.path.relpath(p, tmp_path) for p in src.paths] == ["d/b.jsonl", "d/sub/a.jsonl", "c.jsonl"]
    assert sorted(src.read(np.arange(3))) == ["a", "b", "c"]


def test_no_files_matched_names_source_and_path(tmp_path):
    with pytest.raises(ConfigError, match=r"source 'web': no files matched '.*nothing-\*\.parquet'"):
        open_source(SourceSpec(name="web", format="parquet", paths=(str(tmp_path / "nothing-*.parquet"),)), seed=0)
    with pytest.raises(ConfigError, match=r"source 'web': path '.*missing.parquet' does not exist"):
        open_source(SourceSpec(name="web", format="parquet", paths=(str(tmp_path / "missing.parquet"),)), seed=0)
    (tmp_path / "empty").mkdir()
    with pytest.raises(ConfigError, match="a directory with no"):
        open_source(SourceSpec(name="web", format="parquet", paths=(str(tmp_path / "empty"),)), seed=0)


@pytest.mark.parametrize("fmt", ["parquet", "arrow", "jsonl"])
def test_missing_column_lists_the_columns(tmp_path, fmt):
    make_source(tmp_path, fmt)
    with pytest.raises(ConfigError, match=r"no (column|field) 'body'.*(columns|fields) are \[.*'text'"):
        open_source(SourceSpec(name="s", format=fmt, paths=(str(tmp_path / fmt),), column="body"), seed=0)


def test_all_files_unreadable_is_a_config_error(tmp_path):
    (tmp_path / "a.parquet").write_bytes(b"not parquet at all")
    with pytest.raises(ConfigError, match=r"none of its 1 parquet file\(s\) could be read"):
        open_source(SourceSpec(name="s", format="parquet", paths=(str(tmp_path),)), seed=0)


# ---------------------------------------------------------------- bad data


def test_truncated_parquet_file_is_skipped(tmp_path, caplog):
    src, truth = make_source(tmp_path, "parquet", n_files=2, rows_per_file=(60,))
    src.close()
    good = tmp_path / "parquet" / "part-00.parquet"
    data = good.read_bytes()
    (tmp_path / "parquet" / "part-01.parquet").write_bytes(data[: len(data) // 2])  # truncated
    with caplog.at_level(logging.ERROR, logger="msdata_server.sources.base"):
        src = open_source(SourceSpec(name="s", format="parquet", paths=(str(tmp_path / "parquet"),)), seed=0)
    assert src.num_samples == 60
    assert src.statistics().files_skipped == 1
    assert src.statistics().bad_samples == {"corrupt_file": 1}
    assert sum("part-01.parquet" in r.getMessage() for r in caplog.records) == 1
    assert sorted(src.read(np.arange(60))) == sorted(t for (f, _), t in truth.items() if f == 0)


def test_corrupt_row_group_found_at_read(tmp_path):
    path = tmp_path / "c.parquet"
    rows = [f"row {i} " + "z" * 50 for i in range(300)]
    pq.write_table(
        pa.table({"text": rows}),
        path,
        row_group_size=100,
        write_page_checksum=True,
        compression="none",
        use_dictionary=False,
    )
    md = pq.ParquetFile(path).metadata
    col = md.row_group(1).column(0)
    start = col.data_page_offset
    data = bytearray(path.read_bytes())
    mid = start + col.total_compressed_size // 2
    data[mid : mid + 16] = b"\x00" * 16  # damage the middle row group's data page, keep the footer
    path.write_bytes(bytes(data))
    src = open_source(SourceSpec(name="s", format="parquet", paths=(str(path),)), seed=0)
    recs = src.read(np.arange(300))
    _, _, r = src.locate_many(np.arange(300))
    bad = [x for x in recs if isinstance(x, BadSample)]
    assert len(bad) == 100
    assert {b.reason for b in bad} == {"corrupt"}
    assert all(isinstance(x, BadSample) == (100 <= row < 200) for x, row in zip(recs, r.tolist()))
    assert sorted(x for x in recs if isinstance(x, str)) == sorted(rows[:100] + rows[200:])
    assert src.statistics().bad_samples == {"corrupt": 100}


def test_jsonl_bad_lines(tmp_path, caplog):
    path = tmp_path / "d.jsonl"
    lines = [
        orjson.dumps({"text": "good 0"}),
        b"{not json",
        orjson.dumps({"other": "no text field"}),
        b'{"text": "bad utf8 \xff\xfe"}',
        orjson.dumps([1, 2, 3]),
        b"",  # blank lines are not samples
        orjson.dumps({"text": "good 1"}),
        orjson.dumps({"text": "x" * 500}),  # oversize with max_sample_bytes=200
    ]
    path.write_bytes(b"\n".join(lines))  # no newline at the end
    src = open_source(SourceSpec(name="j", format="jsonl", paths=(str(path),), max_sample_bytes=200), seed=0)
    assert src.num_samples == 7
    with caplog.at_level(logging.WARNING, logger="msdata_server.sources.base"):
        recs = src.read(np.arange(14))  # two epochs: each bad row is counted twice, logged once
    good = sorted(r for r in recs if isinstance(r, str))
    assert good == ["good 0", "good 0", "good 1", "good 1"]
    stats = src.statistics().bad_samples
    assert stats == {"bad_json": 4, "missing_field": 2, "invalid_utf8": 2, "oversize": 2}
    msgs = [r.getMessage() for r in caplog.records]
    assert len(msgs) == 5
    assert all("d.jsonl row" in m for m in msgs)


def test_oversize_and_null_in_arrow_columns(tmp_path):
    path = tmp_path / "a.arrow"
    feather.write_feather(pa.table({"text": ["small", "x" * 1000, None, "tiny"]}), path)
    src = open_source(SourceSpec(name="a", format="arrow", paths=(str(path),), max_sample_bytes=100), seed=0)
    recs = src.read(np.arange(4))
    reasons = sorted(r.reason for r in recs if isinstance(r, BadSample))
    assert reasons == ["missing_field", "oversize"]
    assert sorted(r for r in recs if isinstance(r, str)) == ["small", "tiny"]


def test_invalid_utf8_in_a_parquet_string_column(tmp_path):
    raw = [b"fine", b"bad \xff", b"also fine"]
    offsets = np.cumsum([0] + [len(b) for b in raw]).astype(np.int32)
    arr = pa.Array.from_buffers(pa.string(), 3, [None, pa.py_buffer(offsets.tobytes()), pa.py_buffer(b"".join(raw))])
    pq.write_table(pa.table({"text": arr}), tmp_path / "u.parquet")
    src = open_source(SourceSpec(name="u", format="parquet", paths=(str(tmp_path),)), seed=0)
    recs = src.read(np.arange(3))
    assert sorted(r for r in recs if isinstance(r, str)) == ["also fine", "fine"]
    assert [r.reason for r in recs if isinstance(r, BadSample)] == ["invalid_utf8"]


def test_pretokenized_list_column(tmp_path):
    docs = [[1, 2, 3], [4], list(range(100))]
    pq.write_table(pa.table({"ids": pa.array(docs, type=pa.list_(pa.int32()))}), tmp_path / "t.parquet")
    src = open_source(
        SourceSpec(name="t", format="parquet", paths=(str(tmp_path),), column="ids", transform=None), seed=0
    )
    recs = src.read(np.arange(3))
    assert sorted(r.tolist() for r in recs) == sorted(docs)
    assert all(isinstance(r, np.ndarray) for r in recs)


def test_arrow_stream_format(tmp_path):
    path = tmp_path / "s.arrows"
    table = pa.table({"text": texts(50)})
    with pa.OSFile(str(path), "wb") as sink, pa.ipc.new_stream(sink, table.schema) as w:
        for b in table.to_batches(max_chunksize=16):
            w.write_batch(b)
    src = open_source(SourceSpec(name="s", format="arrow", paths=(str(path),)), seed=0)
    assert sorted(src.read(np.arange(50))) == sorted(texts(50))


def test_transient_errors_are_retried(tmp_path, monkeypatch):
    src, truth = make_source(tmp_path, "jsonl", n_files=1, rows_per_file=(10,))
    monkeypatch.setattr(base_mod.FileSource, "backoff", 0.0)
    real = os.pread
    failures = {"left": 2}

    def flaky(fd, n, off):
        if failures["left"]:
            failures["left"] -= 1
            raise OSError(errno.EIO, "Input/output error")
        return real(fd, n, off)

    monkeypatch.setattr(os, "pread", flaky)
    assert sorted(src.read(np.arange(10))) == sorted(truth.values())
    assert failures["left"] == 0
    assert src.statistics().bad_samples == {}

    def broken(fd, n, off):
        raise OSError(errno.EIO, "Input/output error")

    monkeypatch.setattr(os, "pread", broken)
    recs = src.read(np.arange(10))
    assert all(isinstance(r, BadSample) and r.reason == "read_error" for r in recs)


def test_many_files_keep_few_handles_open(tmp_path, monkeypatch):
    monkeypatch.setattr(jsonl_mod.JsonlSource, "max_open", 2)
    d = tmp_path / "many"
    d.mkdir()
    for i in range(6):
        write_jsonl(d / f"{i}.jsonl", [f"{i}-{k}" for k in range(5)])
    src = open_source(SourceSpec(name="m", format="jsonl", paths=(str(d),)), seed=0)
    recs = src.read(np.arange(30))
    assert sorted(recs) == sorted(f"{i}-{k}" for i in range(6) for k in range(5))
    assert src.statistics().open_files <= 2
    src.close()
    assert src.statistics().open_files == 0


@pytest.mark.parametrize(
    "module",
    [
        "sources",
        "sources.base",
        "sources.order",
        "sources.paths",
        "sources.parquet",
        "sources.arrow",
        "sources.jsonl",
        "sources.synthetic",
        "transforms",
        "pool",
        "pool.worker",
        "pool.pool",
        "loader.loader",
        "local",
        "document",
        "loader",
    ],
)
def test_all_is_sorted_and_importable(module):
    import importlib

    mod = importlib.import_module(f"msdata_server.{module}")
    assert mod.__all__ == sorted(mod.__all__)
    assert all(hasattr(mod, n) for n in mod.__all__)


def test_server_modules_do_not_import_torch():
    import subprocess
    import sys

    code = "import sys, msdata_server.loader, msdata_server.pool, msdata_server.sources; print('torch' in sys.modules)"
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)}
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, env=env)
    assert out.stdout.strip() == "False"
