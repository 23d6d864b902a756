"""The live trainers on a Qwen3-Omni-MoE thinker (sessions with `audio` and `video` events): which parameters train,
and the trainers' forward over sequences that hold media.

Parameters: the audio and vision encoders are frozen (random or pretrained, they are the thinker's eyes and ears, and
a few hundred live sessions would only wear them down); with train_projector their projectors train with the language
model: the audio tower's output projection (ln_post, proj1, proj2) and the vision encoder's patch merger and deepstack
mergers (merger, merger_list), the parts that map what the encoders see into the language model's space.

Forward: each media item is encoded once per forward however many rows hold it (a session's K trajectories share
their media), under no_grad when nothing of its encoder trains; its rows replace its placeholder tokens' embeddings
and the vision deepstack features join the first layers, at the multimodal rotary positions the engine gives the same
tokens (livemoe.engine.model.omni), so the trainer scores exactly what a LiveSession decoded from.
"""
import contextlib

import torch

from livemoe.engine.model.omni.positions import mrope_positions
from livemoe.engine.model.omni.thinker import MediaPiece

ENCODERS = ("audio_tower.", "visual.")
PROJECTORS = ("audio_tower.ln_post.", "audio_tower.proj1.", "audio_tower.proj2.", "visual.merger.",
              "visual.merger_list.")


def takes_media(model) -> bool:
    """A Qwen3-Omni-MoE thinker (it has encoders); a text model does not take audio or video."""
    return getattr(model.config, "omni", None) is not None


def media_processor(model):
    """The MediaProcessor a default engine over the model uses (the evaluation's LiveSessions: trainer.engine_for),
    so the trainers encode media exactly as they are served; None for a text model."""
    if not takes_media(model):
        return None
    from livemoe.engine.decoder.config import EngineConfig
    from livemoe.engine.multimodal.processor import MediaProcessor

    return MediaProcessor(model.config.omni, EngineConfig())


def trainable_parameters(model, train_projector: bool = False) -> list:
    """Freezes the encoders (their projectors too unless train_projector) and returns the parameters that train.
    A text model has no projector: train_projector on one is a ValueError."""
    if train_projector and not takes_media(model):
        raise ValueError("train_projector: the model is a text model (no audio or vision encoder, so no projector); "
                         "it needs a Qwen3-Omni-MoE thinker")
    for name, p in model.named_parameters():
        if name.startswith(ENCODERS):
            p.requires_grad_(train_projector and name.startswith(PROJECTORS))
    return [p for p in model.parameters() if p.requires_grad]


def encoder_trains(model, kind: str) -> bool:
    tower = model.audio_tower if kind == "audio" else model.visual
    return any(p.requires_grad for p in tower.parameters())


def forward_hidden(model, input_ids: torch.Tensor, attention_mask: torch.Tensor, media: list | None = None,
                   return_router_logits: bool = True):
    """model.forward_hidden over right-padded rows [B, T]; media: per row its PlacedMedia (offsets in that row), or
    None / all empty for text (then exactly the text forward)."""
    if not media or not any(media):
        return model.forward_hidden(input_ids, attention_mask=attention_mask, return_router_logits=return_router_logits)
    B, T = input_ids.shape
    device = input_ids.device
    # float: a video's time steps may fall between integers (transformers' positions, to the bit)
    positions = torch.arange(T, device=device, dtype=torch.float32).expand(3, B, T).clone()
    encoded, pieces = {}, []
    for b, row in enumerate(media):
        row = sorted(row, key=lambda m: m.offset)
        if row:
            positions[:, b] = mrope_positions(T, [m.span() for m in row], model.config.omni)[0].float().to(device)
        for m in row:
            it = m.item
            if it.content_hash not in encoded:
                grad = encoder_trains(model, it.kind)
                with contextlib.nullcontext() if grad else torch.no_grad():
                    data = it.data.to(device)
                    encoded[it.content_hash] = (model.encode_audio(data) if it.kind == "audio"
                                                else model.encode_vision(data, it.grid_thw))
            pieces.append(MediaPiece(b * T + m.offset, encoded[it.content_hash], 0, it.num_tokens))
    embeds, deepstack = model.media_inputs(input_ids, pieces)
    return model.forward_hidden(input_ids, positions, attention_mask, return_router_logits=return_router_logits,
                                inputs_embeds=embeds, deepstack=deepstack)
