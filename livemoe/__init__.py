"""livemoe: kernel-optimized training (RFT, GRPO, live sessions) and paged-KV streaming decoding for
Mixture-of-Experts language models.

The public API, stable through reorganisations of the subpackages:

    from livemoe import LLM, AsyncLLM, SamplingParams, StructuredOutput, LiveSession
    from livemoe import load_model, save_model, load_tokenizer

Subpackages: `livemoe.engine` (model, loader, decoder, server), `livemoe.kernels` (Triton and C++ ops with
their references), `livemoe.train` (the trainers). The names load on first use, so `import livemoe` and
`livemoe --help` do not import torch.
"""
import importlib

# public name -> the module that defines it
_EXPORTS = {
    "LLM": "livemoe.engine.llm",
    "AsyncLLM": "livemoe.engine.async_llm",
    "SamplingParams": "livemoe.engine.sampling.params",
    "RequestError": "livemoe.engine.errors",
    "StructuredOutput": "livemoe.engine.sampling.structured",
    "LiveSession": "livemoe.engine.live",
    "EngineConfig": "livemoe.engine.decoder.config",
    "CompletionOutput": "livemoe.engine.outputs",
    "RequestOutput": "livemoe.engine.outputs",
    "CheckpointError": "livemoe.engine.errors",
    "RequestFailedError": "livemoe.engine.errors",
    "load_model": "livemoe.engine.model.loader",
    "save_model": "livemoe.engine.model.saver",
    "load_tokenizer": "livemoe.engine.model.loader",
    "load_config": "livemoe.engine.model.config",
}

__all__ = list(_EXPORTS)


def __getattr__(name: str):
    if name in _EXPORTS:
        value = getattr(importlib.import_module(_EXPORTS[name]), name)
        globals()[name] = value  # later lookups skip this function
        return value
    raise AttributeError(f"module 'livemoe' has no attribute {name!r}")


def __dir__():
    return sorted(set(globals()) | set(__all__))
