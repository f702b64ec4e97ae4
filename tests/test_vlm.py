"""The vlm transform (decode, smart_resize, Qwen2-VL patch order, placeholders), multi-column records of
Parquet/Arrow/JSON Lines, and the two-stage cost model."""

from __future__ import annotations

import io
import math
import sys

import numpy as np
import orjson
import pyarrow as pa
import pyarrow.feather as feather
import pyarrow.parquet as pq
import pytest
from hypothesis import assume, given, settings
from hypothesis import strategies as st

from msdata_server.document import VlmSample
from msdata_server.errors import BadSampleError, ConfigError
from msdata_server.planner import vlm_cost
from msdata_server.planner.vlm_cost import StageImbalance, VlmCost, stage_imbalance, stage_loads
from msdata_server.sources import BadSample, open_source
from msdata_server.transforms import IMAGE_TOKEN, load_transform, run_transform, smart_resize, vlm

from .vlm_util import COLOURS, NAMES, colour_of, encode, spec

Image = pytest.importorskip("PIL.Image")


def hf_smart_resize(height, width, factor=28, min_pixels=56 * 56, max_pixels=14 * 14 * 4 * 1280):
    """Qwen2-VL's rule, as transformers writes it (image_processing_qwen2_vl.smart_resize)."""
    if max(height, width) / min(height, width) > 200:
        raise ValueError("aspect")
    h_bar = max(factor, round(height / factor) * factor)
    w_bar = max(factor, round(width / factor) * factor)
    if h_bar * w_bar > max_pixels:
        beta = math.sqrt((height * width) / max_pixels)
        h_bar = max(factor, math.floor(height / beta / factor) * factor)
        w_bar = max(factor, math.floor(width / beta / factor) * factor)
    elif h_bar * w_bar < min_pixels:
        beta = math.sqrt(min_pixels / (height * width))
        h_bar = math.ceil(height * beta / factor) * factor
        w_bar = math.ceil(width * beta / factor) * factor
    return h_bar, w_bar


def hf_patches(chw: np.ndarray, patch=14, merge=2, temporal=1) -> np.ndarray:
    """transformers' Qwen2-VL flattening of one image [C, H, W] (temporal_patch_size 1: no repeated frame)."""
    patches = chw[None]
    c = patches.shape[1]
    gt, gh, gw = patches.shape[0] // temporal, chw.shape[1] // patch, chw.shape[2] // patch
    patches = patches.reshape(gt, temporal, c, gh // merge, merge, patch, gw // merge, merge, patch)
    patches = patches.transpose(0, 3, 6, 4, 7, 2, 1, 5, 8)
    return patches.reshape(gt * gh * gw, c * temporal * patch * patch)


# ---------------------------------------------------------------- smart_resize


sides = st.integers(1, 6000)


@settings(max_examples=300, deadline=None, derandomize=True)
@given(
    h=sides,
    w=sides,
    patch=st.sampled_from([7, 14, 16]),
    merge=st.sampled_from([1, 2]),
    lo=st.integers(1, 400_000),
    span=st.floats(1.0, 400.0),
)
def test_smart_resize_bounds(h, w, patch, merge, lo, span):
    f = patch * merge
    hi = int(lo * span)
    assume(max(h, w) <= 200 * min(h, w))
    assume(-(-lo // (f * f)) <= hi // (f * f))  # some area of whole blocks lies in the bounds
    th, tw = smart_resize(h, w, factor=f, min_pixels=lo, max_pixels=hi)
    assert th % f == 0
    assert tw % f == 0
    assert th >= f
    assert tw >= f
    assert lo <= th * tw <= hi
    ref = hf_smart_resize(h, w, f, lo, hi)
    if lo <= ref[0] * ref[1] <= hi:  # Qwen2-VL's own answer wherever it keeps the bounds
        assert (th, tw) == ref
        m = min(th, tw)
        if m > f:  # each side is within one block of the exact scaled side: the aspect ratio is kept that well
            assert abs(math.log((tw / th) / (w / h))) <= math.log((1 + f / m) / (1 - f / m)) + 1e-9


@settings(max_examples=200, deadline=None, derandomize=True)
@given(h=st.integers(32, 4096), aspect=st.floats(0.2, 5.0))
def test_smart_resize_keeps_aspect_for_the_workload_bounds(h, aspect):
    w = max(1, round(h * aspect))
    th, tw = smart_resize(h, w, factor=28, min_pixels=3136, max_pixels=1048576)
    assert 3136 <= th * tw <= 1048576
    assert th % 28 == tw % 28 == 0
    # sides >= 56 px (two blocks): at worst half a block off per side, log((2 + 0.5) / (2 - 0.5)) = 0.511
    assert abs(math.log((tw / th) / (w / h))) <= math.log(2.5 / 1.5) + 1e-9
    if (h + 14) * (w + 14) <= 1048576 and min(h, w) >= 60:
        assert abs(th - h) <= 14
        assert abs(tw - w) <= 14


def test_smart_resize_examples_and_errors():
    assert smart_resize(384, 512) == (392, 504)
    assert smart_resize(1, 1) == (56, 56)
    assert smart_resize(4000, 3000, max_pixels=1048576) == hf_smart_resize(4000, 3000, max_pixels=1048576)
    th, tw = smart_resize(10, 2000, factor=28, min_pixels=3136, max_pixels=3136)  # bounds that Qwen's rounding misses
    assert th * tw == 3136
    with pytest.raises(ValueError, match="aspect ratio"):
        smart_resize(1, 201)
    with pytest.raises(ValueError, match="no multiple"):
        smart_resize(100, 100, factor=28, min_pixels=800, max_pixels=1500)


# ---------------------------------------------------------------- the transform


def test_patches_are_in_qwen2_vl_order():
    h, w = 56, 84  # whole 28-pixel blocks inside the bounds: no resize, so pixels compare exactly
    yy, xx = np.mgrid[0:h, 0:w]
    rgb = np.stack([xx * 3 % 256, yy * 4 % 256, (xx + yy) % 256], axis=-1).astype(np.uint8)
    buf = io.BytesIO()
    Image.fromarray(rgb).save(buf, "PNG")
    out = vlm()({"image": buf.getvalue(), "caption": "x"})
    assert out.image_grid_thw.tolist() == [[1, 4, 6]]
    assert np.array_equal(out.pixel_values, hf_patches(rgb.transpose(2, 0, 1)))
    # the 4 patches of the first placeholder are the top-left 2 x 2 block of patches
    first = out.pixel_values[:4].reshape(2, 2, 3, 14, 14).transpose(0, 3, 1, 4, 2).reshape(28, 28, 3)
    assert np.array_equal(first, rgb[:28, :28])


@pytest.mark.parametrize("fmt", ["PNG", "JPEG"])
@pytest.mark.parametrize("size", [(512, 384), (20, 15), (2400, 1200), (300, 700)])
def test_one_image_caption(fmt, size):
    fn = vlm(max_pixels=401_408)  # 2400 x 1200 goes down (a JPEG through DCT scaling), 20 x 15 goes up
    colour = "yellow" if size[0] % 2 else "blue"
    out = fn({"image": encode(colour, size, fmt), "caption": f"a {colour} thing"})
    assert isinstance(out, VlmSample)
    assert out.tokens.dtype == np.int32
    ((t, h, w),) = out.image_grid_thw.tolist()
    assert out.image_grid_thw.dtype == np.int64
    assert t == 1
    assert 3136 <= h * w * 196 <= 401_408
    assert h % 2 == 0
    assert w % 2 == 0
    assert abs(math.log((w / h) / (size[0] / size[1]))) < 0.25
    n_ph = t * h * w // 4
    assert len(out) == n_ph + len(f"a {colour} thing") + 1
    assert (out.tokens[:n_ph] == IMAGE_TOKEN).all()
    assert out.tokens[-1] == 256
    assert out.pixel_values.dtype == np.uint8
    assert out.pixel_values.shape == (t * h * w, 588)
    assert np.abs(colour_of(out.pixel_values) - COLOURS[colour]).max() <= (1.5 if fmt == "PNG" else 8)


def test_interleaved_images_transparency_and_modes():
    rgba = Image.new("RGBA", (60, 60), (255, 0, 0, 0))  # fully transparent: white
    buf = io.BytesIO()
    rgba.save(buf, "PNG")
    grey = io.BytesIO()
    Image.new("L", (90, 40), 8).save(grey, "JPEG")
    pal = io.BytesIO()
    Image.new("RGB", (50, 70), COLOURS["green"]).convert("P").save(pal, "PNG")
    blobs = [buf.getvalue(), grey.getvalue(), pal.getvalue(), encode("red", (100, 80), "JPEG")]
    out = vlm(merge=2, image_token_id=9)({"image": blobs, "caption": b"white black green red"})
    grid = out.image_grid_thw
    assert grid.shape == (4, 3)
    per = grid.prod(axis=1)
    assert len(out.pixel_values) == per.sum()
    assert out.tokens[: per.sum() // 4].tolist() == [9] * (per.sum() // 4)
    assert out.tokens[per.sum() // 4 :].tolist()[:5] == list(b"white")
    for (lo, hi), name in zip(zip(np.cumsum(per) - per, np.cumsum(per)), ["white", "black", "green", "red"]):
        assert np.abs(colour_of(out.pixel_values[lo:hi]) - COLOURS[name]).max() <= 8


def test_text_only_record_and_key_alternatives():
    fn = load_transform("msdata_server.transforms:vlm(image_key='jpg;png', text_key='txt', image_token_id=300)")
    out = fn({"png": encode("red"), "txt": b"hi"})
    assert out.tokens[-3:].tolist() == [104, 105, 256]
    assert (out.tokens[:-3] == 300).all()
    empty = fn({"jpg": [], "txt": "only text"})
    assert empty.tokens.tolist() == [*list(b"only text"), 256]
    assert empty.pixel_values.shape == (0, 588)
    assert empty.image_grid_thw.shape == (0, 3)


@pytest.mark.parametrize(
    ("record", "reason", "match"),
    [
        ({"image": b"\x89PNG\r\n\x1a\n" + b"\0" * 50, "caption": "x"}, "corrupt", "does not decode"),
        ({"image": encode("red", (200, 200), "JPEG")[:300], "caption": "x"}, "corrupt", "does not decode"),
        ({"image": b"", "caption": "x"}, "corrupt", "does not decode"),
        ({"image": [encode("red"), b"garbage"], "caption": "x"}, "corrupt", "image 1"),
        ({"image": encode("red"), "caption": None}, "missing_field", "caption"),
        ({"caption": "x"}, "missing_field", "image"),
        ({"image": encode("red", (600, 2)), "caption": "x"}, "transform_error", "aspect ratio"),
        ({"image": "not bytes", "caption": "x"}, "corrupt", "holds a str"),
        ({"image": encode("red"), "caption": b"\xff"}, "invalid_utf8", "UTF-8"),
        ("just text", "transform_error", "set columns"),
    ],
)
def test_bad_records_are_bad_samples(record, reason, match):
    fn = vlm()
    with pytest.raises(BadSampleError, match=match) as e:
        fn(record)
    assert e.value.reason == reason
    # run_transform (what the loader and the workers call) turns them into counted BadSamples
    [bad] = run_transform(fn, [record], seed=0, sample_ids=[7])
    assert isinstance(bad, BadSample)
    assert bad.reason == reason


def test_corrupt_pixels_of_a_valid_header():
    data = bytearray(encode("red", (64, 64), "PNG"))
    data[60:80] = b"\xff" * 20  # inside the image data: the CRC check fails at decode
    with pytest.raises(BadSampleError) as e:
        vlm()({"image": bytes(data), "caption": "x"})
    assert e.value.reason == "corrupt"


def test_configuration_errors(monkeypatch):
    with pytest.raises(ConfigError, match="patch=0 must be an integer >= 1"):
        vlm(patch=0)
    with pytest.raises(ConfigError, match="raise max_pixels to at least 1568"):
        vlm(min_pixels=800, max_pixels=1500)
    with pytest.raises(ConfigError, match="image_token_id=-1"):
        vlm(image_token_id=-1)
    monkeypatch.setitem(sys.modules, "PIL", None)
    with pytest.raises(ConfigError, match="pip install pillow"):
        vlm()


def test_vlm_sample_arrays_round_trip():
    out = vlm()({"image": encode("red"), "caption": "r"})
    again = VlmSample.from_arrays({k: v.copy() for k, v in out.arrays().items()})
    assert len(again) == len(out)
    assert again.nbytes == out.nbytes
    assert all(np.array_equal(a, b) for a, b in zip(out.arrays().values(), again.arrays().values()))


# ---------------------------------------------------------------- multi-column records


def _image_table(n):
    caps, imgs, multi = [], [], []
    for i in range(n):
        a, b = NAMES[i % 6], NAMES[(i + 2) % 6]
        fmt = "PNG" if i % 2 else "JPEG"
        caps.append(f"{a} then {b}")
        imgs.append(encode(a, (30 + 7 * i, 40), fmt))
        multi.append([encode(a, (50, 30), fmt), encode(b, (30, 50), fmt)])
    return pa.table(
        {
            "image": pa.array(imgs, pa.binary()),
            "caption": caps,
            "images": pa.array(multi, pa.list_(pa.binary())),
            "n": list(range(n)),
        }
    )


@pytest.mark.parametrize("fmt", ["parquet", "arrow"])
def test_multi_column_records_round_trip(tmp_path, fmt):
    table = _image_table(20)
    path = tmp_path / f"t.{fmt}"
    if fmt == "parquet":
        pq.write_table(table, path, row_group_size=6)
    else:
        feather.write_feather(table, path, chunksize=6)
    src = open_source(spec(path, format=fmt, columns=["images", "caption", "n"]), seed=1)
    one = vlm(image_key="images")
    with src:
        recs = src.read(np.arange(20))
        assert sorted(r["n"] for r in recs) == list(range(20))
        for r in recs:
            assert set(r) == {"images", "caption", "n"}
            assert r["images"] == table["images"][r["n"]].as_py()
            out = one(r)
            per = out.image_grid_thw.prod(axis=1)
            assert len(per) == 2
            assert len(out.pixel_values) == per.sum()
            assert (out.tokens[: per.sum() // 4] == IMAGE_TOKEN).all()
            for k, name in enumerate(r["caption"].split(" then ")):
                lo = per[:k].sum()
                assert np.abs(colour_of(out.pixel_values[lo : lo + per[k]]) - COLOURS[name]).max() <= 8
        assert src.statistics().bytes_read > sum(len(b) for b in table["image"].to_pylist())
    # a plain column keeps working as before
    with open_source(spec(path, format=fmt, column="caption"), seed=1) as plain:
        assert sorted(plain.read(np.arange(20))) == sorted(table["caption"].to_pylist())
    with pytest.raises(ConfigError, match=r"no column\(s\) \['nope'\]"):
        open_source(spec(path, format=fmt, columns=["caption", "nope"]), seed=1)


def test_multi_column_bad_rows_count_once(tmp_path):
    t = pa.table(
        {"image": pa.array([b"a" * 10, None, b"b" * 500, b"c"], pa.binary()), "caption": ["x", "y", "z", None]}
    )
    pq.write_table(t, tmp_path / "b.parquet")
    with open_source(
        spec(tmp_path / "b.parquet", format="parquet", columns=["image", "caption"], max_sample_bytes=400), seed=0
    ) as src:
        recs = src.read(np.arange(4))
        reasons = sorted(r.reason for r in recs if isinstance(r, BadSample))
        assert reasons == ["missing_field", "missing_field", "oversize"]
        assert [r for r in recs if not isinstance(r, BadSample)] == [{"image": b"a" * 10, "caption": "x"}]
        assert src.statistics().bad_samples == {"missing_field": 2, "oversize": 1}


def test_jsonl_multi_column(tmp_path):
    with open(tmp_path / "d.jsonl", "wb") as fh:
        for i in range(5):
            fh.write(orjson.dumps({"caption": f"c{i}", "n": i, "other": 0}) + b"\n")
        fh.write(orjson.dumps({"caption": "no n"}) + b"\n")
    with open_source(spec(tmp_path, format="jsonl", columns=["caption", "n"]), seed=0) as src:
        recs = src.read(np.arange(6))
        good = sorted((r["n"], r["caption"]) for r in recs if not isinstance(r, BadSample))
        assert good == [(i, f"c{i}") for i in range(5)]
        assert [r.reason for r in recs if isinstance(r, BadSample)] == ["missing_field"]
    with pytest.raises(ConfigError, match=r"no field\(s\) \['nope'\]"):
        open_source(spec(tmp_path, format="jsonl", columns=["caption", "nope"]), seed=0)


# ---------------------------------------------------------------- the two-stage cost model


def test_costs_follow_the_formulas():
    lengths = np.array([0, 1, 100, 8192])
    assert np.array_equal(vlm_cost.backbone_cost(lengths, alpha=2.0, beta=3.0), 2.0 * lengths**2 + 3.0 * lengths)
    patches = np.array([1008, 64, 4])
    assert np.array_equal(vlm_cost.vision_cost(patches), patches.astype(float) ** 2 + 2048.0 * patches)
    grid = np.array([[1, 28, 36], [1, 8, 8]])
    assert vlm_cost.image_patches(grid).tolist() == [1008, 64]
    assert vlm_cost.image_placeholders(grid, merge=2).tolist() == [252, 16]
    per_doc = vlm_cost.document_vision_cost(patches, [2, 0, 1])
    v = vlm_cost.vision_cost(patches)
    assert per_doc.tolist() == [v[0] + v[1], 0.0, v[2]]
    with pytest.raises(ValueError, match="sums to 2"):
        vlm_cost.document_vision_cost(patches, [2, 0])
    both = VlmCost(alpha=1.0, beta=0.0, alpha_v=0.0, beta_v=1.0).documents([10, 20, 30], patches, [2, 0, 1])
    assert both.tolist() == [[100.0, 400.0, 900.0], [1072.0, 0.0, 4.0]]
    with pytest.raises(ConfigError, match="beta_v=-1"):
        VlmCost(beta_v=-1)


def test_stage_imbalance():
    b = np.array([4.0, 4.0, 4.0, 4.0, 100.0])
    v = np.array([10.0, 0.0, 10.0, 0.0, 0.0])
    # documents 0,1 on rank 0 and 2,3 on rank 1, the fifth carried: both stages even
    assert stage_imbalance([0, 0, 1, 1, -1], b, v, 2) == StageImbalance(1.0, 1.0)
    # 0,2 | 1,3: the backbone is even, the encoder's work all on rank 0
    assert stage_imbalance([0, 1, 0, 1, -1], b, v, 2) == StageImbalance(1.0, 2.0)
    assert stage_loads([0, 1, 0, 1, -1], b, v, 2).tolist() == [[8.0, 8.0], [20.0, 0.0]]
    assert stage_imbalance([0, 0, 0, 0, 0], b, v, 4) == StageImbalance(4.0, 4.0)
    assert stage_imbalance([], [], [], 3) == StageImbalance(1.0, 1.0)
    with pytest.raises(ValueError, match="not below dp=2"):
        stage_loads([0, 2], [1, 1], [1, 1], 2)


@settings(max_examples=50, deadline=None, derandomize=True)
@given(st.lists(st.tuples(st.integers(-1, 5), st.floats(0, 1e6), st.floats(0, 1e6)), max_size=40))
def test_stage_loads_add_up(docs):
    rank = np.array([d[0] for d in docs], dtype=np.int64)
    b = np.array([d[1] for d in docs])
    v = np.array([d[2] for d in docs])
    loads = stage_loads(rank, b, v, 6)
    assert loads.shape == (2, 6)
    assert np.allclose(loads.sum(axis=1), [b[rank >= 0].sum(), v[rank >= 0].sum()])
    imb = stage_imbalance(rank, b, v, 6)
    assert 1.0 <= imb.backbone <= 6.0 + 1e-9
    assert 1.0 <= imb.vision <= 6.0 + 1e-9
