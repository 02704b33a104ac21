"""Decoding images, videos and audio within limits, with errors that say what is wrong.

Every medium is checked against `MediaLimits` before it can cost memory: an image's size is read
from its header and one far past the pixel limit is refused before decoding (a decompression
bomb), one moderately past it is shrunk to fit; a video longer than `max_frames` and audio longer
than `max_audio_seconds` or at another sample rate than the model's feature extractor wants are
refused. Every failure is a `MediaError` whose reason the run counts.

Formats: images as anything Pillow reads; videos as frame files, an animated GIF / WebP, a `.npy`
array (frames, height, width, 3) of uint8, or a container file (MP4, ...) when PyAV is
installed; audio as WAV (PCM), or any format `soundfile` reads when it is installed.
"""

from __future__ import annotations

import io
import math
import wave
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from streamrl.media.refs import MediaError, MediaRef

# An image this many times past `max_pixels` is refused unread rather than shrunk.
BOMB_FACTOR = 64


@dataclass(frozen=True)
class MediaLimits:
    """Per medium and per prompt limits (`data.media` in the config sets them)."""

    max_pixels: int = 1280 * 28 * 28  # an image, or one video frame: larger ones are shrunk
    max_frames: int = 64
    max_audio_seconds: float = 30.0
    audio_rate: int = 16000  # what the feature extractor takes; other rates are refused
    max_media: int = 8  # media of one prompt
    video_fps: float = 2.0  # frames a second of a video that does not say (frame files, .npy)


def load_media(ref: MediaRef, limits: MediaLimits):
    """The decoded medium: an RGB `PIL.Image`, a uint8 array (frames, H, W, 3), or float32 mono
    samples at `limits.audio_rate`."""
    loader = {"image": load_image, "video": load_video, "audio": load_audio}[ref.kind]
    return loader(ref, limits)


def load_image(ref: MediaRef, limits: MediaLimits):
    from PIL import Image, UnidentifiedImageError

    try:
        image = Image.open(_source(ref))
        _check_pixels(ref, image.size, limits)
        image.load()
    except MediaError:
        raise
    except Image.DecompressionBombError as e:
        raise MediaError("too_large", f"{ref.describe()}: {e}") from None
    except (UnidentifiedImageError, OSError, SyntaxError, ValueError) as e:
        raise MediaError("corrupt", f"cannot decode {ref.describe()}: {e}") from None
    return fit_pixels(image.convert("RGB"), limits.max_pixels)


def fit_pixels(image, max_pixels: int):
    """`image` shrunk (aspect kept) to at most `max_pixels` pixels, or itself if it fits."""
    from PIL import Image

    width, height = image.size
    if width * height <= max_pixels:
        return image
    scale = math.sqrt(max_pixels / (width * height))
    size = (max(1, int(width * scale)), max(1, int(height * scale)))
    return image.resize(size, Image.Resampling.BICUBIC)


def video_fps(ref: MediaRef, limits: MediaLimits) -> float:
    """Frames a second of the video `ref`: an animated image's frame duration, a container's
    average rate, else `limits.video_fps`. A Qwen-VL model's time positions come from it: a
    wrong rate puts frames a second apart at one time position (or far apart)."""
    name = (ref.path or "").lower()
    if ref.frames is None and not name.endswith(".npy"):
        from PIL import Image, UnidentifiedImageError

        try:
            with Image.open(_source(ref)) as image:
                duration_ms = image.info.get("duration")
            if duration_ms:
                return 1000.0 / float(duration_ms)
        except (UnidentifiedImageError, OSError):
            try:
                import av

                with av.open(_source(ref)) as container:
                    rate = container.streams.video[0].average_rate
                if rate:
                    return float(rate)
            except Exception:  # noqa: BLE001 - no rate to read: the default below
                pass
    return limits.video_fps


def load_video(ref: MediaRef, limits: MediaLimits) -> np.ndarray:
    if ref.frames is not None:
        if len(ref.frames) > limits.max_frames:
            raise _too_many(ref, len(ref.frames), limits)
        frames = [np.asarray(load_image(MediaRef("image", path=f), limits)) for f in ref.frames]
    else:
        frames = _decode_video(ref, limits)
    if not frames:
        raise MediaError("corrupt", f"{ref.describe()} has no frames")
    shapes = {f.shape for f in frames}
    if len(shapes) > 1:
        raise MediaError("corrupt", f"{ref.describe()} has frames of different sizes {shapes}")
    return np.stack(frames)


def _decode_video(ref: MediaRef, limits: MediaLimits) -> list[np.ndarray]:
    name = (ref.path or "").lower()
    if name.endswith(".npy"):
        array = _load_npy(ref)
        if array.ndim != 4 or array.shape[-1] != 3 or array.dtype != np.uint8:
            raise MediaError(
                "corrupt",
                f"{ref.describe()} must be a uint8 array (frames, height, width, 3), "
                f"got {array.dtype} {array.shape}",
            )
        if len(array) > limits.max_frames:
            raise _too_many(ref, len(array), limits)
        _check_pixels(ref, (array.shape[2], array.shape[1]), limits)
        return [_fit_frame(f, limits) for f in array]
    from PIL import Image, ImageSequence, UnidentifiedImageError

    try:
        image = Image.open(_source(ref))
    except (UnidentifiedImageError, OSError) as e:
        return _decode_container(ref, limits, e)
    if getattr(image, "n_frames", 1) > limits.max_frames:
        raise _too_many(ref, image.n_frames, limits)
    _check_pixels(ref, image.size, limits)
    try:
        frames = [f.convert("RGB") for f in ImageSequence.Iterator(image)]
    except (OSError, ValueError) as e:
        raise MediaError("corrupt", f"cannot decode {ref.describe()}: {e}") from None
    return [np.asarray(fit_pixels(f, limits.max_pixels)) for f in frames]


def _decode_container(ref: MediaRef, limits: MediaLimits, pil_error) -> list[np.ndarray]:
    try:
        import av
    except ImportError:
        raise MediaError(
            "unsupported",
            f"cannot decode {ref.describe()} ({pil_error}): give videos as frame files, an "
            "animated GIF or WebP, or a .npy array, or `pip install av` for MP4 and other "
            "containers",
        ) from None
    frames = []
    try:
        with av.open(_source(ref)) as container:
            for frame in container.decode(video=0):
                if len(frames) == limits.max_frames:
                    raise _too_many(ref, f"more than {limits.max_frames}", limits)
                frames.append(_fit_frame(frame.to_ndarray(format="rgb24"), limits))
    except MediaError:
        raise
    except Exception as e:  # PyAV raises its own error classes for every damaged file
        raise MediaError("corrupt", f"cannot decode {ref.describe()}: {e}") from None
    return frames


def _fit_frame(frame: np.ndarray, limits: MediaLimits) -> np.ndarray:
    from PIL import Image

    return np.asarray(fit_pixels(Image.fromarray(frame), limits.max_pixels))


def load_audio(ref: MediaRef, limits: MediaLimits) -> np.ndarray:
    samples, rate = _decode_audio(ref)
    if rate != limits.audio_rate:
        raise MediaError(
            "wrong_rate",
            f"{ref.describe()} is sampled at {rate} Hz; the model's feature extractor takes "
            f"{limits.audio_rate} Hz: resample it (for example `ffmpeg -i in.wav -ar "
            f"{limits.audio_rate} out.wav`)",
        )
    seconds = len(samples) / rate
    if seconds > limits.max_audio_seconds:
        raise MediaError(
            "too_long",
            f"{ref.describe()} lasts {seconds:.1f} s, over data.media.max_audio_seconds="
            f"{limits.max_audio_seconds}",
        )
    return samples


def encode_wav(samples: np.ndarray, rate: int, channels: int = 1) -> bytes:
    """16-bit PCM WAV bytes of float samples in [-1, 1] (clipped), each sample repeated on
    `channels` channels: what `_decode_audio` reads back to within 16-bit rounding."""
    pcm = (np.clip(np.asarray(samples, dtype=np.float64), -1, 1) * 32767).astype(np.int16)
    out = io.BytesIO()
    with wave.open(out, "wb") as wav:
        wav.setnchannels(channels)
        wav.setsampwidth(2)
        wav.setframerate(rate)
        wav.writeframes(np.repeat(pcm, channels).tobytes())
    return out.getvalue()


def _decode_audio(ref: MediaRef) -> tuple[np.ndarray, int]:
    """Mono float32 samples in [-1, 1] and the sample rate."""
    try:
        with wave.open(_source(ref), "rb") as wav:
            rate, width, channels = wav.getframerate(), wav.getsampwidth(), wav.getnchannels()
            raw = wav.readframes(wav.getnframes())
    except (wave.Error, EOFError) as wav_error:
        return _decode_soundfile(ref, wav_error)
    except OSError as e:
        raise MediaError("missing", f"cannot read {ref.describe()}: {e}") from None
    if width not in (1, 2, 4):
        raise MediaError("unsupported", f"{ref.describe()} has {8 * width}-bit samples")
    dtype = {1: np.uint8, 2: np.int16, 4: np.int32}[width]
    samples = np.frombuffer(raw, dtype=dtype).astype(np.float32)
    samples = (samples - 128.0) / 128.0 if width == 1 else samples / float(2 ** (8 * width - 1))
    return samples.reshape(-1, channels).mean(axis=1), rate


def _decode_soundfile(ref: MediaRef, wav_error) -> tuple[np.ndarray, int]:
    try:
        import soundfile
    except ImportError:
        raise MediaError(
            "corrupt" if (ref.path or "").lower().endswith(".wav") else "unsupported",
            f"cannot decode {ref.describe()} as WAV ({wav_error}); `pip install soundfile` "
            "reads FLAC, OGG and other formats",
        ) from None
    try:
        samples, rate = soundfile.read(_source(ref), dtype="float32", always_2d=True)
    except Exception as e:  # soundfile's LibsndfileError and friends
        raise MediaError("corrupt", f"cannot decode {ref.describe()}: {e}") from None
    return samples.mean(axis=1), int(rate)


def _source(ref: MediaRef):
    """A file object or path for the medium; a missing file is a `MediaError`."""
    if ref.data is not None:
        return io.BytesIO(ref.data)
    if not Path(ref.path).is_file():
        raise MediaError("missing", f"{ref.describe()}: no such file")
    return ref.path


def _load_npy(ref: MediaRef) -> np.ndarray:
    try:
        return np.load(_source(ref), allow_pickle=False)
    except MediaError:
        raise
    except (OSError, ValueError) as e:
        raise MediaError("corrupt", f"cannot read {ref.describe()}: {e}") from None


def _check_pixels(ref: MediaRef, size: tuple[int, int], limits: MediaLimits) -> None:
    width, height = size
    if width * height > BOMB_FACTOR * limits.max_pixels:
        raise MediaError(
            "too_large",
            f"{ref.describe()} is {width}x{height}, over {BOMB_FACTOR}x data.media.max_pixels="
            f"{limits.max_pixels}: shrink it before training",
        )


def _too_many(ref: MediaRef, frames, limits: MediaLimits) -> MediaError:
    return MediaError(
        "too_many_frames",
        f"{ref.describe()} has {frames} frames, over data.media.max_frames={limits.max_frames}: "
        "sample fewer frames (a lower fps) or raise the limit",
    )
