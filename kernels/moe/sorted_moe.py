"""The expert computation for the CPU: sort the (token, slot) pairs by expert once (the C++ align op with
block size 1, a counting sort), then two matmuls per non-empty expert on contiguous segments, with every
elementwise step (SwiGLU, routing weight, its backward) done once over all pairs. Forward and backward in
one autograd.Function; saved for backward: x, the weights, the routing weights, the sort and the
pre-activations [T*k, 2I] (the gathered x is re-gathered, the expanded output is never kept).

It runs on any device but reads the per-expert counts on the host, so CUDA uses the Triton path instead.
"""
import torch
import torch.nn.functional as F

from kernels.moe.align import moe_align


def _segments(counts: torch.Tensor):
    """(expert, start, end) of each non-empty expert's run of sorted pairs."""
    out, start = [], 0
    for e, c in enumerate(counts.tolist()):
        if c:
            out.append((e, start, start + c))
            start += c
    return out


def _grouped_mm(a: torch.Tensor, w: torch.Tensor, segs, transpose_w: bool, out_cols: int) -> torch.Tensor:
    """out[s:e] = a[s:e] @ (w[expert].T if transpose_w else w[expert]) for each segment."""
    out = a.new_empty(a.shape[0], out_cols)
    for e, s, t in segs:
        torch.mm(a[s:t], w[e].t() if transpose_w else w[e], out=out[s:t])
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
        segs = _segments(counts)
        w_sorted = topk_weights.reshape(-1)[order].to(x.dtype)
        preact = _grouped_mm(x.index_select(0, tokens), w_gate_up, segs, True, 2 * inter)
        gate, up = preact.chunk(2, dim=-1)
        y = _grouped_mm(F.silu(gate) * up, w_down, segs, True, hidden)
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
        segs = _segments(counts)
        gate, up = preact.chunk(2, dim=-1)
        sig = torch.sigmoid(gate)
        silu = gate * sig
        act = silu * up
        dy = dout.to(x.dtype).index_select(0, tokens)
        g = _grouped_mm(dy, w_down, segs, False, act.shape[1])  # dL/d(act) before the routing weight
        d_w_sorted = (g.float() * act.float()).sum(dim=1)
        d_topk_w = torch.empty_like(d_w_sorted).index_copy_(0, order, d_w_sorted).view(-1, top_k)
        dact = g * w_sorted[:, None]
        dpre = torch.cat([dact * up * sig * (1 + gate * (1 - sig)), dact * silu], dim=1)
        dx = dw_gate_up = dw_down = None
        if ctx.needs_input_grad[0]:
            dx = torch.zeros_like(x).index_add_(0, tokens, _grouped_mm(dpre, w_gate_up, segs, False, x.shape[1]))
        if ctx.needs_input_grad[1]:
            xs = x.index_select(0, tokens)
            dw_gate_up = torch.zeros(w_gate_up.shape, dtype=x.dtype, device=x.device)
            for e, s, t in segs:
                torch.mm(dpre[s:t].t(), xs[s:t], out=dw_gate_up[e])
        if ctx.needs_input_grad[2]:
            dyw = dy * w_sorted[:, None]
            dw_down = torch.zeros(w_down.shape, dtype=x.dtype, device=x.device)
            for e, s, t in segs:
                torch.mm(dyw[s:t].t(), act[s:t], out=dw_down[e])
        return dx, dw_gate_up, dw_down, d_topk_w, None


def experts_sorted(hidden_states, w_gate_up, w_down, topk_weights, topk_ids):
    """sum_j topk_weights[t, j] * expert_{topk_ids[t, j]}(x_t), sorted-segment path (see module doc)."""
    return SortedMoEFunction.apply(hidden_states, w_gate_up, w_down, topk_weights.float(), topk_ids)
