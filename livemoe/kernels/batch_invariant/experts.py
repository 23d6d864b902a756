"""Triton: the exact mode's routed experts, out[t] = dtype(sum_j w[t, j] * down_e(swiglu_e(x[t]))) with e =
topk_ids[t, j], the k terms added to an fp32 sum in top-k order.

The two GEMMs are the MoE grouped GEMMs (livemoe/kernels/moe/grouped_gemm.py) over (token, slot) pairs sorted by
expert, at one config that depends on the dtype alone (EXACT_CONFIG: never the batch's size, unlike the
default path's heuristic): no split-K, each pair's row walks K from 0 in BLOCK_K steps, so its value does not
depend on which other pairs share its tile. The down GEMM writes each pair's unweighted output rounded to the
dtype (as the layers round it), and a last kernel sums the k of a token in top-k order; the default path's
`.sum(dim=1)` leaves that order to the reduction kernel's launch heuristics.
"""
import torch
import triton
import triton.language as tl

from livemoe.kernels.batch_invariant.checks import same_dtype
from livemoe.kernels.moe.align import moe_align
from livemoe.kernels.moe.configs import MoEConfig
from livemoe.kernels.moe.triton_moe import gate_up_swiglu, gather_gemm

BLOCK_H = 256


def exact_config(dtype: torch.dtype) -> MoEConfig:
    """The one config of a dtype (a mid-size one of heuristic_config: tensor-core tiles for training batches,
    weights streamed once per align block for decode)."""
    wide = 2 if dtype == torch.float32 else 1
    return MoEConfig(64, 64, 64 // wide, group_m=8, num_warps=4, num_stages=3)


@triton.jit(do_not_specialize=["num_tokens"])
def bi_combine_kernel(y_ptr, w_ptr, out_ptr, num_tokens, H, TOP_K: tl.constexpr, BLOCK_H: tl.constexpr):
    """out[t] = dtype(sum_j w[t, j] * y[t * k + j]) in j order, fp32."""
    t = tl.program_id(0).to(tl.int64)
    offs = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    mask = offs < H
    acc = tl.zeros([BLOCK_H], tl.float32)
    for j in tl.static_range(TOP_K):
        y = tl.load(y_ptr + (t * TOP_K + j) * H + offs, mask=mask, other=0.0).to(tl.float32)
        acc += tl.load(w_ptr + t * TOP_K + j) * y
    tl.store(out_ptr + t * H + offs, acc.to(out_ptr.dtype.element_ty), mask=mask)


def bi_moe(x: torch.Tensor, w_gate_up: torch.Tensor, w_down: torch.Tensor, topk_weights: torch.Tensor,
           topk_ids: torch.Tensor) -> torch.Tensor:
    """x [T, H], w_gate_up [E, 2I, H], w_down [E, H, I], topk_weights/ids [T, k] -> [T, H] in x's dtype."""
    T, H = x.shape
    E, inter = w_down.shape[0], w_down.shape[2]
    k = topk_ids.shape[1]
    assert w_gate_up.shape == (E, 2 * inter, H), (w_gate_up.shape, w_down.shape)
    same_dtype("bi_moe", x=x, w_gate_up=w_gate_up, w_down=w_down)
    out = torch.empty_like(x)
    if T == 0:
        return out
    x, w_gate_up, w_down = x.contiguous(), w_gate_up.contiguous(), w_down.contiguous()
    cfg = exact_config(x.dtype)
    sorted_ids, expert_ids, _, _ = moe_align(topk_ids, E, cfg.block_m)
    act = gate_up_swiglu(x, w_gate_up, sorted_ids, expert_ids, k, cfg)
    y = torch.empty(T * k, H, dtype=x.dtype, device=x.device)
    gather_gemm(act, w_down, y, None, sorted_ids, expert_ids, T * k, 1, H, inter,
                (w_down.stride(0), w_down.stride(1), w_down.stride(2)), cfg)
    bi_combine_kernel[(T, triton.cdiv(H, BLOCK_H))](y, topk_weights.float().contiguous(), out, T, H, TOP_K=k,
                                                    BLOCK_H=BLOCK_H)
    return out
