"""The expert computation on the Triton grouped GEMMs, forward and backward in one autograd.Function.

Forward: align (device, no host sync) -> gate_up_swiglu -> gather_gemm (x routing weight, pair-indexed
[T*k, H]) -> fixed-order sum over the k slots. Saved for backward: x, the weights, the routing weights, the
align result and the pre-activations [T*k, 2I]; never the expanded [T*k, H] output.
Backward: down_backward (dgate/dup, act, routing-weight grad) -> gather_gemm (dx per pair, summed over k)
and expert_grad for both weight tensors. Every launch size comes from shapes: CUDA-graph safe.
"""
import os

import torch
import triton

from livemoe.kernels.dot_precision import dot_precision
from livemoe.kernels.moe import grouped_gemm as gg
from livemoe.kernels.moe.align import moe_align
from livemoe.kernels.moe.align_reference import num_align_blocks
from livemoe.kernels.moe.configs import MoEConfig, bucket_key, device_name, get_config, load_tuned, tune

_TUNED: set[str] = set()  # buckets tuned (or found tuned) in this process


def gather_gemm(a, b, out, scale, sorted_ids, expert_ids, num_pairs, a_div, n, kdim, strides_b, cfg: MoEConfig):
    num_pid_m = expert_ids.numel()
    grid = (num_pid_m * triton.cdiv(n, cfg.block_n),)
    gg.gather_gemm_kernel[grid](
        a, b, out, scale if scale is not None else a, sorted_ids, expert_ids, num_pairs, a_div, n, kdim, num_pid_m,
        a.stride(0), a.stride(1), *strides_b, out.stride(0),
        BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n, BLOCK_K=cfg.block_k, GROUP_M=cfg.group_m,
        SCALE_ROWS=scale is not None, PRECISION=dot_precision(a.dtype), num_warps=cfg.num_warps, num_stages=cfg.num_stages)


def _expert_grad(a, b, scale, out, sorted_ids, seg_start, counts, a_div, b_div, cfg: MoEConfig):
    num_experts, m, n = out.shape
    grid = (triton.cdiv(m, cfg.grad_block_m) * triton.cdiv(n, cfg.grad_block_n), num_experts)
    gg.expert_grad_kernel[grid](
        a, b, scale if scale is not None else a, out, sorted_ids, seg_start, counts, a_div, b_div, m, n,
        a.stride(0), b.stride(0), out.stride(0), out.stride(1),
        BLOCK_M=cfg.grad_block_m, BLOCK_N=cfg.grad_block_n, BLOCK_K=cfg.grad_block_k, SCALE_A=scale is not None,
        PRECISION=dot_precision(a.dtype), num_warps=cfg.num_warps, num_stages=cfg.num_stages)


def gate_up_swiglu(x, w_gate_up, sorted_ids, expert_ids, top_k: int, cfg: MoEConfig, preact=None):
    """act [T*k, I] = silu(x W_g^T) * (x W_u^T) per pair of the align blocks (and the pre-activations into
    `preact` [T*k, 2I] when given)."""
    num_pairs, inter = x.shape[0] * top_k, w_gate_up.shape[1] // 2
    num_pid_m = expert_ids.numel()
    act = torch.empty(num_pairs, inter, dtype=x.dtype, device=x.device)
    grid = (num_pid_m * triton.cdiv(inter, cfg.block_n),)
    gg.gate_up_swiglu_kernel[grid](
        x, w_gate_up, act, preact if preact is not None else act, sorted_ids, expert_ids, num_pairs, top_k,
        x.shape[1], inter, num_pid_m, x.stride(0), x.stride(1), w_gate_up.stride(0), w_gate_up.stride(1),
        w_gate_up.stride(2), act.stride(0), preact.stride(0) if preact is not None else 0,
        BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n, BLOCK_K=cfg.block_k, GROUP_M=cfg.group_m,
        SAVE_PREACT=preact is not None, PRECISION=dot_precision(x.dtype), num_warps=cfg.num_warps,
        num_stages=cfg.num_stages)
    return act


def experts_forward(x, w_gate_up, w_down, topk_weights, topk_ids, cfg: MoEConfig, save_preact: bool):
    """-> (out [T, H], preact [T*k, 2I] or None, (sorted_ids, expert_ids, counts))."""
    num_tokens, hidden = x.shape
    num_experts, inter = w_gate_up.shape[0], w_down.shape[2]
    top_k = topk_ids.shape[1]
    num_pairs = num_tokens * top_k
    sorted_ids, expert_ids, counts, _ = moe_align(topk_ids, num_experts, cfg.block_m)
    assert expert_ids.numel() == num_align_blocks(num_pairs, num_experts, cfg.block_m)
    preact = torch.empty(num_pairs, 2 * inter, dtype=x.dtype, device=x.device) if save_preact else None
    act = gate_up_swiglu(x, w_gate_up, sorted_ids, expert_ids, top_k, cfg, preact)
    y = torch.empty(num_pairs, hidden, dtype=x.dtype, device=x.device)
    gather_gemm(act, w_down, y, topk_weights.reshape(-1), sorted_ids, expert_ids, num_pairs, 1, hidden, inter,
                (w_down.stride(0), w_down.stride(1), w_down.stride(2)), cfg)
    out = y.view(num_tokens, top_k, hidden).sum(dim=1) if top_k > 1 else y.view(num_tokens, hidden)
    return out, preact, (sorted_ids, expert_ids, counts)


class TritonMoEFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, w_gate_up, w_down, topk_weights, topk_ids, cfg, grad_enabled: bool):
        # needs_input_grad says what backward needs, but it is set under no_grad and inference_mode too
        # (the decoder's), where saving the [T*k, 2I] pre-activations would only cost bandwidth
        train = grad_enabled and any(ctx.needs_input_grad[:4])
        out, preact, align = experts_forward(x, w_gate_up, w_down, topk_weights, topk_ids, cfg, save_preact=train)
        if train:
            ctx.save_for_backward(x, w_gate_up, w_down, topk_weights, preact, *align)
            ctx.cfg = cfg
            ctx.top_k = topk_ids.shape[1]
        return out

    @staticmethod
    def backward(ctx, dout):
        x, w_gate_up, w_down, topk_weights, preact, sorted_ids, expert_ids, counts = ctx.saved_tensors
        cfg, top_k = ctx.cfg, ctx.top_k
        num_tokens, hidden = x.shape
        num_pairs, inter = preact.shape[0], preact.shape[1] // 2
        dout = dout.contiguous().to(x.dtype)
        flat_w = topk_weights.reshape(-1)
        dpre = torch.empty_like(preact)
        act = torch.empty(num_pairs, inter, dtype=x.dtype, device=x.device)
        num_pid_m = expert_ids.numel()
        num_pid_n = triton.cdiv(inter, cfg.block_n)
        dw_part = torch.empty(num_pid_n, num_pairs, dtype=torch.float32, device=x.device)
        gg.down_backward_kernel[(num_pid_m * num_pid_n,)](
            dout, w_down, preact, flat_w, dpre, act, dw_part, sorted_ids, expert_ids, num_pairs, top_k, hidden,
            inter, num_pid_m, dout.stride(0), dout.stride(1), w_down.stride(0), w_down.stride(1), w_down.stride(2),
            preact.stride(0), act.stride(0),
            BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n, BLOCK_K=cfg.block_k, GROUP_M=cfg.group_m,
            PRECISION=dot_precision(x.dtype), num_warps=cfg.num_warps, num_stages=cfg.num_stages)
        d_topk_w = dw_part.sum(0).view(num_tokens, top_k).to(topk_weights.dtype)

        dx = dw_gate_up = dw_down = None
        if ctx.needs_input_grad[0]:
            dx_pairs = torch.empty(num_pairs, hidden, dtype=x.dtype, device=x.device)
            gather_gemm(dpre, w_gate_up, dx_pairs, None, sorted_ids, expert_ids, num_pairs, 1, hidden, 2 * inter,
                        (w_gate_up.stride(0), w_gate_up.stride(2), w_gate_up.stride(1)), cfg)
            dx = dx_pairs.view(num_tokens, top_k, hidden).sum(dim=1)
        if ctx.needs_input_grad[1] or ctx.needs_input_grad[2]:
            padded = (counts + cfg.block_m - 1) // cfg.block_m * cfg.block_m
            seg_start = (torch.cumsum(padded, 0) - padded).to(torch.int32)
            if ctx.needs_input_grad[1]:
                dw_gate_up = torch.empty(w_gate_up.shape, dtype=w_gate_up.dtype, device=x.device)
                _expert_grad(dpre, x, None, dw_gate_up, sorted_ids, seg_start, counts, 1, top_k, cfg)
            if ctx.needs_input_grad[2]:
                dw_down = torch.empty(w_down.shape, dtype=w_down.dtype, device=x.device)
                _expert_grad(dout, act, flat_w, dw_down, sorted_ids, seg_start, counts, top_k, 1, cfg)
        return dx, dw_gate_up, dw_down, d_topk_w, None, None, None


def experts_triton(hidden_states, w_gate_up, w_down, topk_weights, topk_ids, config: MoEConfig | None = None):
    """sum_j topk_weights[t, j] * expert_{topk_ids[t, j]}(x_t) on the Triton kernels (CUDA, or the interpreter)."""
    if hidden_states.device.type != "cuda" and os.environ.get("TRITON_INTERPRET") != "1":
        raise ValueError(f"the Triton MoE kernels need a CUDA device, got {hidden_states.device} (on the CPU they "
                         "run only under TRITON_INTERPRET=1, set before triton is imported: tests)")
    num_tokens, hidden = hidden_states.shape
    num_experts, inter = w_down.shape[0], w_down.shape[2]
    top_k = topk_ids.shape[1]
    cfg = config or get_config(num_tokens, num_experts, hidden, inter, top_k, hidden_states.dtype)
    if config is None and _should_tune(hidden_states, num_tokens, num_experts, hidden, inter, top_k):
        cfg = _autotune(hidden_states, w_gate_up, w_down, topk_weights, topk_ids)
    x = hidden_states if hidden_states.stride(-1) == 1 else hidden_states.contiguous()
    return TritonMoEFunction.apply(x, w_gate_up, w_down, topk_weights.float().contiguous(),
                                   topk_ids.contiguous(), cfg, torch.is_grad_enabled())


def _should_tune(x, num_tokens, num_experts, hidden, inter, top_k) -> bool:
    """LIVEMOE_MOE_AUTOTUNE=1: tune each new shape bucket once, on CUDA, never while a graph is captured."""
    if os.environ.get("LIVEMOE_MOE_AUTOTUNE") != "1" or x.device.type != "cuda" or torch.cuda.is_current_stream_capturing():
        return False
    key = bucket_key(num_tokens, num_experts, hidden, inter, top_k, x.dtype)
    if key in _TUNED or key in load_tuned().get(device_name(), {}):
        return False
    _TUNED.add(key)
    return True


def _autotune(x, w_gate_up, w_down, topk_weights, topk_ids) -> MoEConfig:
    def run(cfg):
        with torch.no_grad():
            experts_forward(x, w_gate_up, w_down, topk_weights.float(), topk_ids, cfg, save_preact=False)

    return tune(run, x.shape[0], w_gate_up.shape[0], x.shape[1], w_down.shape[2], topk_ids.shape[1], x.dtype)
