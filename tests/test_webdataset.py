"""WebDataset reader: tar shards written here, samples by key, the deterministic order, partitions and seek,
truncated shards and missing parts counted; end to end through the vlm transform."""

from __future__ import annotations

import io
import itertools
import logging
import tarfile

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from msdata_server.errors import ConfigError
from msdata_server.loader import SourceLoader
from msdata_server.sources import FORMATS, BadSample, open_source
from msdata_server.sources.webdataset import WebDatasetSource, shard_index, split_member_name
from msdata_server.transforms import IMAGE_TOKEN, byte_tokens, vlm

from .aio import run
from .vlm_util import COLOURS, NAMES, colour_of, encode, spec

Image = pytest.importorskip("PIL.Image")

TXT = f"{__name__}:txt_tokens"  # a transform the loader imports by name


def txt_tokens(record, **_):
    """The caption part of a sample as byte tokens (for order tests: cheap and identifies the sample)."""
    return byte_tokens(record["txt"])


txt_tokens.needs_rng = False


def write_tar(path, samples) -> None:
    """samples: [(key, {ext: bytes})] in order (a member per part)."""
    with tarfile.open(path, "w") as tf:
        for key, parts in samples:
            for ext, data in parts.items():
                ti = tarfile.TarInfo(f"{key}.{ext}")
                ti.size = len(data)
                tf.addfile(ti, io.BytesIO(data))


def caption_samples(shard: int, n: int, fmt: str = "PNG"):
    """n samples, each an image painted the colour its caption names."""
    ext = "png" if fmt == "PNG" else "jpg"
    out = []
    for i in range(n):
        colour = NAMES[(shard * 7 + i) % len(NAMES)]
        size = (40 + 9 * i, 30 + 5 * ((i * 3) % 7))
        parts = {ext: encode(colour, size, fmt), "txt": f"a {colour} picture {shard}-{i}".encode()}
        out.append((f"s{shard:02d}/{i:05d}", parts))
    return out


def make_shards(tmp_path, sizes=(12, 9, 15), fmts=("PNG", "JPEG", "PNG")):
    d = tmp_path / "shards"
    d.mkdir(exist_ok=True)
    truth = {}
    for k, (n, fmt) in enumerate(zip(sizes, fmts)):
        samples = caption_samples(k, n, fmt)
        write_tar(d / f"shard-{k:03d}.tar", samples)
        for r, (_, parts) in enumerate(samples):
            truth[(k, r)] = parts
    return d, truth


# ---------------------------------------------------------------- round trip


def test_formats_table_and_member_names():
    assert FORMATS["webdataset"] is WebDatasetSource
    assert split_member_name("dir/a/000123.jpg") == ("dir/a/000123", "jpg")
    assert split_member_name("x.seg.png") == ("x", "seg.png")
    assert split_member_name("a.b/c.txt") == ("a.b/c", "txt")
    assert split_member_name("README") is None
    assert split_member_name("dir/.hidden") is None


def test_round_trip_png_and_jpeg_through_vlm(tmp_path):
    d, truth = make_shards(tmp_path)
    src = open_source(spec(d, columns=["jpg;png", "txt"]), seed=3)
    fn = vlm(image_key="jpg;png", text_key="txt")
    with src:
        n = src.num_samples
        assert n == len(truth) == 36
        for epoch in range(2):
            ords = np.arange(epoch * n, (epoch + 1) * n)
            recs = src.read(ords)
            _, f, r = src.locate_many(ords)
            ids = src.sample_ids(ords)
            assert len(set(ids.tolist())) == n
            assert np.array_equal(ids, (f << 32) | r)
            for rec, fi, ri in zip(recs, f.tolist(), r.tolist()):
                want = truth[(fi, ri)]
                assert rec == want  # the parts, byte for byte
                out = fn(rec)
                colour = rec["txt"].decode().split()[1]
                ((t, h, w),) = out.image_grid_thw.tolist()
                n_ph = t * h * w // 4
                assert out.tokens[:n_ph].tolist() == [IMAGE_TOKEN] * n_ph
                assert out.tokens[n_ph:].tolist() == byte_tokens(rec["txt"]).tolist()
                assert out.pixel_values.shape == (t * h * w, 3 * 14 * 14)
                tol = 1.5 if "png" in rec else 8
                assert np.abs(colour_of(out.pixel_values) - COLOURS[colour]).max() <= tol
        st_ = src.statistics()
        assert st_.bad_samples == {}
        assert st_.format == "webdataset"
        assert st_.files == 3


def test_order_is_deterministic_and_seeded(tmp_path):
    d, _ = make_shards(tmp_path)
    a, b, c = (open_source(spec(d, columns=["jpg;png", "txt"]), seed=s) for s in (5, 5, 6))
    o = np.arange(2 * a.num_samples)
    assert np.array_equal(a.sample_ids(o), b.sample_ids(o))
    assert not np.array_equal(a.sample_ids(o), c.sample_ids(o))
    assert a.read(o[:10]) == b.read(o[:10])
    for s in (a, b, c):
        s.close()


def test_index_is_numpy_arrays(tmp_path):
    d, _ = make_shards(tmp_path, sizes=(6,), fmts=("PNG",))
    ids: dict[str, int] = {}
    idx = shard_index(str(d / "shard-000.tar"), ids)
    assert ids == {"png": 0, "txt": 1}
    assert idx.num_samples == 6
    assert idx.truncated == ""
    for a, dt in ((idx.offsets, np.int64), (idx.sizes, np.int64), (idx.exts, np.int32), (idx.starts, np.int64)):
        assert isinstance(a, np.ndarray)
        assert a.dtype == dt
    assert idx.starts.tolist() == list(range(0, 13, 2))
    assert (idx.offsets % 512 == 0).all()
    src = open_source(spec(d), seed=0)
    assert src.statistics().index_bytes >= idx.nbytes
    src.close()


# ---------------------------------------------------------------- partitions, seek, resume


async def _loader_tokens(src, ords, *, partition=(0, 1), seek=None, batch=4):
    async with SourceLoader(src, None, transform=TXT, seed=1, readahead=16, batch=batch, partition=partition) as ld:
        if seek is not None:
            ld.seek(seek)
        return {o: bytes((await ld.tokens(o))[:-1].astype(np.uint8)) for o in ords}


@pytest.mark.parametrize("n_parts", [2, 3])
def test_partitions_and_seek_give_the_unpartitioned_order(tmp_path, n_parts):
    d, _ = make_shards(tmp_path, sizes=(7, 5, 9), fmts=("PNG", "PNG", "PNG"))
    batch = 4
    total = 2 * 21  # two epochs
    with open_source(spec(d), seed=9) as whole:
        full = run(_loader_tokens(whole, range(total)))
        direct = [r["txt"] for r in whole.read(np.arange(total))]
    assert [full[o] for o in range(total)] == direct
    merged = {}
    for k in range(n_parts):
        mine = [o for o in range(total) if (o // batch) % n_parts == k]
        with open_source(spec(d), seed=9) as part:  # each partition its own reader, as on another node
            merged.update(run(_loader_tokens(part, mine, partition=(k, n_parts))))
    assert merged == full
    # resume: a fresh reader that seeks into the middle continues with exactly the same samples
    for at in (5, 21, 30):
        with open_source(spec(d), seed=9) as again:
            tail = run(_loader_tokens(again, range(at, total), seek=at))
        assert tail == {o: full[o] for o in range(at, total)}


@settings(max_examples=15, deadline=None, derandomize=True)
@given(
    sizes=st.lists(st.integers(1, 12), min_size=1, max_size=4),
    seed=st.integers(0, 2**32),
    cuts=st.lists(st.integers(0, 60), min_size=1, max_size=4),
)
def test_reading_in_pieces_equals_one_read(tmp_path_factory, sizes, seed, cuts):
    d = tmp_path_factory.mktemp("pieces")
    for k, n in enumerate(sizes):
        write_tar(d / f"{k}.tar", [(f"{k}-{i}", {"txt": f"{k}/{i}".encode(), "cls": b"%d" % i}) for i in range(n)])
    with open_source(spec(d), seed=seed) as src:
        total = 2 * src.num_samples
        once = src.read(np.arange(total))
        bounds = sorted({0, total, *(c % (total + 1) for c in cuts)})
        pieces = [r for a, b in itertools.pairwise(bounds) for r in src.read(np.arange(a, b))]
    assert pieces == once
    written = sorted(f"{k}/{i}".encode() for k, n in enumerate(sizes) for i in range(n))
    assert sorted(r["txt"] for r in once[: total // 2]) == written


# ---------------------------------------------------------------- bad data


def test_missing_and_duplicate_parts_are_counted(tmp_path, caplog):
    samples = [(f"{i:03d}", {"jpg": encode("red", fmt="JPEG"), "txt": b"a red picture"}) for i in range(10)]
    samples[3] = ("003", {"jpg": samples[3][1]["jpg"]})  # no caption
    samples[6] = ("006", {"txt": b"no image"})  # no image
    samples[8] = ("008", {**samples[8][1], "json": b"{}"})  # an extra part only one sample has: not delivered
    write_tar(tmp_path / "a.tar", samples)
    with tarfile.open(tmp_path / "a.tar", "a") as tf:  # "009" again right after: a part twice in one sample
        ti = tarfile.TarInfo("009.txt")
        ti.size = 3
        tf.addfile(ti, io.BytesIO(b"dup"))
    with caplog.at_level(logging.WARNING), open_source(spec(tmp_path), seed=0) as src:
        assert src.num_samples == 10
        recs = src.read(np.arange(10))
        _, _, rows = src.locate_many(np.arange(10))
        by_row = dict(zip(rows.tolist(), recs))
        assert by_row[3].reason == "missing_field"
        assert "txt" in by_row[3].detail
        assert by_row[6].reason == "missing_field"
        assert "jpg" in by_row[6].detail
        assert by_row[9].reason == "corrupt"
        assert "twice" in by_row[9].detail
        good = [r for r in recs if not isinstance(r, BadSample)]
        assert len(good) == 7
        assert all(set(r) == {"jpg", "txt"} for r in good)
        assert src.statistics().bad_samples == {"missing_field": 2, "corrupt": 1}
    assert any("json" in r.getMessage() for r in caplog.records)  # the rare extension is named once


def test_columns_select_parts_and_name_missing_extensions(tmp_path):
    write_tar(tmp_path / "a.tar", [(f"{i}", {"jpg": b"x" * 10, "txt": b"t%d" % i, "cls": b"%d" % i}) for i in range(4)])
    with open_source(spec(tmp_path, columns=["cls"]), seed=0) as src:
        assert sorted(r["cls"] for r in src.read(np.arange(4))) == [b"0", b"1", b"2", b"3"]
        assert all(set(r) == {"cls"} for r in src.read(np.arange(4)))
    with pytest.raises(ConfigError, match=r"has the extension\(s\) \['png'\].*'jpg', 'txt', 'cls'"):
        open_source(spec(tmp_path, columns=["png", "txt"]), seed=0)
    with pytest.raises(ConfigError, match="distinct non-empty"):
        open_source(spec(tmp_path, columns=["txt", "txt"]), seed=0)


def test_oversize_sample(tmp_path):
    write_tar(tmp_path / "a.tar", [("0", {"bin": b"x" * 5000, "txt": b"a"}), ("1", {"bin": b"y" * 10, "txt": b"b"})])
    with open_source(spec(tmp_path, max_sample_bytes=1000), seed=0) as src:
        recs = src.read(np.arange(2))
        assert sorted(r.reason if isinstance(r, BadSample) else r["txt"].decode() for r in recs) == ["b", "oversize"]


def _members(path):
    with tarfile.open(path) as tf:
        return [(m.name, m.offset, m.offset_data, m.size) for m in tf.getmembers()]


@pytest.mark.parametrize("where", ["mid_data", "header_boundary", "mid_header", "end_marker", "first_header"])
def test_truncated_shard_counts_bad_samples(tmp_path, where, caplog):
    d = tmp_path / "s"
    d.mkdir()
    good = caption_samples(0, 6)
    write_tar(d / "a.tar", good)
    write_tar(d / "b.tar", caption_samples(1, 8))
    data = (d / "b.tar").read_bytes()
    m = _members(d / "b.tar")  # two members per sample: member 2*i is sample i's image, 2*i+1 its caption
    cut, complete, bad = {
        "mid_data": (m[10][2] + 100, 5, 1),  # sample 5's image cut: samples 0-4 whole, 5 bad
        "header_boundary": (m[11][1], 5, 1),  # sample 5 lost its caption header: bad (truncated)
        "mid_header": (m[12][1] + 200, 6, 0),  # cut inside sample 6's first header: 0-5 whole, 6 gone
        "end_marker": (m[15][2] + m[15][3] + 5, 8, 0),  # every member whole, no end-of-archive blocks
        "first_header": (300, 0, 0),  # not even one header: the shard is skipped
    }[where]
    (d / "b.tar").write_bytes(data[:cut])
    with caplog.at_level(logging.ERROR), open_source(spec(d), seed=2) as src:
        assert src.num_samples == 6 + complete + bad
        recs = src.read(np.arange(src.num_samples))
        _, files, rows = src.locate_many(np.arange(src.num_samples))
        got = {(f, r): rec for f, r, rec in zip(files.tolist(), rows.tolist(), recs)}
        for r in range(complete):
            assert not isinstance(got[(1, r)], BadSample)
        for r in range(complete, complete + bad):
            assert got[(1, r)].reason == "corrupt"
            assert "truncated" in got[(1, r)].detail
        for r in range(6):
            assert got[(0, r)] == good[r][1]
        stats = src.statistics()
        want = {"corrupt": bad} if bad else {}
        if where == "first_header":
            want = {"corrupt_file": 1}
        assert stats.bad_samples == want
        assert stats.files_skipped == (1 if where == "first_header" else 0)
    assert any("b.tar" in r.getMessage() for r in caplog.records)


def test_a_file_that_is_no_tar_is_skipped_and_all_bad_is_a_config_error(tmp_path):
    (tmp_path / "x.tar").write_bytes(b"not a tar at all" * 100)
    with pytest.raises(ConfigError, match="none of its 1 webdataset file"):
        open_source(spec(tmp_path), seed=0)


@pytest.mark.parametrize("module", ["sources.webdataset", "planner.vlm_cost", "transforms", "sources"])
def test_all_is_sorted_and_importable(module):
    import importlib

    mod = importlib.import_module(f"msdata_server.{module}")
    assert mod.__all__ == sorted(mod.__all__)
    assert all(hasattr(mod, n) for n in mod.__all__)


@pytest.mark.parametrize("member", [7, 6])  # sample 3's caption header, or its image header (its first)
def test_a_corrupt_header_mid_shard_is_skipped_and_the_rest_read(tmp_path, member, caplog):
    d = tmp_path / "s"
    d.mkdir()
    samples = caption_samples(1, 8)
    write_tar(d / "b.tar", samples)
    m = _members(d / "b.tar")
    data = bytearray((d / "b.tar").read_bytes())
    data[m[member][1] : m[member][1] + 20] = b"\xff" * 20  # its name and mode: the checksum no longer holds
    (d / "b.tar").write_bytes(bytes(data))
    with caplog.at_level(logging.ERROR), open_source(spec(d), seed=2) as src:
        assert src.num_samples == 8
        recs = src.read(np.arange(8))
        _, _, rows = src.locate_many(np.arange(8))
        got = dict(zip(rows.tolist(), recs))
        assert got[3].reason == "corrupt"
        assert f"corrupt header at byte {m[member][1]}" in got[3].detail
        for r in (0, 1, 2, 4, 5, 6, 7):
            assert got[r] == samples[r][1], r
        assert src.statistics().bad_samples == {"corrupt": 1}
    msgs = [r.getMessage() for r in caplog.records]
    assert any("damaged" in t for t in msgs), msgs
    assert not any("truncated" in t for t in msgs), msgs
