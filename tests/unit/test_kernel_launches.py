"""The launch lists the static report and the compile tests compile (bench/kernel_launches.py) are the launches
the dispatch makes: the public ops run here under the interpreter at small shapes, every Triton launch they
make is recorded (kernel, argument values, tensors by dtype, warps, stages), and compared with the lists built
for the same shapes. A change to a host launcher that the lists do not follow fails here."""
import os

import pytest
import torch

from bench.kernel_launches import Qwen3Shapes, attention_launches, exact_launches, logprobs_launches, moe_qwen3_launches

pytestmark = pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1",
                                reason="records launches through the interpreter (TRITON_INTERPRET=1, no GPU)")

SMALL = Qwen3Shapes(hidden=64, moe_inter=32, experts=8, top_k=2, q_heads=8, kv_heads=4, head_dim=16, vocab=300,
                    kv_block=16, moe_tokens=(4,), logprob_tokens=40, decode_batches=(1, 66), context=256,
                    prefill_tokens=24, num_sms=1)  # on the CPU forward() counts one SM


def _key(kernel: str, args: dict, num_warps: int, num_stages: int):
    """What decides a compile: ints and constants by value, tensors by dtype, floats by type alone."""
    def value(v):
        if isinstance(v, torch.Tensor):
            return v.dtype
        return "float" if isinstance(v, float) else v
    return kernel, tuple(sorted((k, value(v)) for k, v in args.items())), num_warps, num_stages


@pytest.fixture
def recorded(monkeypatch):
    from triton.runtime.interpreter import InterpretedFunction

    launches = []
    run = InterpretedFunction.run

    def recording_run(self, *args, grid, warmup, **kwargs):
        options = {k: kwargs.pop(k) for k in ("num_warps", "num_stages") if k in kwargs}
        bound = {**dict(zip(self.arg_names, args)), **kwargs}
        launches.append(_key(self.__name__, bound, options.get("num_warps", 4), options.get("num_stages", 3)))
        return run(self, *args, grid=grid, warmup=warmup, **kwargs)

    monkeypatch.setattr(InterpretedFunction, "run", recording_run)
    return launches


def _compare(recorded: list, listed: list) -> None:
    listed_keys = {_key(l.kernel, l.args, l.num_warps, l.num_stages) for l in listed}
    ran = {k for k in recorded}
    assert ran and listed_keys
    assert ran == listed_keys, (f"launched, not listed: {sorted(map(str, ran - listed_keys))}\n"
                                f"listed, not launched: {sorted(map(str, listed_keys - ran))}")


def test_moe_launches_are_the_dispatchs(recorded):
    from livemoe.kernels.moe import fused_moe

    s = SMALL
    g = torch.Generator().manual_seed(0)
    x = torch.randn(4, s.hidden, generator=g, requires_grad=True)
    w_gate_up = (torch.randn(s.experts, 2 * s.moe_inter, s.hidden, generator=g) / 8).requires_grad_()
    w_down = (torch.randn(s.experts, s.hidden, s.moe_inter, generator=g) / 6).requires_grad_()
    logits = torch.randn(4, s.experts, generator=g, requires_grad=True)
    with torch.no_grad():  # the inference variant of gate_up_swiglu (no pre-activations saved)
        fused_moe(x, w_gate_up, w_down, logits, s.top_k, True, backend="triton")
    fused_moe(x, w_gate_up, w_down, logits, s.top_k, True, backend="triton").square().sum().backward()
    # on the CPU the align runs in C++: only the grouped GEMMs are Triton here
    listed = [l for l in moe_qwen3_launches(s, torch.float32) if "align" not in l.kernel]
    _compare(recorded, listed)


def test_logprobs_launches_are_the_dispatchs(recorded):
    from livemoe.kernels.logprobs import fused_linear_logprobs

    s = SMALL
    g = torch.Generator().manual_seed(0)
    hidden = torch.randn(s.logprob_tokens, s.hidden, generator=g, requires_grad=True)
    weight = torch.randn(s.vocab, s.hidden, generator=g, requires_grad=True)
    targets = torch.randint(0, s.vocab, (s.logprob_tokens,), generator=g)
    mask = torch.arange(s.logprob_tokens) % 5 != 0
    fused_linear_logprobs(hidden, weight, targets, mask=mask, backend="triton").sum().backward()
    lp, ent = fused_linear_logprobs(hidden, weight, targets, mask=mask, backend="triton", return_entropy=True)
    (lp.sum() + ent.sum()).backward()
    _compare(recorded, logprobs_launches(s, torch.float32))


def test_attention_launches_are_the_dispatchs(recorded):
    from livemoe.kernels.attention import paged_decode_attention, paged_prefill_attention, store_kvcache

    s = SMALL
    hq, hkv, d, bs = s.q_heads, s.kv_heads, s.head_dim, s.kv_block
    max_blocks = s.context // bs
    g = torch.Generator().manual_seed(0)
    k_cache = torch.randn(4 * max_blocks, bs, hkv, d, generator=g)
    v_cache = torch.randn_like(k_cache)
    n = s.prefill_tokens
    k, v = torch.randn(n, hkv, d, generator=g), torch.randn(n, hkv, d, generator=g)
    store_kvcache(k, v, k_cache, v_cache, torch.arange(n), backend="triton")
    for batch in s.decode_batches:  # the split count follows the block tables' width, not the contexts:
        tables = torch.zeros(batch, max_blocks, dtype=torch.int32)  # one real row, padded rows (context 0)
        context_lens = (torch.arange(batch) == 0).to(torch.int32)
        paged_decode_attention(torch.randn(batch, hq, d, generator=g), k_cache, v_cache, tables, context_lens,
                               d ** -0.5, backend="triton")
    tables = torch.arange(max_blocks, dtype=torch.int32)[None]
    paged_prefill_attention(torch.randn(n, hq, d, generator=g), k_cache, v_cache,
                            torch.tensor([0, n], dtype=torch.int32), torch.tensor([n], dtype=torch.int32), tables,
                            d ** -0.5, n, backend="triton")
    _compare(recorded, attention_launches(s, torch.float32))


def test_exact_launches_are_the_dispatchs(recorded):
    """The exact mode's ops (livemoe.kernels.batch_invariant.ops, on the Triton backend) at the listed shapes."""
    from livemoe.kernels.batch_invariant import batch_invariant_mode
    from livemoe.kernels.batch_invariant import ops as bi

    s = SMALL
    hq, hkv, d, bs, T, H = s.q_heads, s.kv_heads, s.head_dim, s.kv_block, s.prefill_tokens, s.hidden
    g = torch.Generator().manual_seed(0)
    rnd = lambda *shape: torch.randn(*shape, generator=g)  # noqa: E731
    x = rnd(T, H)
    with batch_invariant_mode(backend="triton"):
        bi.linear_forward(x, rnd((hq + 2 * hkv) * d, H))
        bi.linear_forward(rnd(T, hq * d), rnd(H, hq * d), rnd(H))
        bi.log_softmax(bi.linear_forward(x, rnd(s.vocab, H)))
        bi.rms_norm_forward(x, rnd(H), 1e-6)
        bi.rms_norm_forward(rnd(T, hq, d), rnd(d), 1e-6)
        bi.silu_mul_forward(rnd(T, s.moe_inter), rnd(T, s.moe_inter))
        bi.rope_forward(torch.arange(T), rnd(d // 2).abs(), torch.float32)
        weights, ids = bi.route(rnd(T, s.experts), s.top_k, True)
        bi.route(rnd(T, s.experts), s.top_k, True, ids)
        bi.experts_forward(x, rnd(s.experts, 2 * s.moe_inter, H), rnd(s.experts, H, s.moe_inter), weights, ids)
        k_cache, v_cache = rnd(4, s.context, hkv, d), rnd(4, s.context, hkv, d)  # blocks of `context` tokens ...
        tables = torch.zeros(1, s.context // bs, dtype=torch.int32)  # ... read as the listing's 16-token blocks
        bi.paged_attention_forward(rnd(T, hq, d), k_cache.view(-1, bs, hkv, d), v_cache.view(-1, bs, hkv, d),
                                   torch.tensor([0, T], dtype=torch.int32), torch.tensor([T], dtype=torch.int32),
                                   tables, d ** -0.5)
    # the tables, routing and log-softmax take fp32 whatever the model's dtype: listed with the bf16 launches
    shared = ("bi_rope_kernel", "bi_route_kernel", "bi_log_softmax_kernel")
    listed = exact_launches(s, torch.float32) + [l for l in exact_launches(s, torch.bfloat16) if l.kernel in shared]
    _compare(recorded, listed)
