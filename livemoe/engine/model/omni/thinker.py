"""OmniThinkerForCausalLM: the Qwen3-Omni-MoE thinker. Its language model is livemoe's Qwen3-MoE module (same keys
model.* and lm_head.*, same kernels, same decode path); audio_tower.* and visual.* are the encoders
(livemoe.engine.model.omni.encoders). Media enter as rows spliced over their placeholder tokens' embeddings, with
the vision encoder's deepstack features added after the first layers, and positions from
livemoe.engine.model.omni.positions."""
from dataclasses import dataclass

import torch

from livemoe.engine.model.config import ModelConfig
from livemoe.engine.model.omni.encoders import build_encoders, init_encoder_buffers
from livemoe.engine.model.qwen3 import Qwen3ForCausalLM


@dataclass(slots=True)
class EncodedMedia:
    """One media item through its encoder: embeds [n, H] for its n placeholder tokens, and (vision) one [n, H]
    deepstack feature per deepstack layer."""
    embeds: torch.Tensor
    deepstack: tuple[torch.Tensor, ...] = ()


@dataclass(slots=True)
class MediaPiece:
    """Rows [lo, hi) of an encoded item, landing at flattened token rows flat_start .. flat_start + hi - lo of a
    forward (a chunked prefill may take an item in parts)."""
    flat_start: int
    media: EncodedMedia
    lo: int
    hi: int


class OmniThinkerForCausalLM(Qwen3ForCausalLM):
    def __init__(self, cfg: ModelConfig, tp=None):
        if cfg.omni is None:
            raise ValueError(f"model_type {cfg.model_type!r} is not a Qwen3-Omni-MoE thinker")
        if tp is not None:
            raise ValueError("the Qwen3-Omni-MoE thinker runs on one device (no tensor parallel)")
        super().__init__(cfg)
        self.audio_tower, self.visual = build_encoders(cfg.omni)

    def init_nonpersistent_buffers(self, device) -> None:
        super().init_nonpersistent_buffers(device)
        init_encoder_buffers(self.audio_tower, self.visual, device)

    @property
    def num_deepstack(self) -> int:
        return len(self.config.omni.vision_config.get("deepstack_visual_indexes", ()))

    def encode_audio(self, features: torch.Tensor) -> EncodedMedia:
        """features [num_mel_bins, frames] (log-mel, as WhisperFeatureExtractor makes) -> its embeddings."""
        lens = torch.tensor([features.shape[1]], device=features.device)
        out = self.audio_tower(features.to(self.lm_head_weight.dtype), feature_lens=lens, return_dict=True)
        return EncodedMedia(out.last_hidden_state)

    def encode_vision(self, pixel_values: torch.Tensor, grid_thw: tuple[int, int, int]) -> EncodedMedia:
        """pixel_values [t*h*w, C*temporal_patch*patch*patch] (one image or video, patches in the processor's
        order), grid_thw its patch grid -> embeddings and deepstack features."""
        grid = torch.tensor([list(grid_thw)], device=pixel_values.device)
        out = self.visual(pixel_values.to(self.lm_head_weight.dtype), grid_thw=grid, return_dict=True)
        return EncodedMedia(out.pooler_output, tuple(out.deepstack_features))

    def media_inputs(self, input_ids: torch.Tensor, pieces: list[MediaPiece]):
        """-> (inputs_embeds [B, T, H], deepstack or None) for forward_hidden: the token embeddings with the pieces'
        rows written over their placeholders."""
        x = self.model.embed_tokens(input_ids)
        if not pieces:
            return x, None
        flat = x.reshape(-1, x.shape[-1]).clone()
        vision_index, vision_rows = [], [[] for _ in range(self.num_deepstack)]
        for p in pieces:
            rows = slice(p.flat_start, p.flat_start + p.hi - p.lo)
            flat[rows] = p.media.embeds[p.lo:p.hi].to(flat.dtype)
            if p.media.deepstack:
                vision_index.append(torch.arange(rows.start, rows.stop, device=flat.device))
                for level, feature in enumerate(p.media.deepstack):
                    vision_rows[level].append(feature[p.lo:p.hi])
        deepstack = None
        if vision_index:
            deepstack = (torch.cat(vision_index), [torch.cat(rows) for rows in vision_rows])
        return flat.view_as(x), deepstack

    def forward(self, input_ids, positions=None, attention_mask=None, pieces: list[MediaPiece] | None = None):
        embeds, deepstack = self.media_inputs(input_ids, pieces or [])
        hidden = self.forward_hidden(input_ids, positions, attention_mask, inputs_embeds=embeds, deepstack=deepstack)
        return self.compute_logits(hidden)
