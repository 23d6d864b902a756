"""`livemoe export-gguf SRC DST --dtype f32|f16`: a checkpoint as a GGUF file that llama.cpp (and so Ollama and
llama-cpp-python) loads, written with the `gguf` package (the `gguf` extra).

Architectures: qwen3 (dense) and qwen3moe, as llama.cpp's own converter names their tensors. Rotary q/k stay in the
hub's rotate-half order (llama.cpp runs these architectures with NEOX rope, so nothing is permuted). 2-D and 3-D
weights take the requested dtype; norms stay f32, as llama.cpp's converter keeps them. The tokenizer: a byte-level BPE
tokenizer.json becomes llama.cpp's `gpt2` tokenizer (its tokens, merges and special ids); a checkpoint without one (the
tests' random models) gets placeholder tokens `<id_N>` and a single-byte-token prefix, enough for llama.cpp to load it
and run it on token ids (text in and out needs a real tokenizer).
"""
import argparse
import json
import os
import sys

import numpy as np
import torch

from livemoe.engine.model.config import ModelConfig
from livemoe.engine.model.loader import load_model
from livemoe.engine.model.qwen3 import Qwen3ForCausalLM

DTYPES = {"f32": np.float32, "f16": np.float16}
_TOKEN_NORMAL, _TOKEN_CONTROL = 1, 3  # gguf.TokenType values (llama.cpp's llama_token_type)


def _gguf():
    try:
        import gguf
    except ImportError as e:  # the optional extra
        raise ImportError("export-gguf needs the `gguf` package: pip install 'livemoe[gguf]' (or pip install gguf)") from e
    return gguf


def gguf_tensors(model: Qwen3ForCausalLM) -> dict[str, torch.Tensor]:
    """llama.cpp's tensor name -> the model's tensor (numpy row-major order is ggml's reversed ne order: a Linear's
    [out, in] is ggml's {in, out}; experts [E, I, H] are {H, I, E})."""
    gguf = _gguf()
    T, names = gguf.MODEL_TENSOR, gguf.TENSOR_NAMES
    m, cfg = model.model, model.config
    out = {names[T.TOKEN_EMBD] + ".weight": m.embed_tokens.weight, names[T.OUTPUT_NORM] + ".weight": m.norm.weight}
    if model.lm_head is not None:
        out[names[T.OUTPUT] + ".weight"] = model.lm_head.weight
    for i, layer in enumerate(m.layers):
        attn, mlp = layer.self_attn, layer.mlp
        own = {T.ATTN_NORM: layer.input_layernorm.weight, T.ATTN_Q: attn.q_proj.weight, T.ATTN_K: attn.k_proj.weight,
               T.ATTN_V: attn.v_proj.weight, T.ATTN_OUT: attn.o_proj.weight, T.ATTN_Q_NORM: attn.q_norm.weight,
               T.ATTN_K_NORM: attn.k_norm.weight, T.FFN_NORM: layer.post_attention_layernorm.weight}
        if layer.mlp_is_moe:
            inter = cfg.moe_intermediate_size
            gate_up = mlp.experts.gate_up_proj
            own.update({T.FFN_GATE_INP: mlp.gate.weight, T.FFN_GATE_EXP: gate_up[:, :inter],
                        T.FFN_UP_EXP: gate_up[:, inter:], T.FFN_DOWN_EXP: mlp.experts.down_proj})
        else:
            own.update({T.FFN_GATE: mlp.gate_proj.weight, T.FFN_UP: mlp.up_proj.weight, T.FFN_DOWN: mlp.down_proj.weight})
        out.update({names[k].format(bid=i) + ".weight": v for k, v in own.items()})
    return out


def check_exportable(cfg: ModelConfig) -> None:
    """ValueError naming what llama.cpp's qwen3 / qwen3moe graph would compute differently."""
    if cfg.attention_bias:
        raise ValueError("export-gguf: attention_bias=true has no place in llama.cpp's qwen3 architectures")
    if cfg.num_experts:
        if not cfg.norm_topk_prob:
            raise ValueError("export-gguf: llama.cpp's qwen3moe renormalizes the top-k weights; this checkpoint has "
                             "norm_topk_prob=false")
        if any(not cfg.is_moe_layer(i) for i in range(cfg.num_hidden_layers)):
            raise ValueError("export-gguf: llama.cpp's qwen3moe has an MoE block in every layer; this checkpoint has "
                             "dense layers (mlp_only_layers / decoder_sparse_step)")


def _write_config(w, cfg: ModelConfig, file_type: int) -> None:
    w.add_context_length(cfg.max_position_embeddings)
    w.add_embedding_length(cfg.hidden_size)
    w.add_block_count(cfg.num_hidden_layers)
    w.add_head_count(cfg.num_attention_heads)
    w.add_head_count_kv(cfg.num_key_value_heads)
    w.add_key_length(cfg.head_dim)
    w.add_value_length(cfg.head_dim)
    w.add_rope_freq_base(cfg.rope_theta)
    w.add_layer_norm_rms_eps(cfg.rms_norm_eps)
    w.add_vocab_size(cfg.vocab_size)
    w.add_file_type(file_type)
    if cfg.num_experts:
        w.add_feed_forward_length(cfg.intermediate_size or cfg.moe_intermediate_size)
        w.add_expert_count(cfg.num_experts)
        w.add_expert_used_count(cfg.num_experts_per_tok)
        w.add_expert_feed_forward_length(cfg.moe_intermediate_size)
    else:
        w.add_feed_forward_length(cfg.intermediate_size)


def _byte_level_chars() -> list[str]:
    """GPT-2's byte -> printable character table (what byte-level BPE vocabularies are written in)."""
    keep = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(range(ord("®"), ord("ÿ") + 1))
    chars, extra = {}, 0
    for b in range(256):
        if b in keep:
            chars[b] = chr(b)
        else:
            chars[b] = chr(256 + extra)
            extra += 1
    return [chars[b] for b in range(256)]


def tokenizer_tables(src: str, cfg: ModelConfig) -> dict:
    """tokens, token_types, merges and special ids for llama.cpp's gpt2 tokenizer, vocab_size long."""
    V = cfg.vocab_size
    tokens: list[str | None] = [None] * V
    types = [_TOKEN_NORMAL] * V
    path = os.path.join(src, "tokenizer.json")
    merges: list[str] = []
    if os.path.exists(path):
        with open(path) as f:
            tok = json.load(f)
        model = tok.get("model", {})
        if model.get("type") != "BPE":
            raise ValueError(f"export-gguf: {path} has a {model.get('type')!r} tokenizer; only byte-level BPE maps onto "
                             "llama.cpp's gpt2 tokenizer")
        for text, i in model["vocab"].items():
            if i < V:
                tokens[i] = text
        for added in tok.get("added_tokens", []):
            if added["id"] < V:
                tokens[added["id"]] = added["content"]
                types[added["id"]] = _TOKEN_CONTROL if added.get("special") else _TOKEN_NORMAL
        merges = [m if isinstance(m, str) else " ".join(m) for m in model.get("merges", [])]
    else:  # placeholder: the single bytes first (llama.cpp looks its newline token up), then ids
        for i, ch in enumerate(_byte_level_chars()[:V]):
            tokens[i] = ch
    taken = set(t for t in tokens if t is not None)
    for i in range(V):
        if tokens[i] is None:
            name = f"<id_{i}>"
            assert name not in taken, name
            tokens[i] = name
            types[i] = _TOKEN_CONTROL
    if not merges:  # llama.cpp's gpt2 tokenizer wants the key; a merge of two single bytes is harmless
        merges = [f"{tokens[0]} {tokens[0]}"]
    return {"tokens": tokens, "types": types, "merges": merges}


def export_gguf(src: str, dst: str, dtype: str = "f32") -> str:
    """Writes the checkpoint at `src` as GGUF at `dst` (weights in `dtype`: f32 or f16); returns dst."""
    gguf = _gguf()
    if dtype not in DTYPES:
        raise ValueError(f"export-gguf: --dtype must be one of {', '.join(DTYPES)}, got {dtype!r}")
    model = load_model(src, dtype=torch.float32, device="cpu")
    cfg = model.config
    check_exportable(cfg)
    arch = gguf.MODEL_ARCH.QWEN3MOE if cfg.num_experts else gguf.MODEL_ARCH.QWEN3
    w = gguf.GGUFWriter(dst, gguf.MODEL_ARCH_NAMES[arch])
    w.add_name(os.path.basename(os.path.normpath(src)))
    file_type = gguf.LlamaFileType.ALL_F32 if dtype == "f32" else gguf.LlamaFileType.MOSTLY_F16
    _write_config(w, cfg, int(file_type))
    tables = tokenizer_tables(src, cfg)
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("default")
    w.add_token_list(tables["tokens"])
    w.add_token_types(tables["types"])
    w.add_token_merges(tables["merges"])
    for setter, value in ((w.add_bos_token_id, cfg.bos_token_id), (w.add_pad_token_id, cfg.pad_token_id)):
        if value is not None:
            setter(value)
    if cfg.eos_token_ids:
        w.add_eos_token_id(cfg.eos_token_ids[0])
    template = os.path.join(src, "chat_template.jinja")
    if os.path.exists(template):
        with open(template) as f:
            w.add_chat_template(f.read())
    for name, t in gguf_tensors(model).items():
        arr = t.detach().float().contiguous().numpy()
        w.add_tensor(name, arr.astype(np.float32 if arr.ndim == 1 else DTYPES[dtype]))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return dst


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="livemoe export-gguf", description=__doc__.split("\n\n")[0])
    p.add_argument("src", help="checkpoint directory (config.json + safetensors)")
    p.add_argument("dst", help="the .gguf file to write")
    p.add_argument("--dtype", choices=list(DTYPES), default="f32", help="weight dtype (norms stay f32)")
    args = p.parse_args(argv)
    try:
        export_gguf(args.src, args.dst, args.dtype)
    except (ValueError, ImportError) as e:
        print(f"livemoe export-gguf: {e}", file=sys.stderr)
        return 2
    print(args.dst)
    return 0
