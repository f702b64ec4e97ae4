"""Video in the vlm transform: the sampling rule, decoding only the sampled frames into temporal patches (read
back exactly from clips whose frames show their index), images and clips in one sample, bad clips as bad
samples with their reason, the job-start refusal of bounds that cannot fit, and a worker's memory while decoding
a long, large clip."""

from __future__ import annotations

import io
import json
import subprocess
import sys
import textwrap
from fractions import Fraction

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from msdata_client.spec import JobSpec
from msdata_server.document import VlmSample
from msdata_server.errors import BadSampleError, ConfigError
from msdata_server.job.images import image_keys, source_transform
from msdata_server.sources.base import BAD_REASONS, BadSample
from msdata_server.transforms import load_transform, run_transform, vlm
from msdata_server.video import default_max_frames, frame_count, sample_indices

from .server_util import ROOT
from .video_util import MERGE, PATCH, TP, VIDEO_TOKEN, av, frames_of, index_frame, index_of, indices_of, make_clip

Image = pytest.importorskip("PIL.Image")

# frames kept at their size: 224 x 224 is 8 x 8 blocks of 28 pixels, inside these bounds
BOUNDS = "video_min_pixels=3136, video_max_pixels=50176"
VID = f'msdata_server.transforms:vlm(video_key="mp4;mkv;webm", text_key="txt", {BOUNDS})'


def transform(**kw):
    args = {"video_key": "mp4;mkv;webm", "text_key": "txt", "video_min_pixels": 3136, "video_max_pixels": 50176}
    return vlm(**{**args, **kw})


def run(fn, record) -> VlmSample:
    out = run_transform(fn, [record], seed=0, sample_ids=[7])[0]
    assert isinstance(out, VlmSample), out
    return out


def bad(fn, record) -> BadSample:
    out = run_transform(fn, [record], seed=0, sample_ids=[7])[0]
    assert isinstance(out, BadSample), out
    return out


@given(
    duration=st.floats(0, 500),
    total=st.integers(1, 20000),
    fps=st.floats(0.1, 8),
    min_frames=st.integers(1, 16),
    max_frames=st.integers(16, 768),
    tp=st.integers(1, 4),
)
def test_sampling_rule(duration, total, fps, min_frames, max_frames, tp):
    n = frame_count(duration, total, fps=fps, min_frames=min_frames, max_frames=max_frames, temporal_patch=tp)
    want = min(max(round(duration * fps), min_frames), max_frames, total)  # clamp, never more than the clip has
    assert n == max(tp, want // tp * tp)
    idx = sample_indices(total, n)
    assert idx.tolist() == np.round(np.linspace(0, total - 1, n)).astype(int).tolist()
    assert idx[0] == 0
    assert idx[-1] == total - 1 or n == 1
    assert (np.diff(idx) >= 0).all()


def test_default_max_frames_fit_seq_len():
    # 768 * 28 * 28 pixels a frame: 768 placeholders a temporal patch; 16384 // 768 = 21 temporal patches
    assert default_max_frames(seq_len=16384, patch=14, merge=2, temporal_patch=2, video_max_pixels=768 * 784) == 42
    assert default_max_frames(seq_len=None, patch=14, merge=2, temporal_patch=2, video_max_pixels=768 * 784) == 768
    assert default_max_frames(seq_len=10**7, patch=14, merge=2, temporal_patch=2, video_max_pixels=784) == 768
    assert default_max_frames(seq_len=100, patch=14, merge=2, temporal_patch=2, video_max_pixels=768 * 784) == 2


def test_clip_frames_in_order_and_grid():
    clip = make_clip(40, rate=10)  # 4 s: round(4 * 2) = 8 frames
    s = run(transform(), {"mp4": clip, "txt": b"hi"})
    want = np.round(np.linspace(0, 39, 8)).astype(int).tolist()
    assert s.video_grid_thw.tolist() == [[4, 16, 16]]  # 224 px = 16 patches of 14
    assert s.pixel_values_videos.dtype == np.uint8
    assert s.pixel_values_videos.shape == (4 * 256, 3 * TP * PATCH**2)
    assert indices_of(s.pixel_values_videos, s.video_grid_thw) == [want]
    # tokens: one placeholder per merge x merge patches of each temporal patch, then the text, then EOS
    n_ph = 4 * 16 * 16 // MERGE**2
    assert s.tokens[:n_ph].tolist() == [VIDEO_TOKEN] * n_ph
    assert s.tokens[n_ph:].tolist() == [ord("h"), ord("i"), 256]
    assert len(s.pixel_values) == 0
    assert s.image_grid_thw.shape == (0, 3)
    assert s.encoder_blocks().tolist() == [256] * 4  # the encoder attends within each temporal patch


def test_sparse_sampling_seeks_and_stays_exact():
    clip = make_clip(250, rate=25, gop=12)  # 10 s at 25 fps, a keyframe every 12 frames: the decoder seeks
    s = run(transform(fps=1.0), {"mp4": clip, "txt": b"x"})
    want = np.round(np.linspace(0, 249, 10)).astype(int).tolist()
    assert [i % 256 for i in want] == indices_of(s.pixel_values_videos, s.video_grid_thw)[0]


def test_bounds_min_max_frames_and_temporal_patch():
    clip = make_clip(61, rate=10)  # 6.1 s: round(12.2) = 12 frames by fps
    one = run(transform(max_frames=6), {"mp4": clip, "txt": b""})
    assert indices_of(one.pixel_values_videos, one.video_grid_thw) == [
        np.round(np.linspace(0, 60, 6)).astype(int).tolist()
    ]
    three = run(transform(fps=0.1, min_frames=5, temporal_patch=3), {"mp4": clip, "txt": b""})
    # clamp(round(0.61), 5, max) = 5, rounded down to a multiple of 3 = 3 frames: one temporal patch of 3
    assert three.video_grid_thw.tolist() == [[1, 16, 16]]
    assert three.pixel_values_videos.shape[1] == 3 * 3 * PATCH**2
    got = [index_of(f) for f in frames_of(three.pixel_values_videos, three.video_grid_thw[0], tp=3)]
    assert got == [0, 30, 60]


def test_single_frame_padded_to_temporal_patch():
    s = run(transform(), {"mp4": make_clip(1, rate=10), "txt": b""})
    assert s.video_grid_thw.tolist() == [[1, 16, 16]]
    frames = frames_of(s.pixel_values_videos, s.video_grid_thw[0])
    assert [index_of(f) for f in frames] == [0, 0]
    assert np.array_equal(frames[0], frames[1])


def test_frames_resized_within_bounds_every_frame_same_size():
    clip = make_clip(20, width=640, height=360, rate=10)
    s = run(transform(video_min_pixels=3136, video_max_pixels=100352), {"mp4": clip, "txt": b""})
    _t, h, w = s.video_grid_thw[0].tolist()
    assert (h * PATCH) * (w * PATCH) <= 100352
    assert h % MERGE == 0
    assert w % MERGE == 0
    assert w > h
    assert [index_of(f) for f in frames_of(s.pixel_values_videos, s.video_grid_thw[0])] == np.round(
        np.linspace(0, 19, 4)
    ).astype(int).tolist()


def test_images_then_videos_then_text():
    buf = io.BytesIO()
    Image.new("RGB", (56, 56), (200, 10, 10)).save(buf, "PNG")
    clips = [make_clip(20, rate=10), make_clip(10, width=112, height=112, rate=10)]
    s = run(transform(image_key="png"), {"png": [buf.getvalue()], "mp4": clips, "txt": b"ab"})
    assert s.image_grid_thw.tolist() == [[1, 4, 4]]
    assert s.video_grid_thw.tolist() == [[2, 16, 16], [2, 8, 8]]
    n_img, n_vid = 16 // 4, (2 * 256 + 2 * 64) // 4
    assert s.tokens[:n_img].tolist() == [258] * n_img
    assert s.tokens[n_img : n_img + n_vid].tolist() == [VIDEO_TOKEN] * n_vid
    assert s.tokens[n_img + n_vid :].tolist() == [ord("a"), ord("b"), 256]
    assert indices_of(s.pixel_values_videos, s.video_grid_thw) == [[0, 6, 13, 19], [0, 3, 6, 9]]
    assert s.encoder_blocks().tolist() == [16, 256, 256, 64, 64]
    # a text-only record of a video transform is a document too; an image-only one has no video keys' rows
    assert len(run(transform(), {"txt": b"only"}).video_grid_thw) == 0


def test_broken_clip_among_good_ones():
    fn = load_transform(VID)
    good = make_clip(20, rate=10)
    records = [
        {"mp4": good, "txt": b"a"},
        {"mp4": b"\x00not a video at all" * 50, "txt": b"b"},
        {"mkv": good, "txt": b"c"},
    ]
    out = run_transform(fn, records, seed=0, sample_ids=[1, 2, 3])
    assert isinstance(out[0], VlmSample)
    assert isinstance(out[2], VlmSample)
    assert isinstance(out[1], BadSample)
    assert out[1].reason == "video_decode_error"
    assert "does not open as a video" in out[1].detail
    assert {"video_decode_error", "video_tokens_exceed_seq_len"} <= set(BAD_REASONS)


def test_no_video_stream():
    buf = io.BytesIO()
    with av.open(buf, "w", format="matroska") as c:
        s = c.add_stream("pcm_s16le", rate=8000)
        frame = av.AudioFrame.from_ndarray(np.zeros((1, 800), np.int16), format="s16", layout="mono")
        frame.sample_rate = 8000
        for p in s.encode(frame):
            c.mux(p)
        for p in s.encode():
            c.mux(p)
    b = bad(transform(), {"mkv": buf.getvalue(), "txt": b""})
    assert b.reason == "video_decode_error"
    assert "no video stream" in b.detail


def test_truncated_clips():
    # moov at the end (PyAV's default): a cut loses the index, the clip does not open
    plain = make_clip(60, rate=10)
    assert bad(transform(), {"mp4": plain[: len(plain) * 2 // 3], "txt": b""}).reason == "video_decode_error"
    # a clip whose container states its duration up front (Matroska): what is there decodes, the missing sampled
    # frames repeat the last decoded one
    mkv = make_clip(60, rate=10, container="matroska")
    s = run(transform(), {"mkv": mkv[: len(mkv) * 2 // 3], "txt": b""})
    got = indices_of(s.pixel_values_videos, s.video_grid_thw)[0]
    want = np.round(np.linspace(0, 59, 12)).astype(int).tolist()
    k = next(i for i, (a, b) in enumerate(zip(got, want)) if a != b)
    assert k >= TP
    assert got[:k] == want[:k]
    assert set(got[k:]) == {got[k - 1]}
    # almost nothing left: bad
    assert bad(transform(), {"mkv": mkv[:600], "txt": b""}).reason == "video_decode_error"


def test_variable_frame_rate():
    buf = io.BytesIO()
    pts = [0, 1, 2, 5, 6, 7, 20, 21, 22, 23, 40, 41]  # in 1/10 s
    with av.open(buf, "w", format="matroska") as c:
        s = c.add_stream("libx264", rate=10)
        s.width = s.height = 224
        s.pix_fmt = "yuv420p"
        s.codec_context.time_base = s.time_base = Fraction(1, 10)
        for i, p in enumerate(pts):
            f = av.VideoFrame.from_ndarray(index_frame(i, 224, 224), "rgb24")
            f.pts, f.time_base = p, s.codec_context.time_base
            for q in s.encode(f):
                c.mux(q)
        for q in s.encode():
            c.mux(q)
    out = run(transform(), {"mkv": buf.getvalue(), "txt": b""})
    got = indices_of(out.pixel_values_videos, out.video_grid_thw)[0]
    assert len(got) % TP == 0
    assert len(got) >= 4
    assert got == sorted(got)
    assert got[0] == 0
    assert got[-1] == len(pts) - 1


def test_rotation_metadata():
    clip = make_clip(10, width=224, height=112, rate=10, rotation=90)
    s = run(transform(), {"mp4": clip, "txt": b""})
    _t, h, w = s.video_grid_thw[0].tolist()
    assert (h, w) == (16, 8)  # shown upright: 112 wide, 224 high
    frames = frames_of(s.pixel_values_videos, s.video_grid_thw[0])
    assert [index_of(np.rot90(f, k=-1)) for f in frames] == [0, 3, 6, 9]


@pytest.mark.parametrize(
    ("codec", "pix_fmt", "container"), [("libx264", "yuv420p10le", "mp4"), ("ffv1", "yuva420p", "matroska")]
)
def test_ten_bit_and_alpha_formats(codec, pix_fmt, container):
    clip = make_clip(10, rate=10, codec=codec, pix_fmt=pix_fmt, container=container)
    s = run(transform(), {"mkv": clip, "txt": b""})
    assert indices_of(s.pixel_values_videos, s.video_grid_thw) == [[0, 3, 6, 9]]


def test_odd_sizes_are_bad_samples():
    clip = make_clip(4, width=2, height=600, rate=10, codec="ffv1", pix_fmt="yuv444p", container="matroska")
    b = bad(transform(), {"mkv": clip, "txt": b""})
    assert b.reason == "transform_error"
    assert "aspect ratio" in b.detail


def test_video_tokens_exceed_seq_len():
    fn = transform(seq_len=200)  # one clip of 2 x 16 x 16 patches takes 128 placeholders; two take 256
    assert len(run(fn, {"mp4": make_clip(20, rate=10), "txt": b""}).video_grid_thw) == 1
    b = bad(fn, {"mp4": [make_clip(20, rate=10)] * 2, "txt": b""})
    assert b.reason == "video_tokens_exceed_seq_len"
    assert "max_frames" in b.detail


def job(transform_name: str, seq_len: int = 4096) -> JobSpec:
    return JobSpec.from_dict(
        {
            "job": {"name": "v", "seq_len": seq_len},
            "source": [{"name": "clips", "format": "webdataset", "paths": ["/x"], "transform": transform_name}],
            "mix": {"weights": {"clips": 1.0}},
            "balance": {"cost": "vlm"},
        }
    )


def test_job_refuses_bounds_a_clip_cannot_fit():
    t = 'msdata_server.transforms:vlm(video_key="mp4", max_frames=64, video_max_pixels=200704)'
    with pytest.raises(ConfigError, match=r"max_frames=64 .* 8192 placeholder tokens.*seq_len=4096"):
        image_keys(job(t))
    with pytest.raises(ConfigError, match="max_frames"):
        source_transform(job(t), job(t).sources[0])
    ok = job('msdata_server.transforms:vlm(video_key="mp4", max_frames=32, video_max_pixels=200704)')
    keys = image_keys(ok)
    assert keys is not None
    assert keys.video == 2
    assert keys.video_row == 3 * 2 * 14 * 14
    # the default max_frames fits whatever the job's seq_len; the job's token ids and seq_len are bound
    spec = job('msdata_server.transforms:vlm(video_key="mp4")', seq_len=1024)
    name = source_transform(spec, spec.sources[0])
    assert "seq_len=1024" in name
    assert image_keys(job("msdata_server.transforms:vlm()")).video is None  # no video_key: no video keys


def test_bad_arguments_are_config_errors():
    with pytest.raises(ConfigError, match="fps"):
        vlm(video_key="mp4", fps=0)
    with pytest.raises(ConfigError, match="min_frames=8 is more than max_frames=4"):
        vlm(video_key="mp4", min_frames=8, max_frames=4)
    with pytest.raises(ConfigError, match="temporal_patch"):
        vlm(video_key="mp4", temporal_patch=0)


def test_video_token_id_in_the_job():
    with pytest.raises(ConfigError, match="video_token_id"):
        JobSpec.from_dict(
            {
                "job": {"name": "v", "video_token_id": 258},
                "source": [{"name": "a", "format": "jsonl", "paths": ["/x"]}],
                "mix": {"weights": {"a": 1.0}},
            }
        )
    spec = job('msdata_server.transforms:vlm(video_key="mp4")')
    other = JobSpec.from_dict({**spec.to_dict(), "job": {**spec.to_dict()["job"], "video_token_id": 300}})
    assert other.data_digest() != spec.data_digest()
    assert "video_token_id" not in spec.to_dict()["job"]
    assert "video_token_id=300" in source_transform(other, other.sources[0])
    fn = load_transform(source_transform(other, other.sources[0]))
    s = run(fn, {"mp4": make_clip(10, rate=10), "caption": "x"})
    assert set(s.tokens[:-2].tolist()) == {300}


_MEMORY = textwrap.dedent(
    """
    import json, resource, sys
    from msdata_server.transforms import vlm
    clip = open(sys.argv[1], "rb").read()
    fn = vlm(video_key="mp4", text_key="txt", fps=2.0, max_frames=64)
    fn({"mp4": clip[:], "txt": b""})  # warm up: libraries loaded, allocator pools made
    def rss():
        for line in open("/proc/self/status"):
            if line.startswith("VmRSS"):
                return int(line.split()[1]) * 1024
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")  # reset the peak (VmHWM) to now
    base = rss()
    s = fn({"mp4": clip, "txt": b""})
    peak = [int(l.split()[1]) * 1024 for l in open("/proc/self/status") if l.startswith("VmHWM")][0]
    print(json.dumps({"peak": peak - base, "sample": s.pixel_values_videos.nbytes, "grid": s.video_grid_thw.tolist()}))
    """
)


def test_worker_memory_bounded_while_decoding_a_long_large_clip(tmp_path):
    """A 1280x720 clip of 300 frames decodes to 830 MB; sampled at 2 fps it is 20 frames at <= 768*28*28 pixels.
    The decoding process's peak over its resting size stays within twice the sample plus 64 MiB."""

    def content(i, h, w):
        a = np.empty((h, w, 3), np.uint8)
        a[...] = (np.arange(w, dtype=np.uint16)[None, :, None] + 7 * i).astype(np.uint8)
        return a

    path = tmp_path / "long.mp4"
    path.write_bytes(make_clip(300, width=1280, height=720, rate=30, content=content))
    out = subprocess.run(
        [sys.executable, "-c", _MEMORY, str(path)],
        capture_output=True,
        text=True,
        timeout=300,
        cwd=ROOT,
        env={"PYTHONPATH": str(ROOT), "PATH": "/usr/bin:/bin"},
    )
    assert out.returncode == 0, out.stderr
    got = json.loads(out.stdout.strip().splitlines()[-1])
    assert got["grid"][0][0] == 10  # 20 frames
    assert got["peak"] <= 2 * got["sample"] + (64 << 20), got
    assert got["sample"] > 10 << 20  # the bound is not trivial: the whole clip decoded would be 830 MB


def test_bad_sample_error_carries_reason():
    with pytest.raises(BadSampleError) as e:
        transform()({"mp4": b"junk", "txt": b""})
    assert e.value.reason == "video_decode_error"  # type: ignore[attr-defined]


def test_give_up_limits(monkeypatch):
    import msdata_server.video as video

    clip = make_clip(40, rate=10)  # 4 s
    monkeypatch.setattr(video, "GIVE_UP_DURATION_S", 3.0)
    b = bad(transform(), {"mp4": clip, "txt": b""})
    assert b.reason == "video_decode_error"
    assert "give-up limit" in b.detail
    monkeypatch.setattr(video, "GIVE_UP_DURATION_S", 3600.0)
    monkeypatch.setattr(video, "GIVE_UP_DECODED_FRAMES", 10)
    b = bad(transform(), {"mp4": clip, "txt": b""})
    assert b.reason == "video_decode_error"
    assert "give-up limit" in b.detail
