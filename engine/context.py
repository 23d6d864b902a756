"""The decoder step's attention metadata, set by the model runner around one forward and read by every
engine.attention.Attention layer (the model itself never sees a request). No context: plain attention."""
from dataclasses import dataclass, field

import torch


@dataclass(slots=True)
class Context:
    slot_mapping: torch.Tensor  # [N] flat cache slot of each new token (-1: padded row, not stored)
    context_lens: torch.Tensor  # [S] tokens in cache per sequence after this step (int32)
    block_tables: torch.Tensor  # [S, max_blocks] (int32; unused entries -1)
    cu_seqlens_q: torch.Tensor | None = None  # [S + 1] new tokens per sequence, cumulative (int32)
    max_seqlen_q: int = 1
    max_context_len: int | None = None  # host copy of context_lens.max() (flash-attn wants it)
    is_decode: bool = True  # every sequence has exactly one new token (N == S)
    backend: str = "auto"  # kernels.attention backend: auto | triton | reference
    num_splits: int | None = None  # split-KV for decode; fixed for CUDA-graph replay
    scratch: dict = field(default_factory=dict)  # per-step values the kernels compute once for all layers


_CONTEXT: Context | None = None


def get_context() -> Context | None:
    return _CONTEXT


def set_context(context: Context) -> None:
    global _CONTEXT
    _CONTEXT = context


def reset_context() -> None:
    global _CONTEXT
    _CONTEXT = None
