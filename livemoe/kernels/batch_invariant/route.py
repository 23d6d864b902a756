"""Triton: the exact mode's routing, Qwen3-MoE's per row of router logits [M, E]: fp32 softmax (max, exp, tl.sum's
fixed tree over the row, divide), the top k one at a time (the lower expert id first among equal probabilities:
tl.argmax's tie break), or the experts of a replayed topk_ids [M, k]; renormalised by their sum taken in top-k
order. One program per row: a row's weights and ids do not depend on the others."""
import torch
import triton
import triton.language as tl


@triton.jit
def bi_route_kernel(logits_ptr, replay_ptr, w_ptr, ids_ptr, E, TOP_K, stride_lm, REPLAY: tl.constexpr,
                    RENORMALIZE: tl.constexpr, BLOCK_E: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    offs = tl.arange(0, BLOCK_E)
    ok = offs < E
    x = tl.load(logits_ptr + row * stride_lm + offs, mask=ok, other=float("-inf")).to(tl.float32)
    p = tl.exp(x - tl.max(x, 0))
    probs = p / tl.sum(p, 0)
    left = tl.where(ok, probs, -1.0)  # probabilities not yet taken (taken or padding: -1, below any)
    kept = 0.0
    for j in range(0, TOP_K):
        if REPLAY:
            best = tl.load(replay_ptr + row * TOP_K + j).to(tl.int32)
        else:
            best = tl.argmax(left, 0, tie_break_left=True).to(tl.int32)
        weight = tl.sum(tl.where(offs == best, probs, 0.0), 0)
        left = tl.where(offs == best, -1.0, left)
        kept += weight
        tl.store(ids_ptr + row * TOP_K + j, best.to(tl.int64))
        tl.store(w_ptr + row * TOP_K + j, weight)
    if RENORMALIZE:
        for j in range(0, TOP_K):
            tl.store(w_ptr + row * TOP_K + j, tl.load(w_ptr + row * TOP_K + j) / kept)


def route_meta(num_experts: int) -> dict:
    return dict(BLOCK_E=max(16, triton.next_power_of_2(num_experts)))


def bi_route(router_logits: torch.Tensor, top_k: int, renormalize: bool,
             topk_ids: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """-> (topk_weights [M, k] fp32, topk_ids [M, k] int64); replayed ids are taken as given (range-checked by the
    caller, livemoe.kernels.moe.routing.check_replay)."""
    assert router_logits.dim() == 2 and 1 <= top_k <= router_logits.shape[1], (router_logits.shape, top_k)
    logits = router_logits.contiguous()
    M, E = logits.shape
    weights = torch.empty(M, top_k, dtype=torch.float32, device=logits.device)
    ids = torch.empty(M, top_k, dtype=torch.int64, device=logits.device)
    replay = None if topk_ids is None else topk_ids.to(device=logits.device, dtype=torch.int64).contiguous()
    assert replay is None or replay.shape == (M, top_k), (None if replay is None else replay.shape, M, top_k)
    if M:
        bi_route_kernel[(M,)](logits, replay if replay is not None else ids, weights, ids, E, top_k, logits.stride(0),
                              REPLAY=replay is not None, RENORMALIZE=renormalize, **route_meta(E))
    return weights, ids
