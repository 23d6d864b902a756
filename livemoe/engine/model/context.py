"""The decoder step's state: attention metadata and the KV cache's per-layer views, made by the model runner
for one forward and passed down it as an argument (`model.forward_hidden(..., step=ctx)`), so every
livemoe.engine.model.attention.Attention layer reads it without the model ever seeing a request. No step context: plain
attention (training, reference). Nothing is stored on the modules or in globals, so one module can serve a
trainer and several engines at once, from any thread."""
from dataclasses import dataclass, field

import torch


class PlanCache:
    """A runner's last plan of its model for the fused CPU step (livemoe.engine.model.fused_decode, which fills and
    checks it), kept across the runner's steps."""
    __slots__ = ("model", "call", "reads", "hook_id")

    def __init__(self):
        self.model = self.call = self.reads = None
        self.hook_id = -1


@dataclass(slots=True)
class StepContext:
    kv_caches: list[tuple[torch.Tensor, torch.Tensor]]  # the runner's (K, V) per layer [num_blocks, block_size, Hkv, D]
    slot_mapping: torch.Tensor  # [N] flat cache slot of each new token (-1: padded row, not stored)
    context_lens: torch.Tensor  # [S] tokens in cache per sequence after this step (int32)
    block_tables: torch.Tensor  # [S, max_blocks] (int32; unused entries -1)
    cu_seqlens_q: torch.Tensor | None = None  # [S + 1] new tokens per sequence, cumulative (int32)
    max_seqlen_q: int = 1
    max_context_len: int | None = None  # host copy of context_lens.max() (flash-attn wants it)
    is_decode: bool = True  # every sequence has exactly one new token (N == S)
    backend: str = "auto"  # livemoe.kernels.attention backend: auto | triton | reference
    num_splits: int | None = None  # split-KV for decode; fixed for CUDA-graph replay
    scratch: dict = field(default_factory=dict)  # per-step values the kernels compute once for all layers
    plan_cache: PlanCache | None = None  # the runner's fused CPU step plan, kept across its steps (fused_decode)
