"""Video clips for the ``vlm`` transform: which frames to sample (Qwen2-VL's rule) and decoding only those, with
PyAV (FFmpeg), straight into temporal patches.

A clip is never held decoded: the frames are decoded in order (seeking past a keyframe when the next sampled
frame lies beyond it), each sampled frame is converted to RGB at its target size by swscale and written into
its place in the sample's ``pixel_values_videos`` at once, so a worker holds the sample it produces plus the
decoder's few reference frames, whatever the clip's length or resolution.

Row layout (Hugging Face Qwen2-VL): a clip of ``t`` temporal patches of ``h x w`` patches has ``t * h * w`` rows,
temporal patch by temporal patch; within one, the merge x merge patches of a placeholder are adjacent; a row
is ``3 * temporal_patch * patch * patch`` bytes, flattened channel, frame, row, column.
"""

from __future__ import annotations

import contextlib
import io
import math
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import numpy as np

from .errors import BadSampleError, ConfigError

__all__ = [
    "GIVE_UP_DECODED_FRAMES",
    "GIVE_UP_DURATION_S",
    "GIVE_UP_SIDE",
    "Clip",
    "VideoError",
    "decode_clip",
    "default_max_frames",
    "frame_count",
    "sample_indices",
]

# Give-up limits: a clip past them is a bad sample (video_decode_error) rather than hours of a worker's time
GIVE_UP_DURATION_S = 6 * 3600.0  # longer than this (by its container) is refused before decoding
GIVE_UP_SIDE = 16384  # a frame side in pixels (the encoder's own limit is near it)
GIVE_UP_DECODED_FRAMES = 200_000  # frames decoded for one clip (sampled or passed over)
MAX_FRAMES_CAP = 768  # Qwen2-VL's most frames per clip; the default max_frames never exceeds it


class VideoError(BadSampleError):
    """A clip that cannot become a sample; ``reason`` is one of sources.base.BAD_REASONS."""

    def __init__(self, reason: str, message: str):
        super().__init__(message)
        self.reason = reason


def default_max_frames(
    *, seq_len: int | None, patch: int, merge: int, temporal_patch: int, video_max_pixels: int
) -> int:
    """The most frames that keep one clip's placeholders within seq_len when every frame is at video_max_pixels
    (``seq_len // per_temporal_patch * temporal_patch``), capped at 768; at least temporal_patch."""
    if seq_len is None:
        return MAX_FRAMES_CAP
    per = max(1, video_max_pixels // (patch * merge) ** 2)
    return max(temporal_patch, min(MAX_FRAMES_CAP, seq_len // per * temporal_patch))


def frame_count(
    duration: float, total: int, *, fps: float, min_frames: int, max_frames: int, temporal_patch: int
) -> int:
    """Frames to sample: ``clamp(round(duration * fps), min_frames, max_frames)``, never more than the clip has
    (a clip of one frame gives one, padded below), rounded down to a multiple of temporal_patch, at least it."""
    n = min(max(round(duration * fps), min_frames), max_frames, max(total, 1))
    return max(temporal_patch, n // temporal_patch * temporal_patch)


def sample_indices(total: int, nframes: int) -> np.ndarray:
    """int64 frame indices ``round(linspace(0, total - 1, nframes))``: evenly over the clip, first and last
    included; with fewer frames than asked the last ones repeat (a one-frame clip is padded with itself)."""
    idx = np.round(np.linspace(0, max(total - 1, 0), nframes)).astype(np.int64)
    return np.minimum(idx, max(total - 1, 0))


@dataclass(frozen=True, slots=True)
class Clip:
    """One decoded clip: ``values`` uint8 ``[t * h * w, 3 * temporal_patch * patch * patch]`` (module docstring)
    and its grid ``(t, h, w)`` in temporal patches and patches."""

    values: np.ndarray
    grid: tuple[int, int, int]


@dataclass(frozen=True, slots=True, kw_only=True)
class _Probe:
    """What the container says of a clip's video stream."""

    start: float  # seconds of the first frame
    step: float  # seconds between frames (nominal)
    duration: float
    total: int  # frames
    keyframes: np.ndarray  # float64 seconds of keyframes from the container's index (may be empty)


def _probe(container, stream, where: str) -> _Probe:
    tb = float(stream.time_base) if stream.time_base else 0.0
    rate = stream.average_rate or stream.guessed_rate or stream.base_rate
    rate = float(rate) if rate else 0.0
    if stream.duration is not None and tb:
        duration = stream.duration * tb
    elif container.duration is not None:
        duration = container.duration / 1e6  # AV_TIME_BASE
    else:
        duration = 0.0
    if not math.isfinite(duration) or duration < 0:
        duration = 0.0
    if duration > GIVE_UP_DURATION_S:
        raise VideoError(
            "video_decode_error", f"{where}: {duration:.0f} s long, over the give-up limit {GIVE_UP_DURATION_S:.0f} s"
        )
    total = int(stream.frames or 0)
    if total <= 0:
        total = max(1, round(duration * rate)) if rate > 0 else 1
    step = 1.0 / rate if rate > 0 else (duration / total if total and duration > 0 else 0.0)
    start = stream.start_time * tb if stream.start_time is not None and tb else 0.0
    keys = np.zeros(0)
    try:
        entries = stream.index_entries
        if entries is not None and len(entries) and tb:
            ts = [e.timestamp for e in entries if e.is_keyframe]
            keys = np.asarray(ts, dtype=np.float64) * tb
    except (AttributeError, TypeError, ValueError):  # an older PyAV or a demuxer without an index
        keys = np.zeros(0)
    return _Probe(start=start, step=step, duration=duration, total=total, keyframes=keys)


NO_INDEX_SEEK_S = 5.0  # without a keyframe index, seek only to frames this far ahead of the last decoded one


def _frames(container, stream, probe: _Probe, times: np.ndarray, where: str) -> Iterator[tuple[int, Any]]:
    """(k, frame) for each sampled time ``times[k]`` in order: the first frame at or after it (within half a
    frame), decoding forward and seeking ahead when a keyframe lies between the last decoded frame and the
    next sampled one (so sparse sampling of a long clip decodes little more than the frames it keeps). Stops
    early at the end of the data (a truncated clip)."""
    eps = probe.step / 2 if probe.step > 0 else 1e-6
    tb = float(stream.time_base)
    n, k, pos, decoded, seeked = len(times), 0, probe.start, 0, -1

    def ahead(t: float) -> bool:
        if probe.keyframes.size:
            i = int(np.searchsorted(probe.keyframes, t + eps, side="right")) - 1
            return i >= 0 and probe.keyframes[i] > pos + eps
        return t - pos > NO_INDEX_SEEK_S

    while k < n:
        if k != seeked and ahead(float(times[k])):
            seeked = k
            with contextlib.suppress(Exception):  # av.FFmpegError: a stream that cannot seek is read on
                container.seek(int(max(times[k] - eps, 0.0) / tb), stream=stream, backward=True, any_frame=False)
        again = False
        try:
            for packet in container.demux(stream):
                for frame in packet.decode():
                    decoded += 1
                    if decoded > GIVE_UP_DECODED_FRAMES:
                        raise VideoError(
                            "video_decode_error",
                            f"{where}: decoded {decoded} frames without reaching the sampled ones (give-up limit)",
                        )
                    t = frame.time if frame.pts is not None else pos + probe.step
                    pos = t
                    while k < n and t >= times[k] - eps:
                        yield k, frame
                        k += 1
                    if k == n:
                        return
                    if k != seeked and ahead(float(times[k])):
                        again = True
                        break
                if again:
                    break
        except VideoError:
            raise
        except Exception:  # av.FFmpegError and friends: damaged data ends the clip here
            return
        if not again:
            return  # end of the data


def _rgb(scaler, frame, width: int, height: int) -> np.ndarray:
    """uint8 [height, width, 3] of a frame, resized (bicubic) and made RGB; an alpha channel over white.
    ``scaler`` (one VideoReformatter per clip) keeps swscale's context from frame to frame: building it
    costs more than converting a frame."""
    if any(c.is_alpha for c in frame.format.components):
        a = scaler.reformat(frame, width, height, "rgba", interpolation="BICUBIC").to_ndarray()
        alpha = a[..., 3:4].astype(np.uint16)
        return ((a[..., :3] * alpha + 255 * (255 - alpha) + 127) // 255).astype(np.uint8)
    # planar RGB: swscale's planar path converts and resizes several times faster than packed rgb24;
    # to_ndarray gives it back as [height, width, 3] in R, G, B order
    return scaler.reformat(frame, width, height, "gbrp", interpolation="BICUBIC").to_ndarray()


def decode_clip(
    blob,
    where: str,
    *,
    patch: int,
    merge: int,
    temporal_patch: int,
    fps: float,
    min_frames: int,
    max_frames: int,
    size: Callable[[int, int], tuple[int, int]],
) -> Clip:
    """One clip's bytes -> its temporal patches (module docstring). ``size(height, width)`` gives the frame size
    to resize to (``transforms.smart_resize`` with the video bounds; ValueError refuses the clip). A clip that
    does not open, has no video stream or is past the give-up limits is a VideoError (video_decode_error); a
    truncated one keeps what decodes of it, the missing sampled frames repeating the last decoded one, when at
    least one temporal patch decoded."""
    try:
        import av
    except ImportError:
        raise ConfigError(
            "video in the vlm transform needs PyAV: pip install 'msdata[video]' (or pip install av)"
        ) from None
    if not isinstance(blob, (bytes, bytearray, memoryview)):
        raise VideoError("video_decode_error", f"{where} is a {type(blob).__name__}, not encoded bytes")
    try:
        container = av.open(io.BytesIO(blob), mode="r")
    except Exception as e:  # av.FFmpegError (InvalidDataError...), or an error of the container's header
        raise VideoError("video_decode_error", f"{where} does not open as a video: {type(e).__name__}: {e}") from None
    try:
        if not container.streams.video:
            raise VideoError(
                "video_decode_error", f"{where} has no video stream ({len(container.streams)} other streams)"
            )
        stream = container.streams.video[0]
        stream.codec_context.thread_count = 1  # frame threads would hold more frames; a worker is one core anyway
        probe = _probe(container, stream, where)
        nframes = frame_count(
            probe.duration,
            probe.total,
            fps=fps,
            min_frames=min_frames,
            max_frames=max_frames,
            temporal_patch=temporal_patch,
        )
        idx = sample_indices(probe.total, nframes)
        times = probe.start + idx * probe.step
        scaler = av.video.reformatter.VideoReformatter()
        return _decode(
            container,
            stream,
            probe,
            times,
            where,
            patch=patch,
            merge=merge,
            tp=temporal_patch,
            size=size,
            scaler=scaler,
        )
    finally:
        container.close()


def _decode(container, stream, probe, times, where, *, patch, merge, tp, size, scaler) -> Clip:
    n = len(times)
    out = view = None
    gh = gw = th = tw = rot = 0
    last, prev, cut = -1, None, None
    for k, frame in _frames(container, stream, probe, times, where):
        if out is None:  # the first sampled frame fixes the clip's size (later frames are resized to it)
            rot = round((frame.rotation or 0) / 90) % 4 if hasattr(frame, "rotation") else 0
            h, w = (frame.width, frame.height) if rot % 2 else (frame.height, frame.width)
            if max(h, w) > GIVE_UP_SIDE:
                raise VideoError("video_decode_error", f"{where}: {w}x{h} frames, a side over {GIVE_UP_SIDE}")
            try:
                th, tw = size(h, w)
            except ValueError as e:
                raise VideoError("transform_error", f"{where}: {w}x{h} frames: {e}") from None
            gh, gw = th // patch, tw // patch
            out = np.empty((n // tp * gh * gw, 3 * tp * patch * patch), dtype=np.uint8)
            # (t, bh, bw, mh, mw, c, frame, ph, pw): a frame's patches land at [:, ..., frame, :, :]
            view = out.reshape(n // tp, gh // merge, gw // merge, merge, merge, 3, tp, patch, patch)
        if frame is not prev:  # a repeated index (a clip shorter than its samples) reuses the frame's patches
            a = _rgb(scaler, frame, th if rot % 2 else tw, tw if rot % 2 else th)
            if rot:
                a = np.rot90(a, k=rot)
            cut = a.reshape(gh // merge, merge, patch, gw // merge, merge, patch, 3).transpose(0, 3, 1, 4, 6, 2, 5)
            prev = frame
        assert view is not None
        assert cut is not None
        view[k // tp, ..., k % tp, :, :] = cut
        last = k
    if out is None or view is None:
        raise VideoError("video_decode_error", f"{where}: no frame decodes")
    if last + 1 < n:  # truncated: the container promised frames that are not there
        if last + 1 < tp:
            raise VideoError("video_decode_error", f"{where}: truncated, {last + 1} of {n} sampled frames decode")
        for k in range(last + 1, n):
            view[k // tp, ..., k % tp, :, :] = view[last // tp, ..., last % tp, :, :]
    return Clip(out, (n // tp, gh, gw))
