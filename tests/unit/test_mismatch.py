"""Issue 32: the rollout-trainer mismatch metrics, the decoder's routed experts, routing replay (R3) and the
rollout correction (TIS / RS).

- The decoder's routed experts (SamplingParams.return_routed_experts) equal the trainer's own routing of the same
  tokens in fp32 (exactly: the same top-k of near-equal logits of a spread router), through prefix-cache hits and
  chunked prefill; uint8 / int16 ids; refused on a dense model.
- A bf16 decoder against an fp32 trainer shows non-zero |dlogp|, k3 KL and routing disagreement (so the metrics
  can fail); with R3 every MoE layer of the trainer runs the decoder's experts for every token.
- R3's gate weights are the softmax of the trainer's router logits over the replayed experts, renormalised as
  norm_topk_prob says (checked by hand, rtol 1e-6), and the router gets gradients; the load-balancing loss counts
  the replayed experts.
- TIS / RS weights against a hand computation (exact, fp32).
"""
import math
import re

import numpy as np
import pytest
import torch

from livemoe import LLM, SamplingParams
from livemoe.engine import routed_experts
from livemoe.engine.errors import RequestError
from livemoe.engine.model.loader import load_model
from livemoe.engine.model.moe_loss import load_balancing_loss
from livemoe.kernels import moe as moe_ops
from livemoe.kernels.moe import fused_moe, route, select_experts
from livemoe.kernels.moe.reference import experts_reference
from livemoe.train.config import ConfigError, parse_config
from livemoe.train.grpo.config import GRPOConfig
from livemoe.train.mismatch import (RolloutCorrectionConfig, logprob_mismatch, rollout_correction,
                                    routing_disagreement)
from tiny_models import make_checkpoint

pytestmark = pytest.mark.usefixtures("one_thread")

PROMPTS = [[5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15, 16, 17, 18, 19, 20, 21, 22],
           [5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15, 16, 17, 18, 19, 20, 23],  # a prefix-cache hit on the first block
           [30, 31, 32], [40, 41, 42, 43, 44, 45, 46, 47, 48, 49]]


@pytest.fixture(scope="module")
def moe_path(tmp_path_factory):
    return make_checkpoint(tmp_path_factory.mktemp("moe") / "m", moe=True, num_hidden_layers=4)[0]


def trainer_routing(model, ids: list[int]) -> torch.Tensor:
    """The trainer's own routing of a sequence: [tokens, MoE layers, k]."""
    with torch.no_grad():
        _, logits = model.forward_hidden(torch.tensor([ids]), return_router_logits=True)
    return torch.stack([select_experts(x, model.config.num_experts_per_tok) for x in logits], dim=1)


def sampled(llm, n=1, **kw):
    p = SamplingParams(max_tokens=12, temperature=1.0, seed=3, n=n, logprobs=0, return_routed_experts=True,
                       ignore_eos=True, **kw)
    return llm.generate(PROMPTS, p)


def test_routed_experts_equal_the_trainers_routing_with_prefix_hits_and_chunked_prefill(moe_path):
    model = load_model(moe_path, dtype=torch.float32)
    # block 4 and an 8-token budget: the prompts are prefilled in chunks, the second hits the first's blocks
    llm = LLM.from_model(model, None, num_kv_blocks=64, block_size=4, max_num_batched_tokens=8, use_tqdm=False)
    outs = sampled(llm, n=2)
    assert llm.core.stats()["prefix_cache_hits"] > 0
    for o in outs:
        for c in o.outputs:
            ids = o.prompt_token_ids + c.token_ids
            r = c.routed_experts
            assert r.dtype == np.uint8 and r.shape == (len(ids) - 1, 4, 2)
            mine = trainer_routing(model, ids)[:-1]
            assert torch.equal(torch.from_numpy(r).long().sort(-1).values, mine.sort(-1).values)
    plain = llm.generate(PROMPTS, SamplingParams(max_tokens=4))
    assert all(c.routed_experts is None for o in plain for c in o.outputs)  # only when asked


def test_routed_experts_refused_on_a_dense_model_and_compact_types(tmp_path):
    path, _ = make_checkpoint(tmp_path / "dense", moe=False)
    llm = LLM.from_model(load_model(path, dtype=torch.float32), None, num_kv_blocks=16, use_tqdm=False)
    with pytest.raises(RequestError, match="return_routed_experts: the model is dense"):
        llm.generate([[1, 2, 3]], SamplingParams(max_tokens=2, return_routed_experts=True))
    with pytest.raises(RequestError, match="return_routed_experts must be a bool"):
        SamplingParams(return_routed_experts=1)
    assert routed_experts.routed_dtype(256) == torch.uint8 and routed_experts.routed_dtype(257) == torch.int16
    ids = np.arange(2 * 3 * 4, dtype=np.int16).reshape(2, 3, 4) * 100
    obj = routed_experts.encode(ids)
    assert obj["shape"] == [2, 3, 4] and obj["dtype"] == "int16"
    back = routed_experts.decode(obj)
    assert back.dtype == np.int16 and np.array_equal(back, ids)
    with pytest.raises(RequestError, match="bytes do not hold"):
        routed_experts.decode({**obj, "shape": [2, 3, 5]})


def test_bf16_decoder_against_fp32_trainer_disagrees_and_r3_replays_the_decoders_experts(moe_path, monkeypatch):
    trainer = load_model(moe_path, dtype=torch.float32)
    decoder = load_model(moe_path, dtype=torch.bfloat16)
    llm = LLM.from_model(decoder, None, num_kv_blocks=128, use_tqdm=False)
    outs = llm.generate(PROMPTS * 4, [SamplingParams(max_tokens=24, temperature=1.0, seed=i, logprobs=0,
                                                     return_routed_experts=True, ignore_eos=True)
                                      for i in range(len(PROMPTS) * 4)])
    differ = tokens = 0
    sums = None
    used = []
    real_route = moe_ops.route

    def recording_route(logits, top_k, renormalize, topk_ids=None):
        w, ids = real_route(logits, top_k, renormalize, topk_ids)
        used.append(ids)
        return w, ids

    for o in outs:
        c = o.outputs[0]
        ids = o.prompt_token_ids + c.token_ids
        theirs = torch.from_numpy(c.routed_experts).long()
        mine = trainer_routing(trainer, ids)[:-1]
        d, _, n = routing_disagreement(mine, theirs, torch.ones(len(mine)))
        differ, tokens = differ + d, tokens + n
        with torch.no_grad():
            logits = trainer(torch.tensor([ids])).float()
        p = len(o.prompt_token_ids)
        lp = torch.log_softmax(logits[0, p - 1:-1], -1).gather(1, torch.tensor(c.token_ids)[:, None])[:, 0]
        s = logprob_mismatch(lp[None], torch.tensor([c.token_logprobs]), torch.ones(1, len(lp)))
        sums = s if sums is None else {k: sums[k] + v if k != "abs_diff_max" else torch.maximum(sums[k], v)
                                       for k, v in s.items()}
        # R3: the trainer's forward runs exactly the decoder's experts in every MoE layer
        replay = torch.cat([theirs, torch.arange(2).expand(1, 4, 2)])[None]  # the last token has no routing
        used.clear()
        monkeypatch.setattr(moe_ops, "route", recording_route)
        with torch.no_grad():
            trainer.forward_hidden(torch.tensor([ids]), routed_experts=replay)
        monkeypatch.setattr(moe_ops, "route", real_route)
        assert len(used) == 4
        for layer, got in enumerate(used):
            assert torch.equal(got[:-1], theirs[:, layer])
    assert differ > 0, "a bf16 decoder and an fp32 trainer routed every token alike: the metric cannot fail"
    assert sums["abs_diff_max"] > 1e-3 and sums["k3_sum"] > 0
    assert tokens > 300


def test_replayed_gate_weights_by_hand_and_the_router_gets_gradients():
    g = torch.Generator().manual_seed(0)
    T, H, E, I, k = 6, 16, 8, 8, 2
    x = torch.randn(T, H, generator=g)
    logits = torch.randn(T, E, generator=g, requires_grad=True)
    w_gu, w_d = torch.randn(E, 2 * I, H, generator=g) * 0.3, torch.randn(E, H, I, generator=g) * 0.3
    ids = torch.stack([torch.randperm(E, generator=g)[:k] for _ in range(T)])
    for renorm in (True, False):
        w, got = route(logits, k, renorm, ids)
        probs = torch.softmax(logits.detach(), -1)
        want = torch.stack([probs[t, ids[t]] for t in range(T)])
        want = want / want.sum(-1, keepdim=True) if renorm else want
        assert torch.equal(got, ids)
        torch.testing.assert_close(w.detach(), want, rtol=1e-6, atol=0)
    out = fused_moe(x, w_gu, w_d, logits, k, True, topk_ids=ids)
    w, _ = route(logits.detach(), k, True, ids)
    torch.testing.assert_close(out.detach(), experts_reference(x, w_gu, w_d, w, ids), rtol=1e-5, atol=1e-6)
    out.sum().backward()
    assert logits.grad.abs().sum() > 0
    with pytest.raises(ValueError, match=r"replayed topk_ids must be expert ids in \[0, 8\)"):
        route(logits, k, True, ids + 7)
    with pytest.raises(ValueError, match=r"replayed topk_ids must be \[T=6, k=2\]"):
        route(logits, k, True, ids[:, :1])


def test_load_balancing_loss_counts_the_replayed_experts():
    g = torch.Generator().manual_seed(1)
    logits = [torch.randn(10, 4, generator=g) for _ in range(2)]
    chosen = [torch.tensor([[0, 1]] * 10) for _ in range(2)]
    got = load_balancing_loss(logits, 4, 2, selected=chosen)
    probs = torch.cat([torch.softmax(x, -1) for x in logits]).mean(0)
    counts = torch.tensor([1.0, 1.0, 0.0, 0.0])  # every token on experts 0 and 1, in both layers
    torch.testing.assert_close(got, 4 * (counts * probs).sum(), rtol=1e-6, atol=0)
    assert not torch.allclose(got, load_balancing_loss(logits, 4, 2))


def test_rollout_correction_weights_by_hand():
    trainer = torch.tensor([[-1.0, -2.0, -0.5, 0.0], [-1.0, -1.0, -1.0, -1.0]])
    rollout = torch.tensor([[-1.5, -1.0, -0.5, 0.0], [-1.2, -0.9, -1.0, -3.0]])
    mask = torch.tensor([[1.0, 1.0, 1.0, 0.0], [1.0, 1.0, 1.0, 1.0]])
    d = (trainer - rollout) * mask
    tok = torch.exp(d)  # e^0.5, e^-1, 1, (1) / e^0.2, e^-0.1, 1, e^2
    cfg = RolloutCorrectionConfig(level="token", threshold=2.0, mode="truncate")
    w, s = rollout_correction(trainer, rollout, mask, cfg)
    assert torch.equal(w, tok.clamp(max=2.0) * mask)
    assert float(s["is_cut"]) == 1 and float(s["is_weight_max"]) == pytest.approx(math.exp(2.0))
    w, s = rollout_correction(trainer, rollout, mask, RolloutCorrectionConfig(level="token", mode="mask"))
    assert w[1, 3] == 0 and w[0, 0] == pytest.approx(math.exp(0.5))  # e^0.5 = 1.65 < 2 stays
    seq = torch.exp(d.sum(-1))  # e^-0.5, e^2.1
    w, s = rollout_correction(trainer, rollout, mask, RolloutCorrectionConfig(level="sequence", threshold=3.0,
                                                                             mode="mask"))
    assert torch.allclose(w[0], seq[0] * mask[0]) and (w[1] == 0).all() and float(s["is_cut"]) == 4
    # RS: the geometric means are e^(-0.5/3) and e^(2.1/4); bound 1.5 (log 0.405) rejects the second
    w, s = rollout_correction(trainer, rollout, mask, RolloutCorrectionConfig(level="none", rs_bound=1.5))
    assert torch.equal(w, torch.stack([mask[0], torch.zeros(4)])) and float(s["rs_rejected"]) == 1
    m = logprob_mismatch(trainer, rollout, mask)
    assert float(m["abs_diff_max"]) == pytest.approx(2.0) and float(m["tokens"]) == 7
    assert float(m["k3_sum"]) == pytest.approx(float(((tok - d - 1) * mask).sum()), rel=1e-6)
    ppl = math.exp(0.5 / 3) + math.exp(-2.1 / 4)
    assert float(m["ppl_ratio_sum"]) == pytest.approx(ppl, rel=1e-6)


@pytest.mark.parametrize("extra, message", [
    (["--old_logprobs", "decoder"], "--rollout_is / --rollout_rs weigh the trainer's old log-probs"),
    (["--rollout_is", "tokens"], "--rollout_is must be one of token, sequence, none"),
    (["--rollout_is_threshold", "1"], "--rollout_is_threshold must be a finite number > 1"),
    (["--rollout_is_mode", "clip"], "--rollout_is_mode must be one of truncate, mask"),
    (["--rollout_rs", "0.5"], "--rollout_rs must be 0 (off) or a finite number > 1"),
    (["--routing_replay", "R2"], "--routing_replay must be one of none, R3"),
    (["--rollout_dtype", "fp8"], "--rollout_dtype must be one of auto, bfloat16, float32"),
    (["--rollout_url", "http://127.0.0.1:9", "--rollout_dtype", "bfloat16"], "--rollout_dtype with --rollout_url"),
])
def test_bad_options_are_refused_naming_the_flag(moe_path, extra, message):
    with pytest.raises(ConfigError, match=re.escape(message)):
        parse_config(GRPOConfig, ["--model", moe_path, *extra])


def test_defaults_and_decoder_old_logprobs_without_correction(moe_path):
    cfg = parse_config(GRPOConfig, ["--model", moe_path])
    rc = cfg.rollout_correction
    assert (cfg.old_logprobs, cfg.routing_replay, rc.level, rc.mode, rc.threshold, rc.rs_bound) == \
        ("trainer", "none", "token", "truncate", 2.0, 0.0)
    cfg = parse_config(GRPOConfig, ["--model", moe_path, "--old_logprobs", "decoder", "--rollout_is", "none"])
    assert not cfg.rollout_correction.enabled


def test_the_decode_graph_path_stores_the_routing_of_its_real_rows(moe_path):
    """The CUDA-graph decode path's routing logic on the CPU: the graph's forward (ModelRunner._graph_forward, what a
    graph holds) run in place of a replay over padded static buffers; the routed experts it stores for the real
    rows equal the eager engine's (the padding rows, slot -1, store nothing)."""
    model = load_model(moe_path, dtype=torch.float32)
    eager = LLM.from_model(model, None, num_kv_blocks=64, use_tqdm=False)
    want = sampled(eager)
    eager.close()
    llm = LLM.from_model(model, None, num_kv_blocks=64, use_tqdm=False)
    runner = llm.core.runner

    class Replay:  # what a captured graph does when replayed
        def __init__(self, b):
            self.b = b

        def replay(self):
            runner._graph_forward(self.b)

    def capture():
        runner.graph_vars = runner._graph_buffers(8)
        runner.graphs.update({b: Replay(b) for b in (1, 2, 4, 8)})

    runner.use_cuda_graphs = True
    runner.capture_cuda_graphs = capture
    got = sampled(llm)
    assert runner.num_graph_replays > 0 and "routed" in runner.graph_vars
    for a, b in zip(got, want):
        assert a.outputs[0].token_ids == b.outputs[0].token_ids
        assert np.array_equal(a.outputs[0].routed_experts, b.outputs[0].routed_experts)


def test_the_model_refuses_replayed_routing_that_does_not_fit(moe_path, tmp_path):
    model = load_model(moe_path, dtype=torch.float32)
    ids = torch.tensor([[5, 6, 7]])
    good = torch.zeros(1, 3, 4, 2, dtype=torch.uint8)
    good[..., 1] = 1
    with pytest.raises(ValueError, match=r"routed_experts must be \[B, T, MoE layers, k\] = \[1, 3, 4, 2\]"):
        model.forward_hidden(ids, routed_experts=good[:, :, :3])
    with pytest.raises(ValueError, match=r"replayed topk_ids must be expert ids in \[0, 8\)"):
        model.forward_hidden(ids, routed_experts=good + 8)
    dense = load_model(make_checkpoint(tmp_path / "dense", moe=False)[0], dtype=torch.float32)
    with pytest.raises(ValueError, match="routing replay: the model is dense"):
        dense.forward_hidden(ids, routed_experts=good)


@pytest.mark.triton  # the Triton grouped GEMMs (TRITON_INTERPRET=1 on the CPU, set by conftest; fp32)
@pytest.mark.parametrize("backend", ["triton", "sorted"])
def test_replay_through_each_moe_backend_matches_the_reference(backend):
    g = torch.Generator().manual_seed(2)
    T, H, E, I, k = 9, 16, 8, 16, 2
    x = torch.randn(T, H, generator=g)
    logits = torch.randn(T, E, generator=g)
    w_gu, w_d = torch.randn(E, 2 * I, H, generator=g) * 0.3, torch.randn(E, H, I, generator=g) * 0.3
    ids = torch.stack([torch.randperm(E, generator=g)[:k] for _ in range(T)])
    assert not torch.equal(ids.sort(-1).values, select_experts(logits, k).sort(-1).values)  # replay changes routing
    w, _ = route(logits, k, True, ids)
    want = experts_reference(x, w_gu, w_d, w, ids)
    with torch.no_grad():  # the sorted backend's no-grad CPU path is the C++ op, which must not take a replay
        got = fused_moe(x, w_gu, w_d, logits, k, True, topk_ids=ids, backend=backend)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


@pytest.mark.gpu
def test_routed_experts_in_cuda_graphs_equal_eager(moe_path):
    """The real decode graphs (recaptured with the routing buffer) against the eager engine, on the GPU."""
    def run(**kw):
        llm = LLM(moe_path, dtype=torch.float32, device="cuda", num_kv_blocks=64, use_tqdm=False, **kw)
        outs = llm.generate(PROMPTS, SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True,
                                                    return_routed_experts=True))
        stats = llm.stats()
        llm.close()
        return outs, stats

    want, _ = run(enforce_eager=True)
    got, stats = run(max_num_seqs=4, max_graph_batch_size=4)
    assert stats["num_graph_replays"] > 0
    for a, b in zip(got, want):
        assert a.outputs[0].token_ids == b.outputs[0].token_ids
        assert np.array_equal(a.outputs[0].routed_experts, b.outputs[0].routed_experts)
