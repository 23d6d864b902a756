"""ModelConfig: the fields of a Hugging Face Qwen3 / Qwen3-MoE config.json that the engine uses.

Parsed and validated in one place (`ModelConfig.from_dict`); defaults are transformers' own, so a
checkpoint means the same thing here as there. The raw dict is kept so saving writes it back as it came.
"""
import json
import os
from dataclasses import dataclass, field, fields

from livemoe.engine.errors import CheckpointError
from livemoe.engine.model.omni.config import OMNI_MODEL_TYPES, OmniConfig, parse_omni, thinker_dict

SUPPORTED_MODEL_TYPES = ("qwen3", "qwen3_moe") + OMNI_MODEL_TYPES
_REQUIRED = ("vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads", "num_key_value_heads")
_REQUIRED_MOE = ("num_experts_per_tok", "moe_intermediate_size")


@dataclass(kw_only=True)
class ModelConfig:
    model_type: str
    vocab_size: int
    hidden_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    intermediate_size: int = 0  # dense MLP layers; 0 when every layer is MoE and the field is absent
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    max_position_embeddings: int = 32768
    tie_word_embeddings: bool = False
    attention_bias: bool = False
    # MoE (num_experts == 0 for dense models)
    num_experts: int = 0
    num_experts_per_tok: int = 0
    moe_intermediate_size: int = 0
    norm_topk_prob: bool = False
    decoder_sparse_step: int = 1
    mlp_only_layers: list[int] = field(default_factory=list)
    router_aux_loss_coef: float = 0.001
    bos_token_id: int | None = None
    eos_token_id: int | list[int] | None = None
    pad_token_id: int | None = None
    dtype: str | None = None
    # the Qwen3-Omni-MoE thinker's encoders, placeholders and multimodal rotary layout (None: a text model)
    omni: OmniConfig | None = None
    raw: dict = field(default_factory=dict, repr=False)

    def is_moe_layer(self, layer_idx: int) -> bool:
        """transformers' rule: MoE unless listed in mlp_only_layers or off the decoder_sparse_step grid."""
        return (self.num_experts > 0 and layer_idx not in self.mlp_only_layers
                and (layer_idx + 1) % self.decoder_sparse_step == 0)

    @property
    def eos_token_ids(self) -> list[int]:
        if self.eos_token_id is None:
            return []
        return list(self.eos_token_id) if isinstance(self.eos_token_id, (list, tuple)) else [self.eos_token_id]

    @classmethod
    def from_dict(cls, raw: dict, source: str = "config.json") -> "ModelConfig":
        def fail(msg):
            raise CheckpointError(f"{source}: {msg}")

        model_type = raw.get("model_type")
        if model_type not in SUPPORTED_MODEL_TYPES:
            fail(f"unknown model_type {model_type!r}; supported: {', '.join(SUPPORTED_MODEL_TYPES)}")
        if model_type in OMNI_MODEL_TYPES:  # the thinker's text model is a Qwen3-MoE one
            text, omni = parse_omni(raw, fail)
            cfg = cls._parse(text, "qwen3_moe", fail)
            cfg.model_type, cfg.omni, cfg.raw = model_type, omni, dict(raw)
            if cfg.dtype is None:
                cfg.dtype = raw.get("dtype", raw.get("torch_dtype"))
            cfg.validate(fail)
            return cfg
        cfg = cls._parse(raw, model_type, fail)
        cfg.validate(fail)
        return cfg

    @classmethod
    def _parse(cls, raw: dict, model_type: str, fail) -> "ModelConfig":
        moe = model_type == "qwen3_moe"
        num_experts = raw.get("num_experts", raw.get("num_local_experts"))  # v5 writes num_local_experts
        for key in _REQUIRED + (_REQUIRED_MOE if moe else ("intermediate_size",)):
            if raw.get(key) is None:
                fail(f"missing required field {key!r} for model_type {model_type!r}")
        if moe and num_experts is None:
            fail("missing required field 'num_experts' (or 'num_local_experts') for model_type 'qwen3_moe'")
        if raw.get("hidden_act", "silu") != "silu":
            fail(f"hidden_act {raw['hidden_act']!r} is not supported (Qwen3 uses 'silu')")
        if raw.get("use_sliding_window"):
            fail("use_sliding_window=true is not supported")
        rope = raw.get("rope_parameters") or raw.get("rope_scaling") or {}
        rope_type = rope.get("rope_type", rope.get("type", "default"))  # mrope_section: OmniConfig's
        if rope_type != "default":
            fail(f"rope type {rope_type!r} is not supported (only 'default')")
        rope_theta = rope.get("rope_theta", raw.get("rope_theta", 10000.0))
        hidden, heads = raw["hidden_size"], raw["num_attention_heads"]
        head_dim = raw.get("head_dim") or (128 if model_type == "qwen3" else hidden // heads)
        return cls(
            model_type=model_type, vocab_size=raw["vocab_size"], hidden_size=hidden,
            num_hidden_layers=raw["num_hidden_layers"], num_attention_heads=heads,
            num_key_value_heads=raw["num_key_value_heads"], head_dim=head_dim,
            intermediate_size=raw.get("intermediate_size") or 0, rms_norm_eps=raw.get("rms_norm_eps", 1e-6),
            rope_theta=float(rope_theta), max_position_embeddings=raw.get("max_position_embeddings", 32768),
            tie_word_embeddings=bool(raw.get("tie_word_embeddings", False)),
            attention_bias=bool(raw.get("attention_bias", False)),
            num_experts=int(num_experts or 0) if moe else 0,
            num_experts_per_tok=raw.get("num_experts_per_tok", 0) if moe else 0,
            moe_intermediate_size=raw.get("moe_intermediate_size", 0) if moe else 0,
            norm_topk_prob=bool(raw.get("norm_topk_prob", False)),
            decoder_sparse_step=raw.get("decoder_sparse_step", 1) or 1,
            mlp_only_layers=list(raw.get("mlp_only_layers") or []),
            router_aux_loss_coef=raw.get("router_aux_loss_coef", 0.001),
            bos_token_id=raw.get("bos_token_id"), eos_token_id=raw.get("eos_token_id"),
            pad_token_id=raw.get("pad_token_id"), dtype=raw.get("dtype", raw.get("torch_dtype")), raw=dict(raw),
        )

    def validate(self, fail) -> None:
        for name in ("vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads",
                     "num_key_value_heads", "head_dim"):
            value = getattr(self, name)
            if not isinstance(value, int) or value <= 0:
                fail(f"field {name!r} must be a positive integer, got {value!r}")
        if self.num_attention_heads % self.num_key_value_heads:
            fail(f"num_attention_heads ({self.num_attention_heads}) must be a multiple of "
                 f"num_key_value_heads ({self.num_key_value_heads})")
        if self.num_experts:
            if not 1 <= self.num_experts_per_tok <= self.num_experts:
                fail(f"num_experts_per_tok must be in [1, num_experts={self.num_experts}], "
                     f"got {self.num_experts_per_tok}")
            if self.moe_intermediate_size <= 0:
                fail(f"moe_intermediate_size must be > 0, got {self.moe_intermediate_size}")
        dense_layers = [i for i in range(self.num_hidden_layers) if not self.is_moe_layer(i)]
        if dense_layers and self.intermediate_size <= 0:
            fail(f"layers {dense_layers} are dense MLPs but 'intermediate_size' is missing or 0")

    def to_dict(self) -> dict:
        """The raw dict as it came, with the typed fields written over the keys of the same name: a field changed
        after loading (a benchmark cutting num_hidden_layers) is saved as changed, not as loaded."""
        out = dict(self.raw)
        text = out
        if self.omni is not None:  # the thinker alone (what the engine holds and saves), its LM in text_config
            out = dict(thinker_dict(out), model_type="qwen3_omni_moe_thinker")
            out.setdefault("architectures", ["Qwen3OmniMoeThinkerForConditionalGeneration"])
            text = out["text_config"] = dict(out["text_config"])
        for f in fields(self):
            key = "num_local_experts" if f.name == "num_experts" and "num_local_experts" in text else f.name
            if key in text and key not in ("raw", "dtype", "model_type", "omni"):
                text[key] = getattr(self, f.name)
        return out


def load_config(path: str) -> ModelConfig:
    """path: a checkpoint directory or a config.json file."""
    file = os.path.join(path, "config.json") if os.path.isdir(path) else path
    if os.path.exists(file) and not os.path.isfile(file):  # a device or a pipe would be read without end
        raise CheckpointError(f"{file}: not a regular file (expected a checkpoint directory with config.json)")
    try:
        with open(file) as f:
            raw = json.load(f)
    except FileNotFoundError:
        raise CheckpointError(f"{file}: no such file (expected a checkpoint directory with config.json)") from None
    except json.JSONDecodeError as e:
        raise CheckpointError(f"{file}: not valid JSON ({e})") from None
    if not isinstance(raw, dict):
        raise CheckpointError(f"{file}: expected a JSON object")
    return ModelConfig.from_dict(raw, source=file)
