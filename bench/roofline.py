"""A roofline model of the GPU kernels: for each op and shape, the bytes it must move through HBM and the
FLOPs it must do, and the time they take on an H200: bytes at 4.8 TB/s (the datasheet peak) and at 4.3 TB/s
(what a device-to-device copy reaches), FLOPs at 989 TFLOP/s (bf16 dense). The prediction is the larger of
the two times at the copy bandwidth; the GPU benchmark rows print their measured time as a multiple of it
(the `x model` column of results.md), so the first GPU run shows which kernel is far from its bound.

Bytes are HBM traffic of an ideal kernel of the design we run: every operand read once (an expert's weights
once per pass however many align blocks it has: the grouped launch order keeps a weight tile in L2 for the
blocks that share it) and every result written once, plus the round trips the design makes on purpose (the
MoE combine's [T*k, H] pair rows, the expert-gradient kernels writing every expert's tile, zeros included,
the log-prob backward's d-logits buffer). Routing is uniform: T tokens touch E (1 - (1 - k/E)^T) experts.
"""
import math
from dataclasses import dataclass

H200_PEAK_BPS = 4.8e12
H200_COPY_BPS = 4.3e12
H200_BF16_FLOPS = 989e12


@dataclass(frozen=True)
class Cost:
    bytes: float
    flops: float

    def __add__(self, other: "Cost") -> "Cost":
        return Cost(self.bytes + other.bytes, self.flops + other.flops)

    def time_s(self, bandwidth: float = H200_COPY_BPS, flops_per_s: float = H200_BF16_FLOPS) -> float:
        return max(self.bytes / bandwidth, self.flops / flops_per_s)

    def bound(self, bandwidth: float = H200_COPY_BPS, flops_per_s: float = H200_BF16_FLOPS) -> str:
        return "memory" if self.bytes / bandwidth >= self.flops / flops_per_s else "compute"


def predict_s(cost: Cost) -> float:
    """The model's time: bytes at copy bandwidth or FLOPs at the bf16 dense rate, whichever is longer."""
    return cost.time_s(H200_COPY_BPS, H200_BF16_FLOPS)


def touched_experts(num_tokens: int, num_experts: int, top_k: int) -> float:
    """Expected distinct experts under uniform routing (exactly top_k for one token)."""
    return num_experts * (1 - (1 - top_k / num_experts) ** num_tokens)


def moe_forward(T: int, H: int, I: int, E: int, k: int, block_m: int, elt: int = 2) -> dict[str, Cost]:
    """The MoE layer's forward, op by op: router GEMM + top-k, align, gate_up_swiglu, down GEMM, the k-way sum."""
    P = T * k
    reads = touched_experts(T, E, k)
    return {
        "router": Cost(T * H * elt + E * H * elt + T * E * elt, 2 * T * E * H),
        "align": Cost(P * 8 + (P + min(E, P) * (block_m - 1)) * 4, 0),  # int64 ids in, padded int32 ids out
        "gate_up": Cost(T * H * elt + reads * 2 * I * H * elt + P * I * elt, 2 * P * H * 2 * I),
        "down": Cost(P * I * elt + reads * H * I * elt + P * 4 + P * H * elt, 2 * P * I * H),
        "combine": Cost(P * H * elt + T * H * elt, P * H),
    }


def moe_backward(T: int, H: int, I: int, E: int, k: int, block_n: int, elt: int = 2) -> dict[str, Cost]:
    """TritonMoEFunction.backward's kernels (down_backward writes one routing-weight partial per I tile)."""
    P = T * k
    reads = touched_experts(T, E, k)
    return {
        "down_backward": Cost(T * H * elt + reads * H * I * elt + P * 2 * I * elt  # dy, W_down, preact
                              + P * I * elt + P * 2 * I * elt + P * math.ceil(I / block_n) * 4,  # act, dpre, dw
                              2 * P * H * I),
        "dx": Cost(P * 2 * I * elt + reads * 2 * I * H * elt + P * H * elt + P * H * elt + T * H * elt,
                   2 * P * 2 * I * H + P * H),
        "dW_gate_up": Cost(P * 2 * I * elt + T * H * elt + E * 2 * I * H * elt, 2 * P * 2 * I * H),
        "dW_down": Cost(T * H * elt + P * I * elt + P * 4 + E * H * I * elt, 2 * P * H * I),
    }


def moe_decode_layer_bytes(H: int, I: int, E: int, k: int, elt: int = 2) -> dict[str, float]:
    """Batch 1: what the layer's kernels actually read, in bytes. Each of the k experts' weights once (W_gate_up
    [2I, H] and W_down [H, I]), the router's [E, H], and the activations (x, the [k, I] act, the [k, H] rows)."""
    experts = k * 3 * H * I * elt
    return {"experts": experts, "router": E * H * elt,
            "activations": sum(c.bytes for c in moe_forward(1, H, I, E, k, 16, elt).values())
            - experts - (E * H * elt)}


def moe_layer(T: int, H: int, I: int, E: int, k: int, backward: bool, elt: int = 2) -> Cost:
    """The whole layer at the config the dispatch picks (fused_moe: router, align, experts; with backward, the
    forward also writes the [T*k, 2I] pre-activations, and the backward kernels run)."""
    import torch

    from livemoe.kernels.moe.configs import heuristic_config

    cfg = heuristic_config(T, E, H, I, k, torch.bfloat16 if elt == 2 else torch.float32)
    cost = sum(moe_forward(T, H, I, E, k, cfg.block_m, elt).values(), Cost(0, 0))
    if backward:
        cost += Cost(T * k * 2 * I * elt, 0) + sum(moe_backward(T, H, I, E, k, cfg.block_n, elt).values(), Cost(0, 0))
    return cost


def logprobs_forward(N: int, V: int, H: int, elt: int = 2) -> Cost:
    """hidden and the lm_head once, targets in, four fp32 partials per row and vocabulary split out."""
    return Cost(N * H * elt + V * H * elt + N * 8 + 4 * N * 4, 2 * N * V * H)


def logprobs_backward(N: int, V: int, H: int, chunk_vocab: int, elt: int = 2) -> dict[str, Cost]:
    """The d-logits kernel (recomputes the logits, writes dz chunk by chunk), then two cuBLAS GEMMs per chunk:
    dW = dz^T hidden and dh += dz W[chunk] (dh kept in fp32, read and written once per chunk)."""
    chunks = math.ceil(V / chunk_vocab)
    return {
        "dz": Cost(N * H * elt * chunks + V * H * elt + N * V * elt + 5 * N * 4, 2 * N * V * H),
        "dW": Cost(N * V * elt + N * H * elt * chunks + V * H * elt, 2 * N * V * H),
        "dh": Cost(N * V * elt + V * H * elt + chunks * 2 * N * H * 4, 2 * N * V * H),
    }


def logprobs_pass(N: int, V: int, H: int, what: str, elt: int = 2) -> Cost:
    """fused_linear_logprobs at the dispatch's d-logits chunk (api.py): "fwd", "bwd" or "fwd+bwd"."""
    from livemoe.kernels.logprobs.api import TRITON_DZ_BYTES, TRITON_MAX_TOKENS

    chunk_vocab = max(128, TRITON_DZ_BYTES // (min(N, TRITON_MAX_TOKENS) * elt) // 128 * 128)
    fwd = logprobs_forward(N, V, H, elt)
    bwd = sum(logprobs_backward(N, V, H, chunk_vocab, elt).values(), Cost(0, 0))
    return {"fwd": fwd, "bwd": bwd, "fwd+bwd": fwd + bwd}[what]


def paged_decode(batch: int, context: int, hq: int, hkv: int, d: int, block_size: int, elt: int = 2) -> Cost:
    """K and V of every sequence's context once, q in and out, the block tables."""
    return Cost(2 * batch * context * hkv * d * elt + 2 * batch * hq * d * elt + batch * context // block_size * 4,
                4 * batch * hq * context * d)


def paged_prefill(seqs: int, prefix: int, chunk: int, hq: int, hkv: int, d: int, elt: int = 2) -> Cost:
    """Causal: new token i of a sequence sees prefix + i + 1 positions; K/V of each context read once."""
    seen = seqs * (chunk * prefix + chunk * (chunk + 1) // 2)
    return Cost(2 * seqs * chunk * hq * d * elt + 2 * seqs * (prefix + chunk) * hkv * d * elt, 4 * hq * d * seen)


def decode_step(cfg, batch: int, context: int, elt: int = 2) -> Cost:
    """One decode step of a model (engine ModelConfig): the shared weights, the experts its tokens touch and
    their KV once; FLOPs of every matmul a token runs and of its attention over the context."""
    from livemoe.engine.model.flops import attention_flops_per_token, param_counts

    c = param_counts(cfg)
    weights = c["active_matmul"] - c["active_experts"]
    if cfg.num_experts:  # one expert's weights summed over the MoE layers, times the experts a layer touches
        weights += c["experts"] / cfg.num_experts * touched_experts(batch, cfg.num_experts, cfg.num_experts_per_tok)
    kv = batch * context * cfg.num_hidden_layers * 2 * cfg.num_key_value_heads * cfg.head_dim
    return Cost((weights + kv) * elt, batch * (2 * c["active_matmul"] + attention_flops_per_token(cfg, context)))


def roofline_rows(s) -> list[dict]:
    """The table beside the static report (bench/static_gpu.py), at Qwen3-30B-A3B's shapes (s: Qwen3Shapes)."""
    import torch

    from livemoe.kernels.logprobs.api import TRITON_DZ_BYTES, TRITON_MAX_TOKENS
    from livemoe.kernels.moe.configs import heuristic_config

    rows = []

    def add(op, case, cost):
        rows.append({"op": op, "case": case, "bytes": cost.bytes, "flops": cost.flops,
                     "us_at_peak": 1e6 * cost.time_s(H200_PEAK_BPS), "us_model": 1e6 * predict_s(cost),
                     "bound": cost.bound()})

    H, I, E, k = s.hidden, s.moe_inter, s.experts, s.top_k
    for T in s.moe_tokens:
        cfg = heuristic_config(T, E, H, I, k, torch.bfloat16)
        fwd = moe_forward(T, H, I, E, k, cfg.block_m)
        for op, cost in fwd.items():
            add(f"moe {op}", f"T={T}", cost)
        add("moe layer fwd", f"T={T}", sum(fwd.values(), Cost(0, 0)))
        bwd = moe_backward(T, H, I, E, k, cfg.block_n)
        for op, cost in bwd.items():
            add(f"moe {op}", f"T={T}", cost)
    N, V = s.logprob_tokens, s.vocab
    chunk_vocab = max(128, TRITON_DZ_BYTES // (min(N, TRITON_MAX_TOKENS) * 2) // 128 * 128)
    add("logprobs fwd", f"N={N} V={V} H={H}", logprobs_forward(N, V, H))
    for op, cost in logprobs_backward(N, V, H, chunk_vocab).items():
        add(f"logprobs bwd {op}", f"N={N} V={V} H={H}", cost)
    for batch in s.decode_batches:
        add("paged decode", f"batch={batch} context={s.context}",
            paged_decode(batch, s.context, s.q_heads, s.kv_heads, s.head_dim, s.kv_block))
    add("paged prefill", f"1 x {s.prefill_tokens} new tokens", paged_prefill(1, 0, s.prefill_tokens, s.q_heads,
                                                                             s.kv_heads, s.head_dim))
    return rows


def markdown_table(rows: list[dict], s=None) -> str:
    lines = ["## Roofline (H200: 4.8 TB/s peak, 4.3 TB/s copy, 989 TFLOP/s bf16 dense)", "",
             "| op | case | MB moved | GFLOP | FLOP/B | µs at 4.8 TB/s | µs model (4.3 TB/s) | bound |",
             "| --- | --- | ---: | ---: | ---: | ---: | ---: | --- |"]
    for r in rows:
        intensity = r["flops"] / r["bytes"] if r["bytes"] else float("inf")
        lines.append(f"| {r['op']} | {r['case']} | {r['bytes'] / 1e6:.2f} | {r['flops'] / 1e9:.3f} | {intensity:.1f} | "
                     f"{r['us_at_peak']:.2f} | {r['us_model']:.2f} | {r['bound']} |")
    if s is not None:
        parts = moe_decode_layer_bytes(s.hidden, s.moe_inter, s.experts, s.top_k)
        total = sum(parts.values())
        lines += ["", f"Batch-1 MoE layer: the kernels read {parts['experts'] / 1e6:.2f} MB of expert weights "
                  f"({s.top_k} experts x 3 x {s.hidden} x {s.moe_inter} x 2 B) = "
                  f"{1e6 * parts['experts'] / H200_COPY_BPS:.1f} µs at 4.3 TB/s (the floor), plus "
                  f"{parts['router'] / 1e6:.2f} MB of router and {parts['activations'] / 1e3:.1f} KB of activations: "
                  f"{total / 1e6:.2f} MB, {1e6 * total / H200_COPY_BPS:.1f} µs at 4.3 TB/s, "
                  f"{1e6 * total / H200_PEAK_BPS:.1f} µs at 4.8 TB/s (target: 25 µs)."]
    return "\n".join(lines)
