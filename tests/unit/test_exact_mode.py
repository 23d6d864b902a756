"""Issue 32, item 5: the exact on-policy mode (EngineConfig.batch_invariant, GRPO --exact_rollouts).

- Each batch-invariant op (csrc/batch_invariant.cpp) against its plain fp32 PyTorch formula (close: another
  reduction order, fp32 rounding, rtol 1e-5), and a row computed alone equal, bit for bit, to the same row inside
  batches of 7 and 64 (that is the op's whole point, so asserted with torch.equal).
- On the committed student and two random MoE checkpoints (GQA, attention bias, a dense layer, k=3 without
  renormalisation), fp32 and bf16: the decoder at batch sizes 1, 7 and 64, with chunked prefill and prefix-cache
  hits, gives each sequence the same tokens, log-probs and routed experts in every batch; and the trainer's
  forward (GRPO's: forward_hidden + fused_linear_logprobs) over those sequences in batches of 1, 7 and 64 gives
  log-probs equal to the decoder's (|dlogp| max 0.0) and routes every token alike (disagreement 0).
- With it, R3 changes no bit of the log-probs (nor of the gradients, where the rows the decoder never ran replay
  the trainer's own choice), and the rollout correction's weights are all exactly 1 (nothing cut or rejected).
- The trainer's gradients in the exact mode are the ordinary ones (close to the default kernels', rtol 1e-4), with
  and without gradient checkpointing (equal); 2 threads give the bits of 1.
- The options are validated where they are set.
"""
import importlib.util
import re

import pytest
import torch

from livemoe import LLM, SamplingParams
from livemoe.engine.decoder.config import EngineConfig
from livemoe.engine.errors import EngineConfigError
from livemoe.engine.model.loader import load_model
from livemoe.kernels import batch_invariant
from livemoe.kernels.batch_invariant import batch_invariant_mode
from livemoe.kernels.batch_invariant import ops as bi
from livemoe.kernels.logprobs import fused_linear_logprobs
from livemoe.kernels.moe import select_experts
from livemoe.kernels.norm import rms_norm_reference
from livemoe.train.config import ConfigError, parse_config
from livemoe.train.grpo.config import GRPOConfig
from livemoe.train.mismatch import RolloutCorrectionConfig, logprob_mismatch, rollout_correction, routing_disagreement
from tiny_models import make_checkpoint

pytestmark = [pytest.mark.usefixtures("one_thread"),
              pytest.mark.skipif(batch_invariant.unavailable_reason() is not None,
                                 reason=f"exact mode: {batch_invariant.unavailable_reason()}")]

STUDENT = "livemoe/train/assets/student"
TEMPERATURE = 0.7
MAX_TOKENS = 6


# -- the ops ----------------------------------------------------------------------------------------

def _rows_invariant(fn):
    """fn(rows) (a slice of 64 rows) over the first 7 rows, the first alone and the sixth alone equals the same rows
    of fn over all 64, bit for bit."""
    full = fn(slice(0, 64))
    for rows in (slice(0, 7), slice(0, 1), slice(5, 6)):
        assert torch.equal(fn(rows), full[rows])
    return full


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_each_op_matches_its_formula_and_is_batch_invariant(dtype):
    g = torch.Generator().manual_seed(0)
    rnd = lambda *s: torch.randn(*s, generator=g).to(dtype)  # noqa: E731
    tol = dict(rtol=1e-5, atol=1e-5) if dtype == torch.float32 else dict(rtol=2e-2, atol=2e-2)
    w, b = rnd(37, 67), rnd(37)
    x = rnd(64, 67)
    _rows_invariant(lambda r: bi.linear_forward(x[r], w, b))
    torch.testing.assert_close(bi.linear_forward(x, w, b).float(), x.float() @ w.float().T + b.float(), **tol)
    nw = rnd(67).abs() + 0.5
    _rows_invariant(lambda r: bi.rms_norm_forward(x[r], nw, 1e-6))
    torch.testing.assert_close(bi.rms_norm_forward(x, nw, 1e-6).float(), rms_norm_reference(x.float(), nw.float(), 1e-6),
                               **tol)
    u = rnd(64, 67)
    torch.testing.assert_close(bi.silu_mul_forward(x, u).float(), torch.nn.functional.silu(x.float()) * u.float(), **tol)
    logits = torch.randn(64, 131, generator=g) * 3
    _rows_invariant(lambda r: bi.log_softmax(logits[r]))
    torch.testing.assert_close(bi.log_softmax(logits), logits.log_softmax(-1), rtol=1e-5, atol=1e-5)
    router = torch.randn(64, 6, generator=g) * 2
    weights, ids = bi.route(router, 3, True)
    probs = router.softmax(-1)
    ref_w, ref_ids = probs.topk(3, -1)
    assert torch.equal(ids, ref_ids)
    torch.testing.assert_close(weights, ref_w / ref_w.sum(-1, keepdim=True), rtol=1e-6, atol=1e-6)
    replayed = bi.route(router, 3, False, ids.flip(-1))  # replay: the given experts, in the given order
    assert torch.equal(replayed[1], ids.flip(-1))
    torch.testing.assert_close(replayed[0], probs.gather(1, ids.flip(-1)), rtol=1e-6, atol=1e-6)
    pos = torch.arange(100)[None]
    inv = 1.0 / (10000.0 ** (torch.arange(0, 16, 2).float() / 16))
    cos, sin = bi.rope_forward(pos, inv, dtype)
    f = pos[..., None].float() * inv
    torch.testing.assert_close(cos[0, :, 0].float(), torch.cat((f.cos(), f.cos()), -1)[0].to(dtype).float(), **tol)
    torch.testing.assert_close(sin[0, :, 0].float(), torch.cat((-f.sin(), f.sin()), -1)[0].to(dtype).float(), **tol)


def test_ops_do_not_depend_on_the_thread_count():
    """Each output is computed by one thread from its own row: 2 threads give the bits of 1."""
    g = torch.Generator().manual_seed(2)
    x, w = torch.randn(64, 300, generator=g), torch.randn(333, 300, generator=g)
    q, k, v = (torch.randn(2, 40, 4, 16, generator=g) for _ in range(3))

    def run():
        return (bi.linear_forward(x, w), bi.rms_norm_forward(x, w[0], 1e-6), bi.log_softmax(x),
                bi.causal_attention_forward(q, k, v, 0.25))

    one = run()
    torch.set_num_threads(2)
    try:
        two = run()
    finally:
        torch.set_num_threads(1)
    assert all(torch.equal(a, b) for a, b in zip(one, two))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_moe_and_attention_match_their_formulas(dtype):
    from livemoe.engine.model.attention import causal_attention
    from livemoe.kernels.moe.reference import experts_reference

    g = torch.Generator().manual_seed(1)
    rnd = lambda *s: torch.randn(*s, generator=g).to(dtype)  # noqa: E731
    tol = dict(rtol=1e-5, atol=1e-5) if dtype == torch.float32 else dict(rtol=3e-2, atol=3e-2)
    x, wgu, wd = rnd(64, 24), rnd(5, 2 * 12, 24) * 0.3, rnd(5, 24, 12) * 0.3
    weights, ids = bi.route(torch.randn(64, 5, generator=g), 2, True)
    out = _rows_invariant(lambda r: bi.experts_forward(x[r], wgu, wd, weights[r], ids[r]))
    ref = experts_reference(x.float(), wgu.float(), wd.float(), weights, ids)
    torch.testing.assert_close(out.float(), ref, **tol)
    q, k, v = rnd(3, 19, 4, 8), rnd(3, 19, 2, 8), rnd(3, 19, 2, 8)
    got = bi.causal_attention_forward(q, k, v, 8 ** -0.5)
    torch.testing.assert_close(got.float(), causal_attention(q.float(), k.float(), v.float(), 8 ** -0.5), **tol)
    # one sequence alone, and its first 11 tokens then 8 more as a chunk over the first ones in a paged cache
    assert torch.equal(bi.causal_attention_forward(q[1:2], k[1:2], v[1:2], 8 ** -0.5), got[1:2])
    cache_k, cache_v = torch.zeros(8, 4, 2, 8, dtype=dtype), torch.zeros(8, 4, 2, 8, dtype=dtype)
    table = torch.tensor([[6, 2, 7, 0, 3]], dtype=torch.int32)
    slots = torch.tensor([int(table[0, p // 4]) * 4 + p % 4 for p in range(19)])
    cache_k.view(-1, 2, 8)[slots], cache_v.view(-1, 2, 8)[slots] = k[1], v[1]
    chunk = bi.paged_attention_forward(q[1, 11:], cache_k, cache_v, torch.tensor([0, 8], dtype=torch.int32),
                                       torch.tensor([19], dtype=torch.int32), table, 8 ** -0.5)
    assert torch.equal(chunk, got[1, 11:])
    step = bi.paged_attention_forward(q[1, 18:], cache_k, cache_v, None, torch.tensor([19], dtype=torch.int32),
                                      table, 8 ** -0.5)
    assert torch.equal(step, got[1, 18:])


# -- decoder against trainer -------------------------------------------------------------------------

def _random_a(tmp_path_factory):
    return make_checkpoint(tmp_path_factory.mktemp("exact_a") / "m", moe=True, num_hidden_layers=3)[0]


def _random_b(tmp_path_factory):
    return make_checkpoint(tmp_path_factory.mktemp("exact_b") / "m", moe=True, seed=5, vocab_size=97, hidden_size=48,
                           num_attention_heads=6, num_key_value_heads=2, head_dim=8, intermediate_size=40,
                           num_experts=6, num_experts_per_tok=3, moe_intermediate_size=24, norm_topk_prob=False,
                           mlp_only_layers=[1], attention_bias=True)[0]


CHECKPOINTS = {"student": lambda _: STUDENT, "random_a": _random_a, "random_b": _random_b}


@pytest.fixture(scope="module", params=sorted(CHECKPOINTS))
def checkpoint(request, tmp_path_factory):
    return CHECKPOINTS[request.param](tmp_path_factory)


def _prompts(vocab: int, n: int) -> list[list[int]]:
    """n prompts of 5..40 tokens; groups of four share a 12-token prefix (prefix-cache hits at block size 4)."""
    g = torch.Generator().manual_seed(vocab)
    out = []
    for i in range(n):
        prefix = torch.randint(3, vocab, (12,), generator=torch.Generator().manual_seed(1000 + i // 4)).tolist()
        length = 5 + (i * 7) % 36
        tail = torch.randint(3, vocab, (max(0, length - 12),), generator=g).tolist()
        out.append((prefix + tail)[:length])
    return out


def _decode(model, prompts: list, batch: int, budget: int) -> list:
    """The decoder in exact mode with up to `batch` sequences at once (batch 1: one generate call per prompt, the
    prefix cache kept between them), `budget` tokens a step (prefill chunked beyond it), KV blocks of 4 tokens.
    Returns per prompt (token ids, raw log-probs fp32, routed experts [tokens - 1, L, k]); checks that the prefix
    cache was hit and, when the budget holds every prompt, that the decode steps had `batch` sequences."""
    llm = LLM.from_model(model, None, batch_invariant=True, block_size=4, num_kv_blocks=1024, max_num_seqs=batch,
                         max_num_batched_tokens=budget, use_tqdm=False)
    runner, steps = llm.core.runner, []
    execute = runner.execute
    runner.execute = lambda plan: steps.append((plan.is_decode, plan.num_seqs)) or execute(plan)
    params = [SamplingParams(max_tokens=MAX_TOKENS, temperature=TEMPERATURE, seed=i, logprobs=0, ignore_eos=True,
                             return_routed_experts=True) for i in range(len(prompts))]
    if batch == 1:
        outs = [llm.generate([p], params[i])[0] for i, p in enumerate(prompts)]
    else:
        outs = llm.generate(prompts, params)
    assert llm.core.stats()["prefix_cache_hits"] > 0
    if budget >= sum(map(len, prompts)):  # every prompt prefilled in the first step: then `batch` decode together
        assert max(n for decode, n in steps if decode) == batch
    result = []
    for o in outs:
        c = o.outputs[0]
        result.append((o.prompt_token_ids + c.token_ids, torch.tensor(c.token_logprobs, dtype=torch.float32),
                       torch.from_numpy(c.routed_experts).long()))
    return result, sum(not decode for decode, _ in steps)


def _trainer(model, seqs: list, prompt_lens: list, batch: int, routed=None):
    """GRPO's trainer forward (livemoe.train.grpo.trainer._logprobs) in exact mode over right-padded batches of
    `batch` sequences: per sequence its completion's log-probs [G] and its routing [T, L, k] (T: the padded batch's
    width). routed: per sequence the experts to replay (R3), [up to T, L, k]; the rows after them run 0..k-1."""
    lps, routes = [], []
    k = model.config.num_experts_per_tok
    for s in range(0, len(seqs), batch):
        chunk, lens = seqs[s:s + batch], prompt_lens[s:s + batch]
        T = max(len(x) for x in chunk)
        ids = torch.zeros(len(chunk), T, dtype=torch.long)
        mask = torch.zeros(len(chunk), T, dtype=torch.long)
        for i, x in enumerate(chunk):
            ids[i, :len(x)], mask[i, :len(x)] = torch.tensor(x), 1
        replay = None
        if routed is not None:
            # rows the decoder never routed (the last token, padding): experts 0..k-1, as GRPO's collate gives them
            replay = torch.arange(k).expand(len(chunk), T, model.num_moe_layers, k).clone()
            for i, r in enumerate(routed[s:s + batch]):
                replay[i, :len(r)] = r
        with batch_invariant_mode():
            hidden, router_logits = model.forward_hidden(ids, attention_mask=mask, return_router_logits=True,
                                                         routed_experts=replay)
            lp = fused_linear_logprobs(hidden[:, :-1], model.lm_head_weight, ids[:, 1:], TEMPERATURE,
                                       mask=mask[:, 1:] > 0)
            mine = torch.stack([select_experts(x, k) for x in router_logits], dim=1).view(len(chunk), T, -1, k)
        for i, x in enumerate(chunk):
            lps.append(lp[i, lens[i] - 1:len(x) - 1])
            routes.append(mine[i])  # padding rows too
    return lps, routes


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_decoder_and_trainer_agree_bitwise_at_any_batch(checkpoint, dtype):
    model = load_model(checkpoint, dtype=dtype)
    prompts = _prompts(model.config.vocab_size, 64)
    # batch, prompts, tokens per step: 16 chunks the longer prompts (5..40 tokens) at batch 1; 4096 prefills all
    # at once, then decodes 7 or 64 sequences a step; 64 mixes prefill chunks with decodes at batch 64
    runs = {"1": (1, 5, 16), "7": (7, 7, 4096), "64": (64, 64, 4096), "64 chunked": (64, 64, 64)}
    decoded, prefill_steps = {}, {}
    for name, (batch, n, budget) in runs.items():
        decoded[name], prefill_steps[name] = _decode(model, prompts[:n], batch, budget)
    assert prefill_steps["1"] > 5 and prefill_steps["64"] == 1 and prefill_steps["64 chunked"] > 1
    # the decoder: the same tokens, log-probs and experts for a sequence whatever the batch it ran in
    for name in ("1", "7", "64 chunked"):
        for mine, big in zip(decoded[name], decoded["64"]):
            assert mine[0] == big[0]
            assert torch.equal(mine[1], big[1]) and torch.equal(mine[2], big[2])
    seqs = [d[0] for d in decoded["64"]]
    prompt_lens = [len(p) for p in prompts]
    rollout_lp = [d[1] for d in decoded["64"]]
    for batch in (1, 7, 64):
        lps, routes = _trainer(model, seqs, prompt_lens, batch)
        for lp, theirs in zip(lps, rollout_lp):
            m = logprob_mismatch(lp[None], theirs[None], torch.ones(1, len(lp)))
            assert float(m["abs_diff_max"]) == 0.0 and torch.equal(lp, theirs)
        mine = torch.cat([r[:len(x) - 1] for r, x in zip(routes, seqs)])  # the last token: never run by the decoder
        theirs = torch.cat([d[2] for d in decoded["64"]])
        differ, per_layer, tokens = routing_disagreement(mine, theirs, torch.ones(len(mine)))
        assert float(differ) == 0.0 and float(per_layer.sum()) == 0.0 and float(tokens) == len(mine)
        assert torch.equal(mine, theirs)


def test_r3_and_rollout_correction_change_nothing_in_exact_mode(tmp_path_factory):
    model = load_model(_random_b(tmp_path_factory), dtype=torch.float32)
    prompts = _prompts(model.config.vocab_size, 7)
    decoded = _decode(model, prompts, 7, 16)[0]
    seqs, lens = [d[0] for d in decoded], [len(p) for p in prompts]
    routed = [d[2] for d in decoded]

    def loss_and_grads(replay):
        model.zero_grad(set_to_none=True)
        lps, routes = _trainer(model, seqs, lens, 7, replay)
        loss = sum(lp.sum() for lp in lps)
        loss.backward()
        return lps, {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}, routes

    plain_lps, plain_grads, own = loss_and_grads(None)
    # R3 as GRPO runs it (the last token, which the decoder never ran, replays experts 0..k-1): the same log-probs
    r3_lps = loss_and_grads(routed)[0]
    assert all(torch.equal(a, b) for a, b in zip(plain_lps, r3_lps))
    # and where the rows the decoder never ran (the last token, padding: their outputs feed no log-prob) replay
    # what the trainer picks, the same gradients
    r3_lps, r3_grads, _ = loss_and_grads([torch.cat([r, mine[len(r):]]) for r, mine in zip(routed, own)])
    assert all(torch.equal(a, b) for a, b in zip(plain_lps, r3_lps))
    assert plain_grads.keys() == r3_grads.keys() and any("mlp.gate" in n for n in plain_grads)
    assert all(torch.equal(plain_grads[n], r3_grads[n]) for n in plain_grads)
    width = max(len(x) for x in plain_lps)
    trainer_lp = torch.zeros(len(seqs), width)
    rollout_lp = torch.zeros(len(seqs), width)
    mask = torch.zeros(len(seqs), width)
    for i, (lp, d) in enumerate(zip(plain_lps, decoded)):
        trainer_lp[i, :len(lp)], rollout_lp[i, :len(lp)], mask[i, :len(lp)] = lp.detach(), d[1], 1
    for level in ("token", "sequence"):
        cfg = RolloutCorrectionConfig(level=level, rs_bound=1.0001)
        weights, sums = rollout_correction(trainer_lp, rollout_lp, mask, cfg)
        assert torch.equal(weights, mask)
        assert float(sums["is_cut"]) == 0 and float(sums["rs_rejected"]) == 0
        assert float(sums["is_weight_max"]) == 1.0


def test_exact_mode_gradients_are_the_ordinary_ones(tmp_path_factory):
    model = load_model(_random_b(tmp_path_factory), dtype=torch.float32)
    g = torch.Generator().manual_seed(3)
    ids = torch.randint(3, model.config.vocab_size, (3, 21), generator=g)
    mask = torch.ones_like(ids)
    mask[1, 15:] = 0
    grads = []
    for exact in (True, False):
        model.zero_grad(set_to_none=True)
        with batch_invariant_mode(exact):
            hidden, logits = model.forward_hidden(ids, attention_mask=mask, return_router_logits=True)
            lp = fused_linear_logprobs(hidden[:, :-1], model.lm_head_weight, ids[:, 1:], TEMPERATURE,
                                       mask=mask[:, 1:] > 0)
            aux = model.load_balancing_loss(logits, mask)
        (lp.sum() + aux).backward()
        grads.append({n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None})
    assert grads[0].keys() == grads[1].keys() and len(grads[0]) == len(list(model.parameters()))
    for n in grads[0]:
        torch.testing.assert_close(grads[0][n], grads[1][n], rtol=1e-4, atol=1e-5, msg=n)


def test_options_are_validated_where_they_are_set(tmp_path_factory):
    with pytest.raises(EngineConfigError, match="batch_invariant must be a bool"):
        EngineConfig(batch_invariant="yes")
    with pytest.raises(EngineConfigError, match="batch_invariant runs in one process"):
        EngineConfig(batch_invariant=True, tensor_parallel_size=2)
    with pytest.raises(EngineConfigError, match="attention_backend='reference' would not be used"):
        EngineConfig(batch_invariant=True, attention_backend="reference")
    has_triton = importlib.util.find_spec("triton") is not None  # CUDA: the Triton kernels
    assert (batch_invariant.unavailable_reason("cuda") is None) == has_triton
    assert "not on meta" in batch_invariant.unavailable_reason("meta")
    path = _random_a(tmp_path_factory)
    for extra, message in ((["--rollout_url", "http://127.0.0.1:9"], "--exact_rollouts needs the in-process decoder"),
                           (["--rollout_dtype", "bfloat16"], "--exact_rollouts: the decoder runs the trainer's module")):
        with pytest.raises(ConfigError, match=re.escape(message)):
            parse_config(GRPOConfig, ["--model", path, "--exact_rollouts", "true", *extra])
    assert parse_config(GRPOConfig, ["--model", path, "--exact_rollouts", "true"]).exact_rollouts
    with pytest.raises(ValueError, match="right-padded batches only"):
        model = load_model(path, dtype=torch.float32)
        with batch_invariant_mode(), torch.no_grad():
            model.forward_hidden(torch.ones(1, 4, dtype=torch.long), attention_mask=torch.tensor([[0, 1, 1, 1]]))


def test_gradient_checkpointing_recomputes_in_exact_mode():
    """A checkpointed layer's recompute runs in the backward, outside the caller's batch_invariant_mode: it takes
    the kernels its forward took (else torch's checkpoint finds other saved tensors and fails), and the gradients
    are those without checkpointing."""
    model = load_model(STUDENT, dtype=torch.float32)
    model.train()
    ids = torch.randint(3, model.config.vocab_size, (2, 9), generator=torch.Generator().manual_seed(4))
    grads = []
    for checkpointing in (False, True):
        model.gradient_checkpointing = checkpointing
        model.zero_grad(set_to_none=True)
        with batch_invariant_mode():
            hidden = model.forward_hidden(ids)
        hidden.square().mean().backward()
        grads.append({n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None})
    assert grads[0].keys() == grads[1].keys() and len(grads[0]) == len(list(model.parameters())) - 1  # no lm_head
    assert all(torch.equal(grads[0][n], grads[1][n]) for n in grads[0])
