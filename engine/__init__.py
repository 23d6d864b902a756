"""livemoe engine: everything needed to run a checkpoint (config, model, loading/saving, FLOPs, decoder)."""
from engine.config import ModelConfig, load_config
from engine.errors import CheckpointError
from engine.loader import init_model, load_model, load_tokenizer, save_model
from engine.model import Qwen3ForCausalLM

__all__ = ["ModelConfig", "load_config", "CheckpointError", "init_model", "load_model", "load_tokenizer",
           "save_model", "Qwen3ForCausalLM"]
