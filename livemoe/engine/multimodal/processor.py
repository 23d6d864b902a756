"""MediaProcessor: decoded media -> MediaItem (the encoder's input and its placeholder count), for one thinker.

Audio: 16 kHz mono -> log-mel features as Qwen3-Omni's processor makes them (transformers' WhisperFeatureExtractor,
numpy only). Images and video frames: scaled so both sides are multiples of patch_size * spatial_merge_size within
the pixel limits (transformers' smart_resize rule), normalised with CLIP's mean and std, and cut into patches in the
order the vision encoder reads them (merge windows together; video frames in pairs of temporal_patch_size).
"""
import numpy as np
import torch

from livemoe.engine.decoder.config import EngineConfig
from livemoe.engine.errors import MediaError
from livemoe.engine.model.omni.config import OmniConfig
from livemoe.engine.model.omni.positions import audio_token_count, vision_token_count
from livemoe.engine.multimodal.decode import decode_image, decode_video, decode_wav
from livemoe.engine.multimodal.media import MediaItem

SAMPLE_RATE = 16000
CLIP_MEAN = np.array([0.48145466, 0.4578275, 0.40821073], np.float32)
CLIP_STD = np.array([0.26862954, 0.26130258, 0.27577711], np.float32)


class MediaProcessor:
    def __init__(self, omni: OmniConfig, config: EngineConfig):
        from transformers import WhisperFeatureExtractor

        self.omni, self.config = omni, config
        audio, vision = omni.audio_config, omni.vision_config
        self.mel = WhisperFeatureExtractor(feature_size=int(audio.get("num_mel_bins", 128)), sampling_rate=SAMPLE_RATE)
        self.n_window = int(audio.get("n_window", 50))
        self.patch = int(vision.get("patch_size", 16))
        self.temporal_patch = int(vision.get("temporal_patch_size", 2))
        self.merge = omni.spatial_merge_size
        seconds = self.temporal_patch / config.video_fps
        if (seconds * omni.position_id_per_seconds) % 1:
            raise MediaError(f"video_fps {config.video_fps:g}: a temporal patch of {self.temporal_patch} frames would "
                             f"last {seconds:g} s, {seconds * omni.position_id_per_seconds:g} rotary positions; "
                             "choose a rate that makes it a whole number")

    # -- audio --------------------------------------------------------------------------------------

    def audio(self, raw: bytes, name: str) -> MediaItem:
        return self.audio_waveform(decode_wav(raw, name, SAMPLE_RATE, self.config.max_audio_seconds), name)

    def audio_waveform(self, wave: np.ndarray, name: str) -> MediaItem:
        """A 16 kHz mono float waveform -> its item."""
        if len(wave) > self.config.max_audio_seconds * SAMPLE_RATE:
            raise MediaError(f"{name}: {len(wave) / SAMPLE_RATE:.1f} s of audio; at most "
                             f"{self.config.max_audio_seconds:g} s per item (max_audio_seconds)")
        out = self.mel(np.asarray(wave, np.float32), sampling_rate=SAMPLE_RATE, padding="longest",
                       return_attention_mask=True, return_tensors="np")
        frames = int(out["attention_mask"][0].sum())
        tokens = audio_token_count(frames, self.n_window)
        if tokens < 1:
            raise MediaError(f"{name}: too short to make one audio token")
        features = torch.from_numpy(np.ascontiguousarray(out["input_features"][0, :, :frames]))
        return MediaItem("audio", features, tokens, name=name)

    # -- vision -------------------------------------------------------------------------------------

    def image(self, raw: bytes, name: str) -> MediaItem:
        return self.image_array(decode_image(raw, name), name)

    def image_array(self, rgb: np.ndarray, name: str) -> MediaItem:
        """uint8 RGB [H, W, 3] -> its item (the frame repeated over a temporal patch, as Qwen2-VL's processor)."""
        h, w = self._size(rgb.shape[0], rgb.shape[1], self.config.max_image_pixels, name)
        frame = self._normalize(rgb, h, w)
        return self._vision_item("image", np.repeat(frame[None], self.temporal_patch, axis=0), name, 1.0)

    def video(self, raw: bytes, name: str) -> MediaItem:
        cfg = self.config
        return self.video_frames(decode_video(raw, name, cfg.video_fps, cfg.max_video_frames), name)

    def video_frames(self, frames: list[np.ndarray], name: str) -> MediaItem:
        """uint8 RGB frames sampled at video_fps -> its item (all frames at the first frame's scaled size)."""
        if not frames:
            raise MediaError(f"{name}: the video has no frames")
        if len(frames) > self.config.max_video_frames:
            raise MediaError(f"{name}: {len(frames)} frames; at most {self.config.max_video_frames} per video "
                             "(max_video_frames)")
        h, w = self._size(frames[0].shape[0], frames[0].shape[1], self.config.max_video_pixels, name)
        stack = [self._normalize(f, h, w) for f in frames]
        stack += [stack[-1]] * (-len(stack) % self.temporal_patch)  # whole temporal patches
        return self._vision_item("video", np.stack(stack), name, self.temporal_patch / self.config.video_fps)

    def _size(self, height: int, width: int, max_pixels: int, name: str) -> tuple[int, int]:
        from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import smart_resize

        factor = self.patch * self.merge
        if min(height, width) < 1 or max(height, width) / min(height, width) > 200:
            raise MediaError(f"{name}: a {width}x{height} image (aspect ratio past 200 or empty)")
        return smart_resize(height, width, factor=factor, min_pixels=4 * factor * factor,
                            max_pixels=max(max_pixels, 4 * factor * factor))

    @staticmethod
    def _normalize(rgb: np.ndarray, height: int, width: int) -> np.ndarray:
        """-> float32 [3, height, width] (bicubic scaling, CLIP normalisation)."""
        from PIL import Image

        if rgb.shape[:2] != (height, width):
            rgb = np.asarray(Image.fromarray(rgb).resize((width, height), Image.Resampling.BICUBIC))
        x = (rgb.astype(np.float32) * np.float32(1 / 255) - CLIP_MEAN) / CLIP_STD
        return np.ascontiguousarray(x.transpose(2, 0, 1))

    def _vision_item(self, kind: str, frames: np.ndarray, name: str, seconds_per_grid: float) -> MediaItem:
        patches, grid = vision_patches(frames, self.patch, self.merge, self.temporal_patch)
        return MediaItem(kind, torch.from_numpy(patches), vision_token_count(grid, self.merge), grid,
                         seconds_per_grid, name)


def vision_patches(frames: np.ndarray, patch: int, merge: int, temporal_patch: int):
    """frames [T, C, H, W] (T a multiple of temporal_patch, H and W of patch * merge) -> (patches
    [grid_t * grid_h * grid_w, C * temporal_patch * patch * patch], (grid_t, grid_h, grid_w)): the vision encoder's
    input order, each merge window's patches together."""
    T, C, H, W = frames.shape
    gt, gh, gw = T // temporal_patch, H // patch, W // patch
    x = frames.reshape(gt, temporal_patch, C, gh // merge, merge, patch, gw // merge, merge, patch)
    x = x.transpose(0, 3, 6, 4, 7, 2, 1, 5, 8)
    return np.ascontiguousarray(x.reshape(gt * gh * gw, C * temporal_patch * patch * patch)), (gt, gh, gw)
