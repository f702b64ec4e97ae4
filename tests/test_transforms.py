"""Transforms: byte tokens, loading by name, per-sample seeding, optional tokenizer and image transforms."""

from __future__ import annotations

import io
import sys

import numpy as np
import pytest

from msdata_server import transforms
from msdata_server.errors import BadSampleError, ConfigError
from msdata_server.sources import BadSample
from msdata_server.transforms import (
    EOS,
    byte_tokens,
    hf_tokenizer,
    identity,
    image_patches,
    load_transform,
    run_transform,
)

HERE = __name__  # transforms defined here are named "<this module>:<function>" (workers import it too)


def test_all_is_sorted_and_importable():
    assert transforms.__all__ == sorted(transforms.__all__)
    assert all(hasattr(transforms, n) for n in transforms.__all__)


def test_byte_tokens_text_and_bytes():
    out = byte_tokens("hé!")
    assert out.dtype == np.int32
    assert out.tolist() == [104, 0xC3, 0xA9, 33, EOS]
    assert byte_tokens(b"ab").tolist() == [97, 98, 256]
    assert byte_tokens("").tolist() == [256]
    assert byte_tokens(memoryview(b"z")).tolist() == [122, 256]


def test_byte_tokens_rejects_invalid_utf8_and_non_text():
    with pytest.raises(BadSampleError, match="not valid UTF-8") as e:
        byte_tokens(b"ok \xff")
    assert e.value.reason == "invalid_utf8"
    with pytest.raises(BadSampleError, match="not valid UTF-8"):
        byte_tokens("lone \udc80 surrogate")
    with pytest.raises(BadSampleError, match="needs str or bytes, got int"):
        byte_tokens(5)


def test_load_transform_by_name():
    assert load_transform("msdata_server.transforms:byte_tokens") is byte_tokens
    assert load_transform(" msdata_server.transforms : byte_tokens ") is byte_tokens
    assert load_transform(None) is identity
    with pytest.raises(ConfigError, match="must look like 'module:function'"):
        load_transform("byte_tokens")
    with pytest.raises(ConfigError, match="cannot import module 'no_such_module_xyz'"):
        load_transform("no_such_module_xyz:f")
    with pytest.raises(ConfigError, match="has no function 'nope'"):
        load_transform("msdata_server.transforms:nope")
    with pytest.raises(ConfigError, match="cannot parse the arguments"):
        load_transform(f"{HERE}:make_scaler(1, **x)")


def make_scaler(factor, *, offset=0):
    """A transform factory used through the 'module:factory(args)' syntax."""

    def scale(record, **_):
        return np.asarray(record, dtype=np.int32) * factor + offset

    return scale


def test_factory_syntax():
    fn = load_transform(f"{HERE}:make_scaler(3, offset=1)")
    assert fn([1, 2]).tolist() == [4, 7]


def noisy(record, *, rng, **_):
    return rng.integers(0, 1000, size=4)


def fails_on_b(record, **_):
    if record == "b":
        raise RuntimeError("boom on b")
    return np.zeros(len(record) + 1, dtype=np.int32)


def test_run_transform_seeds_per_sample_and_isolates_failures():
    ids = np.array([10, 11, 12])
    one = run_transform(noisy, ["a", "b", "c"], seed=1, sample_ids=ids)
    # the same sample gets the same randomness whatever batch it is in
    alone = run_transform(noisy, ["b"], seed=1, sample_ids=ids[1:2])
    assert np.array_equal(one[1], alone[0])
    assert not np.array_equal(one[0], one[1])
    other = run_transform(noisy, ["a"], seed=2, sample_ids=ids[:1])
    assert not np.array_equal(one[0], other[0])
    out = run_transform(fails_on_b, ["a", "b", BadSample("oversize", "x"), "dd"], seed=0, sample_ids=np.arange(4))
    assert out[0].tolist() == [0, 0]
    assert isinstance(out[1], BadSample)
    assert out[1].reason == "transform_error"
    assert "boom on b" in out[1].detail
    assert out[2].reason == "oversize"
    assert len(out[3]) == 3


def test_run_transform_rejects_scalars_and_non_token_records():
    out = run_transform(lambda r, **_: 5, ["a"], seed=0, sample_ids=[0])
    assert out[0].reason == "transform_error"
    assert "scalar" in out[0].detail
    out = run_transform(identity, ["text"], seed=0, sample_ids=[0])
    assert "set transform" in out[0].detail
    assert run_transform(identity, [[1, 2]], seed=0, sample_ids=[0])[0].dtype == np.int32


def test_hf_tokenizer(tmp_path):
    tk = pytest.importorskip("tokenizers")
    tok = tk.Tokenizer(tk.models.WordLevel({"hello": 0, "world": 1, "[UNK]": 2}, unk_token="[UNK]"))
    tok.pre_tokenizer = tk.pre_tokenizers.Whitespace()
    path = tmp_path / "tokenizer.json"
    tok.save(str(path))
    fn = hf_tokenizer(str(path), eos=99)
    out = fn("hello world again")
    assert out.dtype == np.int32
    assert out.tolist() == [0, 1, 2, 99]
    assert fn(b"world").tolist() == [1, 99]
    with pytest.raises(BadSampleError, match="UTF-8"):
        fn(b"\xff")
    named = load_transform(f"msdata_server.transforms:hf_tokenizer({str(path)!r}, eos=7)")
    assert named("hello").tolist() == [0, 7]
    with pytest.raises(ConfigError, match="cannot load tokenizer file"):
        hf_tokenizer(str(tmp_path / "missing.json"))


def test_hf_tokenizer_batch_is_the_same_as_one_by_one(tmp_path):
    """run_transform tokenizes a task's records in one encode_batch: the same tokens and bad samples as
    record by record; a batch that fails goes one by one and names the sample."""
    tk = pytest.importorskip("tokenizers")
    tok = tk.Tokenizer(tk.models.WordLevel({"hello": 0, "world": 1, "[UNK]": 2}, unk_token="[UNK]"))
    tok.pre_tokenizer = tk.pre_tokenizers.Whitespace()
    tok.save(str(tmp_path / "tokenizer.json"))
    fn = hf_tokenizer(str(tmp_path / "tokenizer.json"), eos=99)
    recs = ["hello world", b"\xff", "", 7, BadSample("oversize", "f row 1"), b"world hello again", "hello"]
    ids = np.arange(len(recs)) + 50
    batched = run_transform(fn, recs, seed=0, sample_ids=ids)
    single = run_transform(lambda r, **kw: fn(r, **kw), recs, seed=0, sample_ids=ids)  # no .batch: one by one
    assert [type(x) for x in batched] == [type(x) for x in single]
    for a, b in zip(batched, single):
        if isinstance(a, BadSample):
            assert (a.reason, a.location, a.detail) == (b.reason, b.location, b.detail)
        else:
            assert a.dtype == np.int32
            assert a.tolist() == b.tolist()
    assert batched[0].tolist() == [0, 1, 99]
    assert batched[2].tolist() == [99]
    assert batched[1].reason == "invalid_utf8"
    assert batched[1].location == "sample 51"
    assert batched[3].reason == "transform_error"
    assert "got int" in batched[3].detail
    assert fn.batch(["hello", b"world"])[1].tolist() == [1, 99]

    calls = []

    def broken(records):
        calls.append(len(records))
        raise RuntimeError("the batch failed")

    def one(record, **_):
        if record == "bad":
            raise ValueError("this one")
        return np.array([len(record)], dtype=np.int32)

    one.needs_rng, one.batch = False, broken
    out = run_transform(one, ["ab", "bad", "c"], seed=0, sample_ids=[1, 2, 3])
    assert calls == [3]
    assert out[0].tolist() == [2]
    assert out[2].tolist() == [1]
    assert out[1].location == "sample 2"
    assert "this one" in out[1].detail


def test_hf_tokenizer_without_the_package(monkeypatch):
    monkeypatch.setitem(sys.modules, "tokenizers", None)
    with pytest.raises(ConfigError, match="pip install tokenizers"):
        hf_tokenizer("x.json")


def _png(w, h):
    Image = pytest.importorskip("PIL.Image")
    rng = np.random.default_rng(0)
    img = Image.fromarray(rng.integers(0, 256, size=(h, w, 3), dtype=np.uint8))
    buf = io.BytesIO()
    img.save(buf, format="PNG")
    return buf.getvalue()


def test_image_patches():
    data = _png(100, 60)
    a = image_patches(data, rng=np.random.default_rng(1), patch=8, grid=(4, 6))
    assert a.dtype == np.uint8
    assert a.shape == (24, 8 * 8 * 3)
    assert len(a) == 24
    b = image_patches(data, rng=np.random.default_rng(1), patch=8, grid=(4, 6))
    c = image_patches(data, rng=np.random.default_rng(2), patch=8, grid=(4, 6))
    assert np.array_equal(a, b)
    assert not np.array_equal(a, c)
    # through run_transform the crop is seeded from (seed, sample id)
    r1 = run_transform(image_patches, [data], seed=3, sample_ids=[5])[0]
    r2 = run_transform(image_patches, [data], seed=3, sample_ids=[5])[0]
    assert r1.shape == (256, 768)
    assert np.array_equal(r1, r2)
    with pytest.raises(BadSampleError, match="does not decode"):
        image_patches(b"not an image", rng=np.random.default_rng(0))


def test_image_patches_without_pillow(monkeypatch):
    monkeypatch.setitem(sys.modules, "PIL", None)
    with pytest.raises(ConfigError, match="pip install Pillow"):
        image_patches(b"", rng=np.random.default_rng(0))
