"""The building blocks of a Qwen3 decoder layer, written to match transformers' numerics."""
import torch
import torch.nn.functional as F
from torch import nn

from livemoe.engine.model.linear import Linear
from livemoe.engine.model.tensor_parallel import TensorParallel, column_linear, parallel_experts, row_linear
from livemoe.kernels import batch_invariant
from livemoe.kernels.batch_invariant import ops as exact_ops
from livemoe.kernels.moe import fused_moe
from livemoe.kernels.norm import qk_norm_rope, rms_norm


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return rms_norm(x, self.weight, self.eps)


class RotaryEmbedding(nn.Module):
    """Default (unscaled) RoPE with the rotate-half convention; cos/sin computed in fp32.

    Returns (cos, signed_sin) [B, T, 1, D]: signed_sin is sin with its first half negated (what
    livemoe.kernels.norm's rotation takes; see rotate_half_reference).

    mrope_section (t, h, w): the multimodal rotary of Qwen3-Omni (interleaved MRoPE). Positions may then come as
    [3, B, T] (time, height, width): frequency i takes the height position when i % 3 == 1 and i < 3h, the width
    position when i % 3 == 2 and i < 3w, the time position otherwise. Positions [B, T] are the same on all three
    axes, which is plain RoPE, so text and decode steps take the plain path unchanged."""

    def __init__(self, head_dim: int, theta: float, mrope_section: list[int] | None = None):
        super().__init__()
        inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.float32) / head_dim))
        self.register_buffer("inv_freq", inv_freq, persistent=False)
        axis = None
        if mrope_section is not None:
            axis = torch.zeros(head_dim // 2, dtype=torch.long)
            for dim in (1, 2):
                axis[dim:3 * mrope_section[dim]:3] = dim
        self.register_buffer("mrope_axis", axis, persistent=False)

    def forward(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        if batch_invariant.enabled():  # cos/sin by scalar libm calls: the same bits at any tensor size
            if positions.dim() == 3 and self.mrope_axis is not None:
                raise ValueError("exact mode (batch_invariant) does not cover multimodal rotary positions (the Omni "
                                 "thinker): run it without exact mode")
            return exact_ops.rope_forward(positions, self.inv_freq, dtype)
        if positions.dim() == 3 and positions.shape[0] == 3 and self.mrope_axis is not None:
            per_axis = positions[..., None].float() * self.inv_freq.float()  # [3, B, T, D/2]
            index = self.mrope_axis.view(1, 1, 1, -1).expand(1, *per_axis.shape[1:])
            freqs = per_axis.gather(0, index)[0][..., None, :]  # [B, T, 1, D/2]
        else:
            freqs = positions[..., None, None].float() * self.inv_freq.float()  # [B, T, 1, D/2]
        cos, sin = freqs.cos(), freqs.sin()
        return torch.cat((cos, cos), dim=-1).to(dtype), torch.cat((-sin, sin), dim=-1).to(dtype)


def qk_norm_rotary(q: torch.Tensor, k: torch.Tensor, q_norm: RMSNorm, k_norm: RMSNorm, cos: torch.Tensor,
                   signed_sin: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Qwen3's per-head RMSNorm of q [B, T, Hq, D] and k [B, T, Hkv, D], then RoPE (livemoe.kernels.norm.qk_norm_rope)."""
    assert q_norm.eps == k_norm.eps, (q_norm.eps, k_norm.eps)
    return qk_norm_rope(q, k, q_norm.weight, k_norm.weight, cos, signed_sin, q_norm.eps)


class MLP(nn.Module):
    """Dense SwiGLU MLP (hub keys gate_proj / up_proj / down_proj); with `tp`, this rank's intermediate slice
    (gate/up column-parallel, down row-parallel: one all-reduce)."""

    def __init__(self, hidden_size: int, intermediate_size: int, tp: TensorParallel | None = None):
        super().__init__()
        self.gate_proj = column_linear(hidden_size, intermediate_size, False, tp)
        self.up_proj = column_linear(hidden_size, intermediate_size, False, tp)
        self.down_proj = row_linear(intermediate_size, hidden_size, False, tp)

    def forward(self, x: torch.Tensor, topk_ids=None) -> tuple[torch.Tensor, None]:
        assert topk_ids is None, "a dense MLP has no routing to replay"
        return self.down_proj(silu_mul(self.gate_proj(x), self.up_proj(x))), None


def silu_mul(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    if batch_invariant.enabled():
        return exact_ops.exact(exact_ops.silu_mul_forward, lambda g, u: F.silu(g) * u, gate, up)
    return F.silu(gate) * up


class Experts(nn.Module):
    """Experts held stacked, as the MoE kernels want them: gate_up_proj [E, 2I, H] (gate rows first),
    down_proj [E, H, I]. The names are transformers-v5's fused keys. Its own forward (the expert computation,
    livemoe.kernels.moe.fused_moe) lets livemoe.train.parallel shard it as a unit apart from the router."""

    def __init__(self, num_experts: int, hidden_size: int, intermediate_size: int):
        super().__init__()
        self.gate_up_proj = nn.Parameter(torch.empty(num_experts, 2 * intermediate_size, hidden_size))
        self.down_proj = nn.Parameter(torch.empty(num_experts, hidden_size, intermediate_size))
        # how the experts are spread over ranks, if they are: an object whose fused_moe replaces livemoe.kernels.moe's
        # (training: livemoe.train.parallel.ExpertParallel, set by parallelize(); decoding: livemoe.engine.model.tensor_parallel)
        self.expert_parallel = None

    def forward(self, x: torch.Tensor, router_logits: torch.Tensor, top_k: int, renormalize: bool,
                topk_ids: torch.Tensor | None = None) -> torch.Tensor:
        moe = fused_moe if self.expert_parallel is None else self.expert_parallel.fused_moe
        if topk_ids is None:  # the decoder's tensor-parallel layouts take no replay (Qwen3ForCausalLM refuses it)
            return moe(x, self.gate_up_proj, self.down_proj, router_logits, top_k, renormalize)
        return moe(x, self.gate_up_proj, self.down_proj, router_logits, top_k, renormalize, topk_ids=topk_ids)


class SparseMoeBlock(nn.Module):
    """Router (hub key mlp.gate.weight) + experts; the expert computation is livemoe.kernels.moe.fused_moe. With `tp`,
    the router is replicated and the experts are this rank's (livemoe.engine.model.tensor_parallel)."""

    def __init__(self, hidden_size: int, num_experts: int, intermediate_size: int, top_k: int, norm_topk_prob: bool,
                 tp: TensorParallel | None = None):
        super().__init__()
        self.gate = Linear(hidden_size, num_experts, bias=False)
        if tp is None:
            self.experts = Experts(num_experts, hidden_size, intermediate_size)
        else:
            layout = parallel_experts(tp, num_experts, intermediate_size)
            self.experts = Experts(layout.local_shape[0], hidden_size, layout.local_shape[1])
            self.experts.expert_parallel, self.experts.shards = layout, layout.shards
        self.top_k = top_k
        self.norm_topk_prob = norm_topk_prob

    def forward(self, x: torch.Tensor, topk_ids: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """x [..., H] -> (out [..., H], router_logits [N, E]); topk_ids [N, k]: replay these experts (R3)."""
        shape = x.shape
        flat = x.reshape(-1, shape[-1])
        router_logits = self.gate(flat)
        out = self.experts(flat, router_logits, self.top_k, self.norm_topk_prob, topk_ids)
        return out.reshape(shape), router_logits
