"""livemoe engine: everything needed to run a checkpoint (config, model, loading/saving, FLOPs, decoder)."""
from engine.async_llm import AsyncLLM
from engine.config import ModelConfig, load_config
from engine.engine_config import EngineConfig, EngineConfigError
from engine.errors import CheckpointError, RequestFailedError
from engine.live import LiveSession
from engine.llm import LLM
from engine.loader import init_model, load_model, load_tokenizer, save_model
from engine.model import Qwen3ForCausalLM
from engine.outputs import CompletionOutput, RequestMetrics, RequestOutput
from engine.sampling import RequestError, SamplingParams

__all__ = ["AsyncLLM", "ModelConfig", "load_config", "CheckpointError", "init_model", "load_model", "load_tokenizer",
           "save_model", "Qwen3ForCausalLM", "EngineConfig", "EngineConfigError", "LiveSession", "LLM", "CompletionOutput",
           "RequestMetrics", "RequestOutput", "RequestError", "RequestFailedError", "SamplingParams"]
