"""Tiny random Qwen3 / Qwen3-MoE checkpoints made by transformers itself (nothing is downloaded).

Used by the tests of every layer: `make_checkpoint(tmp_path / "m", moe=True)` returns the directory.
Router weights are spread (std 1) so the top-k is decided by the weights, not by rounding.
"""
import json
import os

import torch
from safetensors.torch import save_file

BASE = dict(vocab_size=131, hidden_size=64, intermediate_size=96, num_hidden_layers=3, num_attention_heads=4,
            num_key_value_heads=2, head_dim=16, max_position_embeddings=512, rms_norm_eps=1e-6,
            rope_theta=10000.0, tie_word_embeddings=False, bos_token_id=1, eos_token_id=2, pad_token_id=0)
MOE = dict(num_experts=8, num_experts_per_tok=2, moe_intermediate_size=32, norm_topk_prob=True,
           decoder_sparse_step=1, mlp_only_layers=[], router_aux_loss_coef=0.001)


def hf_config(moe: bool = True, **overrides):
    from transformers import Qwen3Config, Qwen3MoeConfig

    kw = {**BASE, **(MOE if moe else {}), **overrides}
    return (Qwen3MoeConfig if moe else Qwen3Config)(**kw)


def hf_model(moe: bool = True, seed: int = 0, **overrides):
    """A random transformers model, with spread router and norm weights (fp32, eval mode)."""
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(hf_config(moe, **overrides), attn_implementation="eager")
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("mlp.gate.weight"):
                p.normal_(0.0, 1.0)
            elif "norm" in name:
                p.uniform_(0.5, 1.5)
            else:
                p.normal_(0.0, 0.08)
    return model.eval()


def make_checkpoint(path, moe: bool = True, seed: int = 0, layout: str = "per_expert",
                    max_shard_size=None, **overrides):
    """Saves a random model at `path` and returns (path, the transformers model).

    layout "per_expert" is what transformers writes (the hub's layout); "fused" rewrites the weights
    with transformers-v5 fused expert keys (mlp.experts.gate_up_proj / down_proj).
    """
    model = hf_model(moe, seed, **overrides)
    kw = {"max_shard_size": max_shard_size} if max_shard_size else {}
    model.save_pretrained(path, **kw)
    if layout == "fused":
        for f in os.listdir(path):
            if f.endswith(".safetensors") or f.endswith(".index.json"):
                os.remove(os.path.join(path, f))
        state = {k: v.contiguous() for k, v in model.state_dict().items()}
        if model.config.tie_word_embeddings:
            state.pop("lm_head.weight", None)
        save_file(state, os.path.join(path, "model.safetensors"), metadata={"format": "pt"})
    else:
        assert layout == "per_expert", layout
    return str(path), model


def write_config(path, config: dict):
    os.makedirs(path, exist_ok=True)
    with open(os.path.join(path, "config.json"), "w") as f:
        json.dump(config, f)
    return str(path)
