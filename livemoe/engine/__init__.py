"""livemoe engine: everything needed to run a checkpoint (config, model, loading/saving, FLOPs, decoder)."""
from livemoe.engine.async_llm import AsyncLLM
from livemoe.engine.decoder.config import EngineConfig
from livemoe.engine.errors import EngineConfigError, CheckpointError, RequestFailedError, RequestError
from livemoe.engine.live import LiveSession
from livemoe.engine.llm import LLM
from livemoe.engine.model.config import ModelConfig, load_config
from livemoe.engine.model.loader import init_model, load_model, load_tokenizer
from livemoe.engine.model.qwen3 import Qwen3ForCausalLM
from livemoe.engine.model.saver import save_model
from livemoe.engine.outputs import CompletionOutput, RequestMetrics, RequestOutput
from livemoe.engine.sampling.params import SamplingParams

__all__ = ["AsyncLLM", "ModelConfig", "load_config", "CheckpointError", "init_model", "load_model", "load_tokenizer",
           "save_model", "Qwen3ForCausalLM", "EngineConfig", "EngineConfigError", "LiveSession", "LLM", "CompletionOutput",
           "RequestMetrics", "RequestOutput", "RequestError", "RequestFailedError", "SamplingParams"]
