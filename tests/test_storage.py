"""Sources in object storage (issue 27), against a real S3 API on loopback (moto) behind a fault proxy: the same
files local and in a bucket give the same files in the same order and bit-identical records and batches, with
and without throttling and resets; bad input is a clear error naming the source, the path and the cause."""

from __future__ import annotations

import dataclasses
import os
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest

import msdata_client as msd
from msdata_client.source import SourceSpec
from msdata_server.config import StorageConfig, parse_config
from msdata_server.errors import ConfigError, StorageError
from msdata_server.sources import BadSample, open_source
from msdata_server.sources.base import meta_identity
from msdata_server.storage import configure, is_uri
from msdata_server.storage.cache import DiskCache
from msdata_server.storage.listing import ListedFile
from msdata_server.storage.uri import check_uri, fixed_part, glob_regex

from .cluster_util import run_spread, spread
from .e2e_util import run_ranks, status_json
from .polling import wait_for
from .s3_util import ACCESS_KEY, SECRET_KEY, FaultProxy, MotoS3, s3_env, write_formats

FORMATS = ("parquet", "jsonl", "arrow", "webdataset")


@pytest.fixture(scope="module")
def s3(tmp_path_factory):
    """moto on loopback with every format uploaded to bucket "data" (same relative paths as on disk)."""
    root = tmp_path_factory.mktemp("local")
    dirs = write_formats(root)
    mp = pytest.MonkeyPatch()
    s3_env(mp)
    server = MotoS3()
    server.upload(root, "data")
    yield server, root, dirs
    server.stop()
    mp.undo()


@pytest.fixture
def proxy(s3, monkeypatch):
    """The fault proxy in front of moto, the process's store pointed at it (short give-up for the tests)."""
    s3_env(monkeypatch)
    p = FaultProxy(s3[0])
    store = configure(StorageConfig(s3_endpoint=p.endpoint, s3_region="us-east-1", give_up_s=20))
    p.store = store
    yield p
    p.stop()
    configure(StorageConfig())


def _spec(fmt: str, paths: list[str], name: str = "s") -> SourceSpec:
    kw = {} if fmt == "webdataset" else {"column": "text"}
    return SourceSpec(name=name, format=fmt, paths=tuple(paths), **kw)


def _assert_same(fmt: str, local: str, remote: str, root: Path, *, seed: int = 5) -> None:
    a = open_source(_spec(fmt, [local]), seed=seed)
    b = open_source(_spec(fmt, [remote]), seed=seed)
    try:
        assert [os.path.relpath(p, root) for p in a.paths] == [p.removeprefix("s3://data/") for p in b.paths]
        assert all(is_uri(p) for p in b.paths)
        ords = np.arange(0, 2 * a.num_samples, 3)  # two epochs, every third ordinal
        assert a.num_samples == b.num_samples
        assert a.read(ords) == b.read(ords)
        assert np.array_equal(a.sample_ids(ords), b.sample_ids(ords))
        assert b.statistics().bad_samples == {}
    finally:
        a.close()
        b.close()


# ---- pure parts ----------------------------------------------------------------------------------------------
def test_glob_and_fixed_part_follow_local_glob_rules():
    assert fixed_part("data/a/*.parquet") == "data/a/"
    assert fixed_part("data/a/x.parquet") == "data/a/x.parquet"
    rx = glob_regex("**/*.parquet")
    assert rx.match("x.parquet")
    assert rx.match("a/b/x.parquet")
    assert not rx.match("a/.h/x.parquet")
    assert not rx.match("x.parquet.tmp")
    one = glob_regex("part-[0-1].jsonl")
    assert one.match("part-1.jsonl")
    assert not one.match("part-2.jsonl")
    assert not one.match("sub/part-1.jsonl")


def test_credentials_in_a_uri_are_refused_without_repeating_them():
    for uri in ("s3://AKIAXYZ:topsecret@bucket/x/", "s3://bucket/x/?X-Amz-Signature=topsecret"):
        with pytest.raises(ConfigError, match="credentials") as e:
            check_uri(uri, where="source 's'")
        assert "topsecret" not in str(e.value)


def test_storage_section_of_node_toml():
    cfg = parse_config({"storage": {"s3_endpoint": "http://127.0.0.1:9000", "max_inflight": 8}}).storage
    assert (cfg.max_inflight, cfg.give_up_s, cfg.retries) == (8, 600.0, 100)
    assert parse_config({}).storage.max_inflight == 64
    with pytest.raises(ConfigError, match=r"credentials never go in node.toml.*AWS_ACCESS_KEY_ID") as e:
        parse_config({"storage": {"secret_access_key": "hunter2"}})
    assert "hunter2" not in str(e.value)
    for bad, match in (
        ({"max_inflight": 0}, "max_inflight"),
        ({"max_inflight": 10**6}, "max_inflight"),
        ({"s3_endpoint": "127.0.0.1:9000"}, "with its scheme"),
        ({"give_up_s": -1}, "give_up_s"),
        ({"cache_gib": 1}, "cache_dir"),
    ):
        with pytest.raises(ConfigError, match=match):
            parse_config({"storage": bad})


def test_kept_metadata_round_trips_packed_and_unpacked_fields(tmp_path):
    """A field's arrays of every file are kept as one member (any dtype and trailing shape, files without it);
    a field whose arrays differ in dtype or shape is kept per file. What comes back equals what went in."""
    from msdata_server.storage import MetaCache, SourceMeta

    n = 9
    files = [ListedFile(f"s3://b/x{i}", 100 + i, 5, "e") for i in range(n)]
    units = [np.arange(i % 3, dtype=np.int64) for i in range(n)]
    arrays = [
        {}
        if i == 4  # a skipped file: nothing kept
        else {
            "footer": np.frombuffer(bytes([i]) * (50 + i), np.uint8),
            "pairs": np.full((i, 2), i, np.int16),
            "mixed": np.zeros(2, np.int32) if i % 2 else np.zeros(3, np.int64),
        }
        for i in range(n)
    ]
    cache = MetaCache(str(tmp_path))
    cache.save({"id": 1}, SourceMeta(files, units, {4: "bad"}, arrays, {"k": [1]}))
    got = cache.load({"id": 1})
    assert got is not None
    assert (got.files, got.skipped, got.extra) == (files, {4: "bad"}, {"k": [1]})
    for i in range(n):
        assert got.units[i].dtype == np.int64
        assert np.array_equal(got.units[i], units[i])
        assert set(got.arrays[i]) == set(arrays[i])
        for k, a in arrays[i].items():
            b = got.arrays[i][k]
            assert (b.dtype, b.shape) == (a.dtype, a.shape)
            assert np.array_equal(b, a)
    assert cache.load({"id": 2}) is None


# ---- same files, same records ---------------------------------------------------------------------------------
@pytest.mark.parametrize("fmt", FORMATS)
def test_a_bucket_gives_the_local_files_and_records(s3, proxy, fmt):
    _, root, dirs = s3
    _assert_same(fmt, str(dirs[fmt]), f"s3://data/{fmt}/", root)  # a directory: listed recursively
    ext = {"parquet": "parquet", "jsonl": "jsonl", "arrow": "arrow", "webdataset": "tar"}[fmt]
    _assert_same(fmt, f"{dirs[fmt]}/**/*.{ext}", f"s3://data/{fmt}/**/*.{ext}", root)  # a glob
    st = proxy.store.stats.snapshot()
    assert st["requests"] > 0
    assert st["bytes"] > 0
    assert st["errors"] == 0


def test_throttling_and_resets_change_nothing(s3, proxy):
    _, root, dirs = s3
    proxy.slowdown_share, proxy.reset_share = 0.15, 0.05
    proxy.burst(3.0)  # longer than an SDK's own quick retries
    for fmt in ("parquet", "webdataset", "jsonl"):
        _assert_same(fmt, str(dirs[fmt]), f"s3://data/{fmt}/", root, seed=9)
    st = proxy.store.stats.snapshot()
    assert proxy.faults["slowdown"] > 0
    assert proxy.faults["reset"] > 0
    assert st["throttled"] > 0
    assert st["retries"] >= st["throttled"]
    assert st["errors"] == 0


# ---- bad input ------------------------------------------------------------------------------------------------
def test_bad_paths_are_clear_errors(s3, proxy):
    for path, match in (
        ("s3://no-such-bucket/x/", "bucket 'no-such-bucket' does not exist"),
        ("s3://data/parquet/*.nothing", "no objects matched 's3://data/parquet/\\*.nothing'.*glob"),
        ("s3://data/nowhere/", "no objects matched"),
    ):
        with pytest.raises(ConfigError, match=match) as e:
            open_source(_spec("parquet", [path], name="web"), seed=0)
        assert "source 'web'" in str(e.value)
    with pytest.raises(ConfigError, match=r"none of its 3 parquet file.*s3://data/jsonl/.*valid parquet"):
        open_source(_spec("parquet", ["s3://data/jsonl/**/*.jsonl"], name="web"), seed=0)  # another format


def test_wrong_credentials_are_a_clear_error_without_the_secret(s3, proxy, monkeypatch):
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", "wrong-key")
    configure(StorageConfig(s3_endpoint=proxy.endpoint, give_up_s=5))
    with pytest.raises(ConfigError, match=r"source 'web'.*access denied.*AWS_ACCESS_KEY_ID") as e:
        open_source(_spec("parquet", ["s3://data/parquet/"], name="web"), seed=0)
    assert "403" in str(e.value)
    assert SECRET_KEY not in str(e.value)
    assert proxy.faults["denied"] >= 1


def test_an_endpoint_that_does_not_answer_is_a_clear_error(s3, proxy):
    import socket

    with socket.socket() as s:  # a port nobody listens on
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    configure(StorageConfig(s3_endpoint=f"http://127.0.0.1:{port}", give_up_s=1.0))
    with pytest.raises(ConfigError, match=r"source 'web'.*s3://data/parquet/.*endpoint does not answer"):
        open_source(_spec("parquet", ["s3://data/parquet/"], name="web"), seed=0)


# ---- failures while reading -----------------------------------------------------------------------------------
def test_give_up_fails_or_skips_as_the_job_says(s3, proxy):
    configure(StorageConfig(s3_endpoint=proxy.endpoint, give_up_s=1.0))
    src = open_source(_spec("parquet", ["s3://data/parquet/"]), seed=0)
    skip = open_source(_spec("parquet", ["s3://data/parquet/"]), seed=0, on_read_error="skip")
    src.trim(), skip.trim()  # drop the handles the scan kept: the reads below must go to the store
    proxy.burst(30.0)  # throttled for longer than give_up_s
    with pytest.raises(StorageError, match=r"object s3://data/parquet/.*\.parquet.*last status 503"):
        src.read(np.arange(4))
    recs = skip.read(np.arange(4))
    assert all(isinstance(r, BadSample) and r.reason == "storage_error" for r in recs)
    assert skip.statistics().bad_samples == {"storage_error": 4}
    proxy.burst(0.0)
    assert all(isinstance(r, str) for r in skip.read(np.arange(4)))  # not cached as bad: read again when it works
    src.close(), skip.close()


def test_an_object_changed_under_a_running_source_is_named(s3, proxy, tmp_path):
    """Found at the object's next open (a HEAD): the store keeps an object open for every reader of it and
    opens it again when it was opened longer than revalidate_s ago (300 s; 0 here: at every read)."""
    server, _, dirs = s3
    server.upload(dirs["jsonl"], "changing")
    proxy.store.revalidate_s = 0.0
    src = open_source(_spec("jsonl", ["s3://changing/"]), seed=0)
    src.trim()
    target = src.paths[0].removeprefix("s3://")
    server.put(target, b'{"text": "shorter now"}\n')
    with pytest.raises(StorageError, match=f"{src.paths[0]} changed since it was listed"):
        src.read(np.arange(src.num_samples))
    src.close()


def test_an_object_is_opened_once_for_all_its_readers(s3, proxy):
    """An object's open (pyarrow's HEAD) is shared by every reader of it in the process: a source's handle
    closed and opened again, another source over it; opened again only after revalidate_s."""
    store = proxy.store
    objs = store.list_entry("s", "s3://data/jsonl/", (".jsonl",))
    proxy.reset_counts()
    for k in range(3):  # other ranges each round: none served from the ranges kept in memory
        for obj in objs:
            f = store.open(obj)
            assert store.read(f, 10 * k, 7) == _range(s3[1], obj, 10 * k, 7)
            f.close()
    assert (proxy.counts.get("HEAD", 0), proxy.counts.get("GET", 0)) == (len(objs), 3 * len(objs)), proxy.counts
    store.revalidate_s = 0.0
    for obj in objs:
        with store.open(obj) as f:
            store.read(f, 40, 7)
    assert proxy.counts.get("HEAD", 0) == 2 * len(objs), proxy.counts


def _range(root: Path, obj: ListedFile, offset: int, n: int) -> bytes:
    data = (root / obj.path.removeprefix("s3://data/")).read_bytes()
    return data[offset : offset + n]


def test_an_object_rewritten_with_the_same_size_is_named(s3, proxy, tmp_path):
    """pyarrow's open of an object is a HEAD, which answers its ETag and Last-Modified: a rewrite of the same
    size is named at the object's next open, under a running source (the store opens an object held longer than
    revalidate_s again; 0 here) and after a restart (the listing kept in state_dir); no request is added."""
    server, _, dirs = s3
    server.upload(dirs["jsonl"], "samesize")
    store = configure(StorageConfig(s3_endpoint=proxy.endpoint, give_up_s=2), state_dir=str(tmp_path / "state"))
    store.revalidate_s = 0.0
    src = open_source(_spec("jsonl", ["s3://samesize/"]), seed=0)
    ords = np.arange(src.num_samples)
    _, files, rows = src.locate_many(ords)
    mine = ords[files == 0][np.argsort(rows[files == 0])]
    src.read(mine[:5])
    listed = src.files[0].mtime_ns // 1_000_000_000
    wait_for(lambda: time.time() >= listed + 1.05, 5, "the clock past the second the object was written in")
    target = src.paths[0].removeprefix("s3://")
    with server.fs().open_input_file(target) as fh:
        data = fh.read()
    server.put(target, data.replace(b"doc", b"DOC"))  # the same size, other bytes
    with pytest.raises(StorageError, match=f"object {src.paths[0]} changed since it was listed"):
        src.read(mine[-5:])
    src.close()
    configure(StorageConfig(s3_endpoint=proxy.endpoint, give_up_s=2), state_dir=str(tmp_path / "state"))
    proxy.reset_counts()
    again = open_source(_spec("jsonl", ["s3://samesize/"]), seed=0)  # from state_dir: nothing listed
    assert proxy.total() == 0
    with pytest.raises(StorageError, match=f"object {src.paths[0]} changed since it was listed .modified at"):
        again.read(mine[:1])
    again.read(ords[files == 1][:3])  # the other objects read on
    again.close()


# ---- end to end: a server reading a bucket --------------------------------------------------------------------
def _job(paths: dict[str, str], name: str = "remote", dp: int = 2):
    g = msd.DGraph(name, seed=11)
    for src, p in paths.items():
        fmt = src
        g.source(src, fmt, [p], column="text", transform="msdata_server.transforms:byte_tokens")
    g.mix({s: 1.0 for s in paths}).pack(256, micro_batches=2, rows=2).mesh(dp=dp).prefetch(2)
    return g.plan()


_status = status_json  # the one status helper (e2e_util)


def test_a_job_over_a_bucket_gives_the_local_batches(s3, proxy, server_factory):
    _, _, dirs = s3
    fmts = ("parquet", "jsonl", "arrow")
    local = _job({f: str(dirs[f]) for f in fmts})
    remote = _job({f: f"s3://data/{f}/" for f in fmts})
    proxy.slowdown_share, proxy.reset_share, proxy.latency_s = 0.1, 0.03, 0.002
    extra = f'\n[storage]\ns3_endpoint = "{proxy.endpoint}"\nmax_inflight = 8\ngive_up_s = 30\n'
    srv = server_factory(workers=0, extra=extra).start()
    want = run_ranks(local, srv.socket, 12)
    got = run_ranks(remote, srv.socket, 12)
    assert got == want
    assert len(want[0]) == 12
    st = _status(srv.socket)["storage"]
    assert set(st) >= {"requests", "bytes", "retries", "throttled", "errors", "latency_ms_p50", "latency_ms_p99"}
    assert st["requests"] > 0
    assert st["throttled"] > 0
    assert st["errors"] == 0
    assert ACCESS_KEY not in srv.log()
    assert SECRET_KEY not in srv.log()


def test_a_job_stops_with_the_object_named_when_reads_give_up(s3, proxy, server_factory):
    _, _, _dirs = s3
    spec = _job({"parquet": "s3://data/parquet/"}, name="giveup")
    extra = f'\n[storage]\ns3_endpoint = "{proxy.endpoint}"\ngive_up_s = 1\n'
    srv = server_factory(workers=0, extra=extra).start()
    run_ranks(spec, srv.socket, 1)  # the listing and footers are kept in state_dir
    srv.stop()
    srv.start()  # nothing read in memory any more
    proxy.deny = True  # every request refused from now on (403: not retried)
    with pytest.raises(msd.errors.MsdataError, match=r"s3://data/parquet/.*status 403"):
        run_ranks(spec, srv.socket, 400, timeout=60)
    proxy.deny = False
    skip = dataclasses.replace(_job({"parquet": "s3://data/parquet/"}, name="skips"), on_read_error="skip")
    assert len(run_ranks(skip, srv.socket, 2)[0]) == 2  # the server goes on serving other jobs


# ---- listing and metadata once ---------------------------------------------------------------------------------
@pytest.mark.parametrize("fmt", FORMATS)
def test_a_restart_opens_without_listing_or_footers(s3, proxy, fmt, tmp_path):
    _, _root, dirs = s3
    configure(StorageConfig(s3_endpoint=proxy.endpoint), state_dir=str(tmp_path / "state"))
    cold = open_source(_spec(fmt, [f"s3://data/{fmt}/"]), seed=2)
    cold.close()
    assert proxy.counts.get("LIST", 0) >= 1
    if fmt == "parquet":  # the listing, then one suffix read of the footer per object (no HEAD: listed sizes)
        assert proxy.counts.get("HEAD", 0) == 0, proxy.counts
        assert proxy.total() == 1 + len(cold.paths), proxy.counts
    proxy.reset_counts()
    warm = open_source(_spec(fmt, [f"s3://data/{fmt}/"]), seed=2)
    assert proxy.total() == 0  # no listing, no footer, no index read: all from state_dir
    local = open_source(_spec(fmt, [str(dirs[fmt])]), seed=2)
    ords = np.arange(0, local.num_samples, 2)
    assert warm.paths == cold.paths
    assert warm.read(ords) == local.read(ords)
    warm.close(), local.close()


class _Share:
    """A MetaCache.share that hands out fixed bytes (in a cluster: the leader's kept file, cluster/metashare.py)."""

    def __init__(self, blob: bytes):
        self.blob, self.asked = blob, 0

    def fetch(self, identity, spec) -> bytes:
        self.asked += 1
        return self.blob


def test_another_nodes_kept_metadata_opens_a_source_without_listing(s3, proxy, tmp_path):
    spec = _spec("parquet", ["s3://data/parquet/"])
    first = configure(StorageConfig(s3_endpoint=proxy.endpoint), state_dir=str(tmp_path / "a"))
    cold = open_source(spec, seed=2)
    assert first.meta is not None
    blob = first.meta.read_bytes(meta_identity(spec))
    assert blob is not None
    for given, listed in ((blob, False), (b"not a metadata file", True)):  # a foreign or torn copy: listed here
        store = configure(StorageConfig(s3_endpoint=proxy.endpoint), state_dir=str(tmp_path / f"b{int(listed)}"))
        assert store.meta is not None
        store.meta.share = share = _Share(given)
        proxy.reset_counts()
        src = open_source(spec, seed=2)
        assert share.asked == 1
        assert (proxy.counts.get("LIST", 0) > 0) is listed, proxy.counts
        assert src.paths == cold.paths
        assert src.read(np.arange(10)) == cold.read(np.arange(10))
        src.close()
        proxy.reset_counts()
        open_source(spec, seed=2).close()  # kept here now: neither asked again nor listed
        assert share.asked == 1
        assert proxy.total() == 0
    cold.close()


def test_changed_or_vanished_objects_after_a_restart_are_named(s3, proxy, tmp_path):
    server, _, dirs = s3
    server.upload(dirs["parquet"], "evolving")
    configure(StorageConfig(s3_endpoint=proxy.endpoint, give_up_s=2), state_dir=str(tmp_path / "state"))
    open_source(_spec("parquet", ["s3://evolving/"]), seed=0).close()
    first, second = "evolving/part-0.parquet", "evolving/part-1.parquet"
    server.put(first, b"PAR1 a different object PAR1")
    server.fs().delete_file(second)
    src = open_source(_spec("parquet", ["s3://evolving/"]), seed=0)  # from state_dir: nothing listed
    ords = np.arange(src.num_samples)
    _, files, _ = src.locate_many(ords)
    with pytest.raises(StorageError, match=f"s3://{first} changed since it was listed"):
        src.read(ords[files == 0][:1])
    with pytest.raises(StorageError, match=f"object s3://{second}: the object does not exist.*status 404"):
        src.read(ords[files == 1][:1])
    src.close()


def test_a_server_restart_starts_the_job_without_listing(s3, proxy, server_factory):
    _, _, _dirs = s3
    spec = _job({"parquet": "s3://data/parquet/", "jsonl": "s3://data/jsonl/"}, name="restart")
    extra = f'\n[storage]\ns3_endpoint = "{proxy.endpoint}"\n'
    srv = server_factory(workers=0, extra=extra).start()
    first = run_ranks(spec, srv.socket, 6)
    assert proxy.counts.get("LIST", 0) == 2  # once per source: the data-change check's listing is kept for the open
    srv.stop()
    proxy.reset_counts()
    srv.start()
    assert run_ranks(spec, srv.socket, 6) == first
    assert proxy.counts.get("LIST", 0) == 0  # listings and footers came from state_dir


def test_validate_lists_and_checks_remote_paths(s3, proxy, tmp_path):
    node = tmp_path / "node.toml"
    node.write_text(f'[node]\nid = "n1"\nsocket = "{tmp_path}/s.sock"\n[storage]\ns3_endpoint = "{proxy.endpoint}"\n')
    job = tmp_path / "job.toml"
    job.write_text(
        '[job]\nname = "v"\nseq_len = 512\n[mesh]\ndp = 1\n[[source]]\nname = "web"\nformat = "parquet"\n'
        'paths = ["s3://data/parquet/**/*.parquet"]\n[mix]\nweights = { web = 1.0 }\n'
    )

    def validate():
        return subprocess.run(
            [sys.executable, "-m", "msdata_server", "validate", "--config", str(node), "--job", str(job)],
            capture_output=True,
            text=True,
            timeout=120,
        )

    out = validate()
    assert out.returncode == 0, out.stderr
    assert "source web (parquet): 900 samples" in out.stdout
    assert "3 object(s)" in out.stdout
    assert "s3://data/parquet/part-0.parquet" in out.stdout
    job.write_text(job.read_text().replace("s3://data/parquet/", "s3://data/missing/"))
    out = validate()
    assert out.returncode != 0
    assert "Traceback" not in out.stderr
    assert "source 'web'" in out.stderr
    assert "no objects matched 's3://data/missing/**/*.parquet'" in out.stderr


# ---- the node's on-disk object cache ---------------------------------------------------------------------------
@pytest.mark.parametrize("fmt", ["parquet", "webdataset"])
def test_the_cache_serves_a_second_epoch_and_a_restart(s3, proxy, fmt, tmp_path):
    state, cache = str(tmp_path / "state"), str(tmp_path / "cache")
    cfg = StorageConfig(s3_endpoint=proxy.endpoint, cache_dir=cache, cache_gib=0.01)
    store = configure(cfg, state_dir=state)
    open_source(_spec(fmt, [f"s3://data/{fmt}/"]), seed=4).close()  # listed, footers kept in state_dir
    src = open_source(_spec(fmt, [f"s3://data/{fmt}/"]), seed=4)  # reads its ranges through the store
    n = src.num_samples
    first = src.read(np.arange(n))
    src.close()
    proxy.reset_counts()
    store = configure(cfg, state_dir=state)  # nothing read lately in memory: the second epoch's ranges on disk
    src = open_source(_spec(fmt, [f"s3://data/{fmt}/"]), seed=4)  # nothing decoded or open
    second = src.read(np.arange(n, 2 * n))  # the second epoch: the same samples, in another order
    assert sorted(map(repr, second)) == sorted(map(repr, first))
    assert proxy.total() == 0, (proxy.counts, store.stats.snapshot())
    assert store.stats.snapshot()["cache_hits"] > 0, (proxy.counts, store.stats.snapshot())
    src.close()
    restarted = configure(cfg, state_dir=state)  # a new server process: same state_dir, same cache_dir
    again = open_source(_spec(fmt, [f"s3://data/{fmt}/"]), seed=4)
    assert again.read(np.arange(n)) == first
    assert proxy.total() == 0
    assert restarted.stats.snapshot()["requests"] == 0
    again.close()


def test_a_cache_that_cannot_be_written_turns_itself_off_once(s3, proxy, tmp_path, caplog):
    blocker = tmp_path / "a-file"
    blocker.write_bytes(b"")
    store = configure(StorageConfig(s3_endpoint=proxy.endpoint, cache_dir=str(blocker / "cache"), cache_gib=1))
    src = open_source(_spec("jsonl", ["s3://data/jsonl/"]), seed=0)
    assert len(src.read(np.arange(50))) == 50
    offs = [r for r in caplog.records if "object cache" in r.getMessage()]
    assert len(offs) == 1
    assert "is off" in offs[0].getMessage()
    assert "cache_dir" in offs[0].getMessage()
    assert store.stats.snapshot()["cache_misses"] == 0
    assert store.stats.snapshot()["requests"] > 0
    src.close()


def test_the_cache_stays_within_its_size(s3, proxy, tmp_path):
    cache = tmp_path / "cache"
    limit = 6 << 10  # the row groups read below hold about 13 KiB
    configure(StorageConfig(s3_endpoint=proxy.endpoint, cache_dir=str(cache), cache_gib=limit / (1 << 30)))
    src = open_source(_spec("parquet", ["s3://data/parquet/"]), seed=0)
    src.read(np.arange(src.num_samples))
    held = sum(f.stat().st_size for f in cache.rglob("*") if f.is_file())
    assert 0 < held <= limit
    src.close()


def test_a_three_node_cluster_over_a_bucket_gives_the_local_batches(
    s3, proxy, etcd_server, cluster_factory, server_factory, monkeypatch
):
    _, _, dirs = s3
    fmts = ("parquet", "jsonl")
    local = _job({f: str(dirs[f]) for f in fmts}, name="spread", dp=3)
    remote = _job({f: f"s3://data/{f}/" for f in fmts}, name="spread", dp=3)
    want = run_ranks(local, server_factory(workers=0).start().socket, 6)
    proxy.slowdown_share, proxy.reset_share = 0.1, 0.03
    s3_env(monkeypatch, endpoint=proxy.endpoint)  # the nodes' endpoint from AWS_ENDPOINT_URL (no [storage])
    c = cluster_factory(etcd_server.url).start()
    wait_for(lambda: c.settled(set(c.nodes)), 30, "one leader that every node agrees on")
    proxy.reset_counts()
    got = run_spread(c, remote, 6, spread(3))
    assert {r: got[r] for r in range(3)} == want
    assert proxy.faults["slowdown"] > 0
    # listing and metadata once in the cluster: the leader lists each source and reads each footer (a read that
    # ends at the object's end: row groups end before it); the other nodes fetch its kept copy over the links
    assert [kind for kind, _, _ in proxy.served].count("LIST") == len(fmts), proxy.served
    sizes = {
        f"/data/parquet/{p.relative_to(dirs['parquet']).as_posix()}": p.stat().st_size
        for p in dirs["parquet"].rglob("*.parquet")
    }
    tails = [
        path
        for method, path, rng in proxy.served
        if method == "GET" and path in sizes and rng.endswith(f"-{sizes[path] - 1}")
    ]
    assert sorted(tails) == sorted(sizes), tails


def test_the_object_cache_serves_a_range_inside_a_cached_one_across_a_restart(tmp_path):
    """Reads coalesce differently from one run to the next (the read-ahead reaches further): a range held inside a
    cached one is served from it, after a restart too (the index comes back from the file names), and never
    from another version of the object."""
    obj = ListedFile("s3://b/x.tar", 1000, 7, "e1")
    blob = bytes(range(256)) * 4
    DiskCache(str(tmp_path), 1 << 20).put(DiskCache.key(obj, 100, 500), blob[:500])
    cache = DiskCache(str(tmp_path), 1 << 20)  # a restart
    assert cache.get(DiskCache.key(obj, 100, 500)) == blob[:500]
    assert cache.get(DiskCache.key(obj, 150, 200)) == blob[50:250]
    assert cache.get(DiskCache.key(obj, 100, 501)) is None  # past the cached range
    assert cache.get(DiskCache.key(obj, 99, 10)) is None
    assert cache.get(DiskCache.key(dataclasses.replace(obj, etag="e2"), 150, 200)) is None  # rewritten: not served
    cache.max_bytes = 100  # the cached range is evicted: nothing inside it is served any more
    cache.put(DiskCache.key(obj, 0, 10), blob[:10])
    assert cache.get(DiskCache.key(obj, 150, 200)) is None
    assert cache.get(DiskCache.key(obj, 2, 5)) == blob[2:7]
