"""Issue 32, item 5 on the GPU: the exact mode's Triton kernels (livemoe/kernels/batch_invariant/*.py).

Here under TRITON_INTERPRET=1 (tests/conftest.py) in fp32 and fp16 (the interpreter's tl.dot on bf16 is not
bf16's; its tl.dot is numpy's matmul, made row-invariant by the row_invariant_interpreter_dot fixture, as some hosts'
BLAS round a row by its place in a block), on a GPU compiled (bench/gpu_check.sh selects the `triton` marker):

- each op's rows computed alone, in a batch of 7 and in a batch of 64 are equal bit for bit (torch.equal: the
  op's whole point), and close to the plain fp32 PyTorch formula. Tolerances: fp32 1e-5 (another summation
  order, fp32 rounding); fp16 2e-2 absolute and relative on O(1) values (the layers round each stage to fp16, whose
  ulp at 1 is 1e-3, and the inputs go through a few such roundings);
- attention: a query's output is the same whether it comes in the trainer's causal batch, a prefill chunk over a
  cached prefix (paged, blocks of 4 tokens scattered in the cache) or a decode step;
- end to end on a tiny MoE (fp32): the decoder in exact mode on the Triton backend, at 1 and 2 sequences a step with
  chunked prefill and a prefix-cache hit, gives each sequence the same tokens and raw log-probs, and the trainer's
  forward (GRPO's) over those sequences in batches of 1 and 2 gives log-probs equal to the decoder's.

On a GPU only (marked gpu, skipped here saying so): the same in bf16 at Qwen3-30B-A3B's shapes, and end to end on a
random MoE in bf16 with the decoder in CUDA graphs at batches 1, 7 and 64.
"""
import pytest
import torch
import torch.nn.functional as F

from livemoe import LLM, SamplingParams
from livemoe.engine.model.attention import causal_attention
from livemoe.engine.model.loader import load_model
from livemoe.kernels.batch_invariant import attention as bi_attention
from livemoe.kernels.batch_invariant import batch_invariant_mode
from livemoe.kernels.batch_invariant import experts as bi_experts
from livemoe.kernels.batch_invariant import linear as bi_linear
from livemoe.kernels.batch_invariant import ops as bi
from livemoe.kernels.logprobs import fused_linear_logprobs
from livemoe.kernels.moe.reference import experts_reference
from livemoe.kernels.norm import rms_norm_reference
from tiny_models import make_checkpoint

pytestmark = [pytest.mark.triton, pytest.mark.usefixtures("one_thread", "row_invariant_interpreter_dot")]

DTYPES = [torch.float32, torch.float16]


def _device() -> str:
    return "cuda" if torch.cuda.is_available() else "cpu"


def _tol(dtype):
    return dict(rtol=1e-5, atol=1e-5) if dtype == torch.float32 else dict(rtol=2e-2, atol=2e-2)


def _rows_invariant(fn):
    """fn(rows) over rows 0..6, row 0 alone and row 5 alone equals the same rows of fn over all 64, bit for bit."""
    full = fn(slice(0, 64))
    for rows in (slice(0, 7), slice(0, 1), slice(5, 6)):
        assert torch.equal(fn(rows), full[rows]), rows
    return full


@pytest.fixture
def triton_backend():
    with batch_invariant_mode(backend="triton"):
        yield


@pytest.mark.parametrize("dtype", DTYPES)
def test_row_ops_are_batch_invariant_and_match_their_formulas(dtype, triton_backend):
    g = torch.Generator().manual_seed(0)
    dev = _device()
    rnd = lambda *s: torch.randn(*s, generator=g).to(dtype).to(dev)  # noqa: E731
    x, w, b = rnd(64, 67), rnd(37, 67) * 0.2, rnd(37)
    out = _rows_invariant(lambda r: bi.linear_forward(x[r], w, b))
    torch.testing.assert_close(out.float(), x.float() @ w.float().T + b.float(), **_tol(dtype))
    nw = rnd(67).abs() + 0.5
    out = _rows_invariant(lambda r: bi.rms_norm_forward(x[r], nw, 1e-6))
    torch.testing.assert_close(out.float(), rms_norm_reference(x.float(), nw.float(), 1e-6), **_tol(dtype))
    u = rnd(64, 67)
    out = _rows_invariant(lambda r: bi.silu_mul_forward(x[r], u[r]))
    torch.testing.assert_close(out.float(), F.silu(x.float()) * u.float(), **_tol(dtype))
    logits = rnd(64, 2100).float() * 3  # more than one BLOCK_V chunk
    out = _rows_invariant(lambda r: bi.log_softmax(logits[r]))
    torch.testing.assert_close(out, logits.log_softmax(-1), rtol=1e-5, atol=1e-5)
    pos = torch.arange(64, device=dev) * 37
    inv = 1.0 / (10000.0 ** (torch.arange(0, 16, 2, device=dev).float() / 16))
    cos = _rows_invariant(lambda r: bi.rope_forward(pos[r], inv, dtype)[0])
    sin = bi.rope_forward(pos, inv, dtype)[1]
    f = pos[:, None].float() * inv
    torch.testing.assert_close(cos[:, 0].float(), torch.cat((f.cos(), f.cos()), -1).to(dtype).float(), **_tol(dtype))
    torch.testing.assert_close(sin[:, 0].float(), torch.cat((-f.sin(), f.sin()), -1).to(dtype).float(), **_tol(dtype))


@pytest.mark.parametrize("dtype", DTYPES)
def test_routing_and_experts_are_batch_invariant_and_match_their_formulas(dtype, triton_backend):
    g = torch.Generator().manual_seed(1)
    dev = _device()
    rnd = lambda *s: torch.randn(*s, generator=g).to(dtype).to(dev)  # noqa: E731
    router = (torch.randn(64, 6, generator=g) * 2).to(dev)
    router[3] = torch.tensor([0.0, 5.0, 1.0, 2.0, 5.0, 0.0])  # experts 1 and 4 tie: the lower id first
    weights = _rows_invariant(lambda r: bi.route(router[r], 3, True)[0])
    ids = bi.route(router, 3, True)[1]
    assert ids[3].tolist() == [1, 4, 3]
    probs = router.softmax(-1)
    others = torch.arange(64, device=dev) != 3
    assert torch.equal(ids[others], probs.topk(3, -1).indices[others])
    torch.testing.assert_close(weights, probs.gather(1, ids) / probs.gather(1, ids).sum(-1, keepdim=True),
                               rtol=1e-6, atol=1e-6)
    replayed_w, replayed_ids = bi.route(router, 3, False, ids.flip(-1))  # replay: the given experts, in order
    assert torch.equal(replayed_ids, ids.flip(-1))
    torch.testing.assert_close(replayed_w, probs.gather(1, ids.flip(-1)), rtol=1e-6, atol=1e-6)
    x, wgu, wd = rnd(64, 24), rnd(5, 2 * 12, 24) * 0.3, rnd(5, 24, 12) * 0.3
    w2, ids2 = bi.route((torch.randn(64, 5, generator=g)).to(dev), 2, True)
    out = _rows_invariant(lambda r: bi.experts_forward(x[r], wgu, wd, w2[r], ids2[r]))
    ref = experts_reference(x.float(), wgu.float(), wd.float(), w2, ids2)
    torch.testing.assert_close(out.float(), ref, **_tol(dtype))


@pytest.mark.parametrize("dtype", DTYPES)
def test_attention_is_the_same_in_training_prefill_chunks_and_decode(dtype, triton_backend):
    g = torch.Generator().manual_seed(2)
    dev = _device()
    rnd = lambda *s: torch.randn(*s, generator=g).to(dtype).to(dev)  # noqa: E731
    scale = 8 ** -0.5
    q, k, v = rnd(3, 37, 4, 8), rnd(3, 37, 2, 8), rnd(3, 37, 2, 8)  # 37 positions: two KV tiles and a part
    got = bi.causal_attention_forward(q, k, v, scale)
    torch.testing.assert_close(got.float(), causal_attention(q.float(), k.float(), v.float(), scale), **_tol(dtype))
    assert torch.equal(bi.causal_attention_forward(q[1:2], k[1:2], v[1:2], scale), got[1:2])  # batch 1
    assert torch.equal(bi.causal_attention_forward(q[1:2, :30], k[1:2, :30], v[1:2, :30], scale), got[1:2, :30])
    # sequence 1 in a paged cache of 4-token blocks, scattered: its first 25 tokens cached (a prefix hit), then a
    # prefill chunk of 11 beside another sequence's decode step, then one decode step
    cache_k, cache_v = torch.zeros(12, 4, 2, 8, dtype=dtype, device=dev), torch.zeros(12, 4, 2, 8, dtype=dtype,
                                                                                      device=dev)
    table = torch.tensor([[6, 2, 7, 0, 3, 11, 9, 1, 4, 10], [5, 8, 0, 0, 0, 0, 0, 0, 0, 0]], dtype=torch.int32,
                         device=dev)
    slots = torch.tensor([int(table[0, p // 4]) * 4 + p % 4 for p in range(37)], device=dev)
    cache_k.view(-1, 2, 8)[slots], cache_v.view(-1, 2, 8)[slots] = k[1], v[1]
    other = torch.tensor([int(table[1, p // 4]) * 4 + p % 4 for p in range(5)], device=dev)
    cache_k.view(-1, 2, 8)[other], cache_v.view(-1, 2, 8)[other] = k[0, :5], v[0, :5]
    ints = dict(dtype=torch.int32, device=dev)
    chunk = bi.paged_attention_forward(torch.cat((q[1, 25:36], q[0, 4:5])), cache_k, cache_v,
                                       torch.tensor([0, 11, 12], **ints), torch.tensor([36, 5], **ints), table, scale)
    assert torch.equal(chunk[:11], got[1, 25:36]) and torch.equal(chunk[11:], got[0, 4:5])
    step = bi.paged_attention_forward(torch.stack((q[1, 36], q[0, 4])), cache_k, cache_v, None,
                                      torch.tensor([37, 5], **ints), table, scale)
    assert torch.equal(step[0], got[1, 36]) and torch.equal(step[1], got[0, 4])


TEMPERATURE = 0.7


def _decode(model, prompts: list, batch: int, budget: int, max_tokens: int, enforce_eager: bool) -> list:
    """The decoder in exact mode on the Triton backend, up to `batch` sequences at once (1: one generate call per
    prompt, the prefix cache kept between them), `budget` tokens a step, KV blocks of 4 tokens: per prompt (token
    ids, raw log-probs)."""
    llm = LLM.from_model(model, None, batch_invariant=True, block_size=4, num_kv_blocks=2048, max_num_seqs=batch,
                         max_num_batched_tokens=budget, use_tqdm=False, enforce_eager=enforce_eager)
    params = [SamplingParams(max_tokens=max_tokens, temperature=TEMPERATURE, seed=i, logprobs=0, ignore_eos=True)
              for i in range(len(prompts))]
    with batch_invariant_mode(backend="triton"):
        if batch == 1:
            outs = [llm.generate([p], params[i])[0] for i, p in enumerate(prompts)]
        else:
            outs = llm.generate(prompts, params)
    assert llm.core.stats()["prefix_cache_hits"] > 0
    return [(o.prompt_token_ids + o.outputs[0].token_ids, torch.tensor(o.outputs[0].token_logprobs, dtype=torch.float32))
            for o in outs]


def _check_trainer(model, decoded: list, prompts: list, batch: int) -> None:
    """GRPO's trainer forward (forward_hidden + fused_linear_logprobs) in exact mode on the Triton backend over
    right-padded batches of `batch` decoded sequences: each completion's log-probs equal the decoder's, bit for bit."""
    device = model.lm_head_weight.device
    for s in range(0, len(decoded), batch):
        seqs = [d[0] for d in decoded[s:s + batch]]
        T = max(map(len, seqs))
        ids = torch.zeros(len(seqs), T, dtype=torch.long)
        mask = torch.zeros_like(ids)
        for i, x in enumerate(seqs):
            ids[i, :len(x)], mask[i, :len(x)] = torch.tensor(x), 1
        ids, mask = ids.to(device), mask.to(device)
        with batch_invariant_mode(backend="triton"), torch.no_grad():
            hidden = model.forward_hidden(ids, attention_mask=mask)
            lp = fused_linear_logprobs(hidden[:, :-1], model.lm_head_weight, ids[:, 1:], TEMPERATURE,
                                       mask=mask[:, 1:] > 0)
        for i, x in enumerate(seqs):
            n = len(prompts[s + i])
            assert torch.equal(lp[i, n - 1:len(x) - 1].cpu(), decoded[s + i][1]), (batch, s + i)


@pytest.mark.slow  # about 20 s in the interpreter
def test_decoder_and_trainer_agree_bitwise_on_the_triton_kernels(tmp_path, monkeypatch):
    """A tiny MoE end to end on the Triton backend (fp32: the interpreter's dtype for tl.dot)."""
    launches = []

    def counted(fn):
        return lambda *a, **k: launches.append(fn) or fn(*a, **k)

    for module, name in ((bi_attention, "bi_attention"), (bi_experts, "bi_moe"), (bi_linear, "bi_linear")):
        monkeypatch.setattr(module, name, counted(getattr(module, name)))
    path = make_checkpoint(tmp_path / "m", moe=True, num_hidden_layers=2, vocab_size=61, hidden_size=32,
                           num_attention_heads=4, num_key_value_heads=2, head_dim=8, intermediate_size=24,
                           num_experts=4, num_experts_per_tok=2, moe_intermediate_size=16)[0]
    model = load_model(path, dtype=torch.float32, device=_device())
    g = torch.Generator().manual_seed(0)
    prefix = torch.randint(3, 61, (8,), generator=g).tolist()
    prompts = [prefix + torch.randint(3, 61, (n,), generator=g).tolist() for n in (3, 9)]
    # one at a time, prefilled in chunks of 8 tokens, the second hitting the first's prefix
    alone = _decode(model, prompts, 1, 8, 2, enforce_eager=True)
    assert len(launches) > 0  # the Triton kernels ran (the engine's "auto" keeps the backend the test forced)
    together = _decode(model, prompts, 2, 64, 2, enforce_eager=True)  # prefilled in one step, decoded together
    assert [a[0] for a in alone] == [t[0] for t in together]
    assert all(torch.equal(a[1], t[1]) for a, t in zip(alone, together))
    for batch in (1, 2):
        _check_trainer(model, together, prompts, batch)


# -- on a GPU: bf16, the model's real shapes, CUDA graphs ------------------------------------------------


@pytest.mark.gpu
def test_bf16_ops_are_batch_invariant_at_qwen3_shapes():
    """Each exact kernel in bf16 at Qwen3-30B-A3B's shapes on the GPU (the interpreter cannot run bf16 tl.dot, nor
    the hardware's MMA): rows alone, in batches of 7, 64 and 4096 (rows deep in other tiles), bitwise equal; close to
    the fp32 formula (bf16: 3e-2 on O(1) values, its ulp at 1 is 8e-3 and a value goes through a few roundings)."""
    dev, dt = "cuda", torch.bfloat16
    g = torch.Generator(device=dev).manual_seed(0)
    rnd = lambda *s, scale=1.0: (torch.randn(*s, generator=g, device=dev) * scale).to(dt)  # noqa: E731
    tol = dict(rtol=3e-2, atol=3e-2)
    H, I, E, k, V = 2048, 768, 128, 8, 151936

    def invariant(fn, n=4096):
        full = fn(slice(0, n))
        for rows in (slice(0, 64), slice(0, 7), slice(0, 1), slice(5, 6), slice(4000, 4001)):
            assert torch.equal(fn(rows), full[rows]), rows
        return full

    x = rnd(4096, H)
    w = rnd(5120, H, scale=H ** -0.5)
    out = invariant(lambda r: bi.linear_forward(x[r], w))
    torch.testing.assert_close(out.float(), x.float() @ w.float().T, **tol)
    nw = rnd(H).abs() + 0.5
    out = invariant(lambda r: bi.rms_norm_forward(x[r], nw, 1e-6))
    torch.testing.assert_close(out.float(), rms_norm_reference(x.float(), nw.float(), 1e-6), **tol)
    logits = rnd(64, V).float() * 3
    out = invariant(lambda r: bi.log_softmax(logits[r]), 64)
    torch.testing.assert_close(out, logits.log_softmax(-1), rtol=1e-5, atol=1e-4)
    router = rnd(4096, E).float()
    weights, ids = bi.route(router, k, True)
    invariant(lambda r: bi.route(router[r], k, True)[0])
    wgu, wd = rnd(E, 2 * I, H, scale=H ** -0.5), rnd(E, H, I, scale=I ** -0.5)
    out = invariant(lambda r: bi.experts_forward(x[r], wgu, wd, weights[r], ids[r]))
    ref = experts_reference(x[:64].float(), wgu.float(), wd.float(), weights[:64], ids[:64])
    torch.testing.assert_close(out[:64].float(), ref, **tol)
    q, kk, v = rnd(2, 300, 32, 128), rnd(2, 300, 4, 128), rnd(2, 300, 4, 128)
    got = bi.causal_attention_forward(q, kk, v, 128 ** -0.5)
    torch.testing.assert_close(got.float(), causal_attention(q.float(), kk.float(), v.float(), 128 ** -0.5), **tol)
    assert torch.equal(bi.causal_attention_forward(q[1:], kk[1:], v[1:], 128 ** -0.5), got[1:])
    cache_k, cache_v = kk[1].reshape(15, 20, 4, 128).contiguous(), v[1].reshape(15, 20, 4, 128).contiguous()
    tables = torch.arange(15, dtype=torch.int32, device=dev)[None]  # 300 tokens in 15 blocks of 20
    ints = dict(dtype=torch.int32, device=dev)
    step = bi.paged_attention_forward(q[1, 299:], cache_k, cache_v, None, torch.tensor([300], **ints), tables,
                                      128 ** -0.5)
    assert torch.equal(step, got[1, 299:])
    chunk = bi.paged_attention_forward(q[1, 200:], cache_k, cache_v, torch.tensor([0, 100], **ints),
                                       torch.tensor([300], **ints), tables, 128 ** -0.5)
    assert torch.equal(chunk, got[1, 200:])


@pytest.mark.gpu
def test_decoder_in_cuda_graphs_and_trainer_agree_bitwise_in_bf16(tmp_path):
    """A random MoE in bf16 on the GPU: the decoder (CUDA graphs on) at 1, 7 and 64 sequences, with chunked prefill
    and prefix-cache hits, gives the same tokens and raw log-probs in every batch, equal to the trainer's forward in
    batches of 1, 7 and 64."""
    from test_exact_mode import _prompts

    path = make_checkpoint(tmp_path / "m", moe=True, num_hidden_layers=3)[0]
    model = load_model(path, dtype=torch.bfloat16, device="cuda")
    prompts = _prompts(model.config.vocab_size, 64)
    decoded = {batch: _decode(model, prompts[:n], batch, budget, 6, enforce_eager=False)
               for batch, n, budget in ((1, 5, 16), (7, 7, 4096), (64, 64, 64))}
    for batch in (1, 7):
        assert [d[0] for d in decoded[batch]] == [d[0] for d in decoded[64][:len(decoded[batch])]]
        assert all(torch.equal(a[1], b[1]) for a, b in zip(decoded[batch], decoded[64]))
    for batch in (1, 7, 64):
        _check_trainer(model, decoded[64], prompts, batch)


def test_operands_of_another_dtype_are_refused(triton_backend):
    x = torch.randn(3, 8, device=_device())
    with pytest.raises(ValueError, match=r"bi_linear: the operands must share a dtype, got x float32, w float16"):
        bi.linear_forward(x, torch.randn(4, 8, device=_device()).half())
    with pytest.raises(ValueError, match=r"bi_rms_norm: .* got x float32, weight float16"):
        bi.rms_norm_forward(x, torch.ones(8, device=_device()).half(), 1e-6)
