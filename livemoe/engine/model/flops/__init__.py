"""FLOPs accounting: parameters (total, active), decode FLOPs per token, prefill FLOPs.

Decode cost follows the LiveThinking seed: 2 x active matmul parameters per generated token (its
"D. TFLOPs" = that x tokens per response). The attention term (QK^T and AV over a context of N tokens,
4 x layers x q_heads x head_dim x N per token) is reported separately. The embedding lookup is not a
matmul and is left out; the lm_head is counted (tied or not: its matmul runs either way).

CLI: livemoe flops PATH_OR_CONFIG_JSON_OR_PRESET [--context N] [--prompt N] [--tokens N]
(livemoe/engine/model/flops/__main__.py). Presets (published configs, shipped in livemoe/engine/model/presets/): qwen3-30b-a3b,
qwen3-235b-a22b, qwen3-32b.
"""
import os

from livemoe.engine.errors import CheckpointError
from livemoe.engine.model.config import ModelConfig, load_config

PRESET_DIR = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "presets")


def preset_names() -> list[str]:
    return sorted(f.removesuffix(".json") for f in os.listdir(PRESET_DIR) if f.endswith(".json"))


def resolve_config(path_or_preset) -> ModelConfig:
    if isinstance(path_or_preset, ModelConfig):
        return path_or_preset
    if path_or_preset in preset_names():
        return load_config(os.path.join(PRESET_DIR, f"{path_or_preset}.json"))
    if not os.path.exists(path_or_preset):
        raise CheckpointError(f"{path_or_preset}: no such file or directory, and not a preset (presets: "
                              f"{', '.join(preset_names())})")
    return load_config(path_or_preset)


def param_counts(cfg: ModelConfig) -> dict:
    """Parameter counts by kind; `active` is what one token touches (top-k experts of each MoE layer)."""
    H, D, L = cfg.hidden_size, cfg.head_dim, cfg.num_hidden_layers
    q, kv = cfg.num_attention_heads * D, cfg.num_key_value_heads * D
    attn = H * q + 2 * H * kv + q * H + (q + 2 * kv + H if cfg.attention_bias else 0)
    counts = dict(embedding=cfg.vocab_size * H, lm_head=0 if cfg.tie_word_embeddings else cfg.vocab_size * H,
                  attention=0, dense_mlp=0, router=0, experts=0, active_experts=0, norms=H)
    for i in range(L):
        counts["attention"] += attn
        counts["norms"] += 2 * H + 2 * D
        if cfg.is_moe_layer(i):
            per_expert = 3 * H * cfg.moe_intermediate_size
            counts["router"] += H * cfg.num_experts
            counts["experts"] += cfg.num_experts * per_expert
            counts["active_experts"] += cfg.num_experts_per_tok * per_expert
        else:
            counts["dense_mlp"] += 3 * H * cfg.intermediate_size
    shared = counts["embedding"] + counts["lm_head"] + counts["attention"] + counts["dense_mlp"] + counts["router"] + counts["norms"]
    counts["total"] = shared + counts["experts"]
    counts["active"] = shared + counts["active_experts"]
    # matmuls one token runs: every projection it touches, and the output head (tied or not)
    counts["active_matmul"] = (counts["attention"] + counts["dense_mlp"] + counts["router"] + counts["active_experts"]
                               + cfg.vocab_size * H)
    return counts


def attention_flops_per_token(cfg: ModelConfig, context_len: int) -> int:
    """QK^T and AV for one query token over context_len keys, all layers."""
    return 4 * cfg.num_hidden_layers * cfg.num_attention_heads * cfg.head_dim * context_len


def decode_flops_per_token(cfg: ModelConfig, context_len: int = 0) -> dict:
    matmul = 2 * param_counts(cfg)["active_matmul"]
    attention = attention_flops_per_token(cfg, context_len)
    return {"matmul": matmul, "attention": attention, "total": matmul + attention}


def decode_flops(cfg: ModelConfig, num_tokens: int, prompt_len: int | None = None) -> int:
    """FLOPs to generate num_tokens: the seed's 2 x active x tokens, plus attention when prompt_len is
    given (token i attends over prompt_len + i keys)."""
    flops = 2 * param_counts(cfg)["active_matmul"] * num_tokens
    if prompt_len is not None:
        keys = num_tokens * prompt_len + num_tokens * (num_tokens + 1) // 2
        flops += attention_flops_per_token(cfg, 1) * keys
    return flops


def prefill_flops(cfg: ModelConfig, prompt_len: int) -> dict:
    matmul = 2 * param_counts(cfg)["active_matmul"] * prompt_len
    attention = attention_flops_per_token(cfg, 1) * prompt_len * (prompt_len + 1) // 2  # causal
    return {"matmul": matmul, "attention": attention, "total": matmul + attention}


def report(cfg: ModelConfig, context_len: int = 0, prompt_len: int = 0, tokens: int | None = None) -> dict:
    counts = param_counts(cfg)
    out = {
        "model_type": cfg.model_type,
        "params_total": counts["total"],
        "params_active": counts["active"],
        "params_active_matmul": counts["active_matmul"],
        "params_by_kind": {k: v for k, v in counts.items() if k not in ("total", "active", "active_matmul")},
        "decode_flops_per_token": decode_flops_per_token(cfg, context_len),
        "context_len": context_len,
    }
    if prompt_len:
        out["prompt_len"] = prompt_len
        out["prefill_flops"] = prefill_flops(cfg, prompt_len)
    if tokens:
        out["tokens"] = tokens
        out["decode_tflops_per_response"] = decode_flops(cfg, tokens) / 1e12
    return out
