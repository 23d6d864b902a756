"""The expert computation for the CPU: sort the (token, slot) pairs by expert once (the C++ align op with
block size 1, a counting sort), then grouped matmuls over the experts' contiguous segments
(torch._grouped_mm where this torch runs it on the device, else one matmul per non-empty expert), with every
elementwise step (SwiGLU, routing weight, its backward) done once over all pairs. Forward and backward in
one autograd.Function; saved for backward: x, the weights, the routing weights, the sort and the
pre-activations [T*k, 2I] (the gathered x is re-gathered, the expanded output is never kept).

It runs on any device but reads the per-expert counts on the host, so CUDA uses the Triton path instead.
Inference on the CPU (no gradient needed) calls the C++ ops of csrc/moe_experts.cpp instead: the same
steps in one call (moe_experts), or the routing too (moe_forward, from fused_moe).
"""
import torch
import torch.nn.functional as F

from livemoe.kernels import _ext
from livemoe.kernels.moe.align import moe_align


def _segments(counts: torch.Tensor):
    """(expert, start, end) of each non-empty expert's run of sorted pairs."""
    out, start = [], 0
    for e, c in enumerate(counts.tolist()):
        if c:
            out.append((e, start, start + c))
            start += c
    return out


_HAS_GROUPED_MM: dict[tuple, bool] = {}


def _grouped_mm_works(device: torch.device, dtype: torch.dtype) -> bool:
    """torch._grouped_mm (one call for all experts, no Python loop) where this torch has it for the device and
    dtype; probed once on a tiny case, including an empty group."""
    key = (device.type, dtype)
    if key not in _HAS_GROUPED_MM:
        ok = hasattr(torch, "_grouped_mm")
        if ok:
            try:
                a = torch.ones(3, 16, device=device, dtype=dtype)
                w = torch.ones(2, 16, 16, device=device, dtype=dtype)
                offs = torch.tensor([0, 3], device=device, dtype=torch.int32)
                ok = bool((torch._grouped_mm(a, w, offs=offs) == 16).all()) and \
                    bool((torch._grouped_mm(a.t(), a, offs=offs)[1] == 3).all())
            except (RuntimeError, NotImplementedError, TypeError):
                ok = False
        _HAS_GROUPED_MM[key] = ok
    return _HAS_GROUPED_MM[key]


def _use_grouped_mm(num_experts: int, *tensors) -> bool:
    """torch._grouped_mm works here, its 16-byte alignment of every non-unit stride holds (odd H or I fail it),
    and most experts have pairs (it runs a matmul even for an empty group: at decode the loop over the
    touched experts is faster)."""
    return 2 * tensors[0].shape[0] >= num_experts and _grouped_mm_works(tensors[0].device, tensors[0].dtype) and all(
        t.data_ptr() % 16 == 0 and all(st * t.element_size() % 16 == 0 for st in t.stride() if st != 1)
        for t in tensors)


def _grouped_mm(a: torch.Tensor, w: torch.Tensor, counts, offs, transpose_w: bool, out_cols: int) -> torch.Tensor:
    """out[s:e] = a[s:e] @ (w[expert].T if transpose_w else w[expert]) for each expert's segment."""
    wt = w.transpose(1, 2) if transpose_w else w
    if _use_grouped_mm(w.shape[0], a, wt):
        return torch._grouped_mm(a, wt, offs=offs)
    out = a.new_empty(a.shape[0], out_cols)
    for e, s, t in _segments(counts):
        torch.mm(a[s:t], wt[e], out=out[s:t])
    return out


def _weight_grad(a: torch.Tensor, b: torch.Tensor, counts, offs, num_experts: int) -> torch.Tensor:
    """out[e] = a[s:e].T @ b[s:e] for each expert's segment (zeros for an expert with no pairs)."""
    if _use_grouped_mm(num_experts, a, b):
        return torch._grouped_mm(a.t(), b, offs=offs)
    out = a.new_zeros(num_experts, a.shape[1], b.shape[1])
    for e, s, t in _segments(counts):
        torch.mm(a[s:t].t(), b[s:t], out=out[e])
    return out


class SortedMoEFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, w_gate_up, w_down, topk_weights, topk_ids):
        num_tokens, hidden = x.shape
        top_k = topk_ids.shape[1]
        inter = w_down.shape[2]
        sorted_ids, _, counts, _ = moe_align(topk_ids, w_gate_up.shape[0], 1)  # block 1: no padding
        order = sorted_ids.long()
        tokens = order // top_k
        offs = torch.cumsum(counts, 0, dtype=torch.int32)
        w_sorted = topk_weights.reshape(-1)[order].to(x.dtype)
        preact = _grouped_mm(x.index_select(0, tokens), w_gate_up, counts, offs, True, 2 * inter)
        gate, up = preact.chunk(2, dim=-1)
        y = _grouped_mm(F.silu(gate) * up, w_down, counts, offs, True, hidden)
        y.mul_(w_sorted[:, None])
        out = torch.zeros_like(x).index_add_(0, tokens, y)
        ctx.save_for_backward(x, w_gate_up, w_down, w_sorted, preact, order, counts)
        ctx.top_k = top_k
        return out

    @staticmethod
    def backward(ctx, dout):
        x, w_gate_up, w_down, w_sorted, preact, order, counts = ctx.saved_tensors
        top_k = ctx.top_k
        tokens = order // top_k
        offs = torch.cumsum(counts, 0, dtype=torch.int32)
        gate, up = preact.chunk(2, dim=-1)
        sig = torch.sigmoid(gate)
        silu = gate * sig
        act = silu * up
        dy = dout.to(x.dtype).index_select(0, tokens)
        g = _grouped_mm(dy, w_down, counts, offs, False, act.shape[1])  # dL/d(act) before the routing weight
        d_w_sorted = (g.float() * act.float()).sum(dim=1)
        d_topk_w = torch.empty_like(d_w_sorted).index_copy_(0, order, d_w_sorted).view(-1, top_k)
        dact = g * w_sorted[:, None]
        dpre = torch.cat([dact * up * sig * (1 + gate * (1 - sig)), dact * silu], dim=1)
        dx = dw_gate_up = dw_down = None
        if ctx.needs_input_grad[0]:
            dx = torch.zeros_like(x).index_add_(0, tokens, _grouped_mm(dpre, w_gate_up, counts, offs, False, x.shape[1]))
        if ctx.needs_input_grad[1]:
            dw_gate_up = _weight_grad(dpre, x.index_select(0, tokens), counts, offs, w_gate_up.shape[0])
        if ctx.needs_input_grad[2]:
            dw_down = _weight_grad(dy * w_sorted[:, None], act, counts, offs, w_down.shape[0])
        return dx, dw_gate_up, dw_down, d_topk_w, None


_HAS_CPP = _ext.has_op("moe_experts") and _ext.has_op("moe_forward")
_CPP_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


def cpu_inference(hidden_states: torch.Tensor, *tensors: torch.Tensor) -> bool:
    """The C++ inference ops (csrc/moe_experts.cpp: moe_experts, moe_forward) can serve this call: built, on
    the CPU, a dtype they take, and no gradient needed (they have no backward)."""
    return _HAS_CPP and hidden_states.dtype in _CPP_DTYPES and _ext.cpu_inference(hidden_states, *tensors)


def experts_sorted(hidden_states, w_gate_up, w_down, topk_weights, topk_ids):
    """sum_j topk_weights[t, j] * expert_{topk_ids[t, j]}(x_t), sorted-segment path (see module doc).
    Where no gradient is needed on a CPU (the decoder, rollouts), the same computation in one C++ call
    (csrc/moe_experts.cpp): a decode step of a small model otherwise pays ~20 dispatched ops per layer."""
    if cpu_inference(hidden_states, w_gate_up, w_down, topk_weights):
        return torch.ops.livemoe.moe_experts(hidden_states, w_gate_up, w_down, topk_weights, topk_ids)
    return SortedMoEFunction.apply(hidden_states, w_gate_up, w_down, topk_weights.float(), topk_ids)
