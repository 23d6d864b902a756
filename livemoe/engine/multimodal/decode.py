"""Media bytes from where a request names them (a data URL, base64, or a local path where allowed) and their
decoding: WAV with the standard library's `wave`, images and animated GIF / WebP / TIFF (video) with PIL. Every
failure is a MediaError naming the item."""
import base64
import binascii
import io
import os
import wave

import numpy as np

from livemoe.engine.errors import MediaError


def media_bytes(ref: str, name: str, local_root: str | None) -> bytes:
    """ref: a data URL (data:<mime>;base64,<data>), a file:// URL or a path. Paths are read only under local_root
    (None: never; "/": anywhere, what the offline LLM allows)."""
    if not isinstance(ref, str) or not ref:
        raise MediaError(f"{name}: expected a data URL or a path, got {type(ref).__name__}")
    if ref.startswith("data:"):
        head, sep, data = ref.partition(",")
        if not sep or not head.endswith(";base64"):
            raise MediaError(f"{name}: a data URL must be data:<type>;base64,<data>")
        return b64(data, name)
    if ref.startswith(("http://", "https://")):
        raise MediaError(f"{name}: URLs are not fetched (the engine makes no network requests); send a data URL")
    path = ref.removeprefix("file://")
    if local_root is None:
        raise MediaError(f"{name}: local paths are not allowed here (start the server with "
                         "--allowed-local-media-path DIR to allow them under DIR); send a data URL")
    real, root = os.path.realpath(path), os.path.realpath(local_root)
    if os.path.commonpath([real, root]) != root:
        raise MediaError(f"{name}: {path!r} is outside the allowed media directory {local_root!r}")
    if not os.path.isfile(real):
        raise MediaError(f"{name}: {path!r} is not a file")
    with open(real, "rb") as f:
        return f.read()


def b64(data: str, name: str) -> bytes:
    try:
        return base64.b64decode(data, validate=True)
    except (binascii.Error, ValueError):
        raise MediaError(f"{name}: not valid base64") from None


def decode_wav(raw: bytes, name: str, sample_rate: int, max_seconds: float) -> np.ndarray:
    """-> float32 mono waveform in [-1, 1] (channels averaged). The sample rate must be `sample_rate`: the engine does
    not resample (resampling well needs a DSP library this package does not depend on)."""
    try:
        with wave.open(io.BytesIO(raw)) as w:
            rate, channels, width, frames = w.getframerate(), w.getnchannels(), w.getsampwidth(), w.getnframes()
            if rate != sample_rate:
                raise MediaError(f"{name}: sample rate {rate} Hz; this model takes {sample_rate} Hz audio "
                                 "(resample it first)")
            if frames > max_seconds * rate:
                raise MediaError(f"{name}: {frames / rate:.1f} s of audio; at most {max_seconds:g} s per item "
                                 "(max_audio_seconds)")
            pcm = w.readframes(frames)
    except MediaError:
        raise
    except (wave.Error, EOFError, ValueError) as e:
        raise MediaError(f"{name}: not a PCM WAV file ({e})") from None
    if width == 1:
        x = (np.frombuffer(pcm, np.uint8).astype(np.float32) - 128) / 128
    elif width in (2, 4):
        x = np.frombuffer(pcm, f"<i{width}").astype(np.float32) / float(2 ** (8 * width - 1))
    elif width == 3:
        b = np.frombuffer(pcm, np.uint8).reshape(-1, 3).astype(np.int32)
        x = ((b[:, 0] | (b[:, 1] << 8) | (b[:, 2] << 16)) << 8 >> 8).astype(np.float32) / 2 ** 23
    else:
        raise MediaError(f"{name}: {8 * width}-bit samples are not supported")
    if x.size == 0:
        raise MediaError(f"{name}: the audio is empty")
    return x.reshape(-1, channels).mean(axis=1)


def open_image(raw: bytes, name: str):
    from PIL import Image, UnidentifiedImageError

    try:
        image = Image.open(io.BytesIO(raw))
        image.load()
    except (UnidentifiedImageError, OSError, ValueError, Image.DecompressionBombError) as e:
        raise MediaError(f"{name}: not a readable image ({e})") from None
    return image


def decode_image(raw: bytes, name: str) -> np.ndarray:
    """-> uint8 RGB [H, W, 3]."""
    return np.asarray(open_image(raw, name).convert("RGB"))


def decode_video(raw: bytes, name: str, fps: float, max_frames: int) -> list[np.ndarray]:
    """An animated image (GIF, WebP, APNG, TIFF pages) sampled at `fps` -> uint8 RGB frames [H, W, 3]. Frame timing
    from each frame's `duration` (ms; 100 when absent). Containers such as MP4 need a video decoder this package
    does not depend on: convert them to animated WebP or send frames as images."""
    image = open_image(raw, name)
    starts, frames, t = [], [], 0.0
    for i in range(getattr(image, "n_frames", 1)):
        image.seek(i)
        frames.append(np.asarray(image.convert("RGB")))
        starts.append(t)
        t += (image.info.get("duration") or 100) / 1000
    sampled, k = [], 0
    for j in range(int(t * fps) or 1):
        while k + 1 < len(starts) and starts[k + 1] <= j / fps:
            k += 1
        sampled.append(frames[k])
    if len(sampled) > max_frames:
        raise MediaError(f"{name}: {len(sampled)} frames at {fps:g} fps; at most {max_frames} per video "
                         "(max_video_frames)")
    return sampled
