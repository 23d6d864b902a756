"""Tiny random Qwen3-Omni-MoE thinkers made by transformers itself, and prompts that hold media (nothing downloaded).

`make_omni_checkpoint(path)` saves one (transformers' thinker layout: audio_tower.*, visual.*, model.*, lm_head.*);
layout="hub" rewrites it as the whole Qwen3-Omni checkpoint (thinker.* beside talker.* tensors, config nested under
thinker_config). Token ids 190-196 are the placeholders and markers; text tokens are drawn below 180.
"""
import json
import os

import torch
from safetensors.torch import load_file, save_file

AUDIO, IMAGE, VIDEO, AUDIO_START, AUDIO_END, VISION_START, VISION_END = range(190, 197)
MEL_BINS, PATCH, TEMPORAL_PATCH, MERGE = 16, 4, 2, 2
PATCH_DIM = 3 * TEMPORAL_PATCH * PATCH * PATCH


MEDIA_SPECIALS = ["<|audio_pad|>", "<|image_pad|>", "<|video_pad|>", "<|audio_start|>", "<|audio_end|>",
                  "<|vision_start|>", "<|vision_end|>"]  # in the order of the ids above


def thinker_config(first_media_id: int = AUDIO, **text_overrides):
    from transformers import Qwen3OmniMoeThinkerConfig

    audio, image, video, audio_start, _, vision_start, _ = range(first_media_id, first_media_id + 7)
    text = dict(vocab_size=200, hidden_size=32, intermediate_size=64, num_hidden_layers=3, num_attention_heads=4,
                num_key_value_heads=2, head_dim=16, moe_intermediate_size=16, num_experts=4, num_experts_per_tok=2,
                rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "mrope_section": [2, 3, 3],
                                 "mrope_interleaved": True}, eos_token_id=2)
    text.update(text_overrides)
    hidden = text["hidden_size"]
    return Qwen3OmniMoeThinkerConfig(
        # n_window 50 (100-frame chunks) is the real one: transformers' token count formula assumes it
        audio_config=dict(num_mel_bins=MEL_BINS, encoder_layers=2, encoder_attention_heads=2, encoder_ffn_dim=32,
                          d_model=16, max_source_positions=100, n_window=50, output_dim=hidden, n_window_infer=200,
                          conv_chunksize=10, downsample_hidden_size=8),
        vision_config=dict(depth=3, hidden_size=16, intermediate_size=32, num_heads=2, patch_size=PATCH,
                           spatial_merge_size=MERGE, temporal_patch_size=TEMPORAL_PATCH, out_hidden_size=hidden,
                           num_position_embeddings=16, deepstack_visual_indexes=[0, 2]),
        text_config=text, audio_token_id=audio, image_token_id=image, video_token_id=video,
        audio_start_token_id=audio_start, vision_start_token_id=vision_start, position_id_per_seconds=25)


def hf_thinker(seed: int = 0, first_media_id: int = AUDIO, **text_overrides):
    """A random transformers thinker (fp32, eval), router weights spread so the top-k is decided by them."""
    from transformers import Qwen3OmniMoeThinkerForConditionalGeneration

    torch.manual_seed(seed)
    config = thinker_config(first_media_id, **text_overrides)
    model = Qwen3OmniMoeThinkerForConditionalGeneration._from_config(config, attn_implementation="eager")
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("mlp.gate.weight"):
                p.normal_(0.0, 1.0)
            elif "norm" in name and name.endswith("weight"):
                p.uniform_(0.5, 1.5)
            else:
                p.normal_(0.0, 0.08)
    return model.eval()


def make_omni_checkpoint(path, seed: int = 0, layout: str = "thinker", tokenizer=None, **text_overrides):
    """-> (path, the transformers thinker). tokenizer: saved beside it, its vocabulary the model's, the media
    special tokens added at its end."""
    first = AUDIO
    if tokenizer is not None:
        tokenizer.add_special_tokens({"additional_special_tokens": MEDIA_SPECIALS})
        first = tokenizer.convert_tokens_to_ids(MEDIA_SPECIALS[0])
        assert [tokenizer.convert_tokens_to_ids(t) for t in MEDIA_SPECIALS] == list(range(first, first + 7))
        text_overrides.setdefault("vocab_size", len(tokenizer))
        text_overrides.setdefault("eos_token_id", tokenizer.eos_token_id)
    model = hf_thinker(seed, first, **text_overrides)
    model.save_pretrained(path)
    if tokenizer is not None:
        tokenizer.save_pretrained(path)
    if layout == "hub":
        file = os.path.join(path, "model.safetensors")
        state = {f"thinker.{k}": v for k, v in load_file(file).items()}
        state["talker.model.norm.weight"] = torch.ones(4)  # the speech output's tensors: not loaded
        state["code2wav.pre_transformer.norm.weight"] = torch.ones(4)
        save_file(state, file, metadata={"format": "pt"})
        with open(os.path.join(path, "config.json")) as f:
            thinker = json.load(f)
        whole = {"model_type": "qwen3_omni_moe", "architectures": ["Qwen3OmniMoeForConditionalGeneration"],
                 "thinker_config": thinker, "talker_config": {}, "code2wav_config": {}, "enable_audio_output": False}
        with open(os.path.join(path, "config.json"), "w") as f:
            json.dump(whole, f)
    else:
        assert layout == "thinker", layout
    return str(path), model
