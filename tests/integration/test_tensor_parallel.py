"""Tensor- and expert-parallel shard models (livemoe.engine.model.tensor_parallel, livemoe.engine.model.loader with tp) on 2 and 4
gloo ranks against the single-process model: the logits of the plain causal forward, greedy tokens through
LLM.from_model on every rank (SPMD: the same requests, a deterministic scheduler and full logits on every rank
give every rank the same tokens) against transformers' generate with prefix caching and preemption, each rank's
parameter count, the bytes the loader reads, and the bad-size errors.

Tolerance (fp32): logits rtol 1e-4, atol 1e-5; logprobs atol 1e-5 against the single-process engine. A shard
model sums the same products in another order (each all-reduce adds N partial dot products; expert parallel
adds the experts' outputs rank by rank), so results differ by fp32 roundings of O(1) values, not more.
"""
import datetime
import math
import os

import pytest
import torch

from spawn_ranks import spawn_ranks

from livemoe.engine.model.config import load_config
from livemoe.engine.model.layers import SparseMoeBlock
from livemoe.engine.llm import LLM
from livemoe.engine.model.loader import load_model
from livemoe.engine.model.tensor_parallel import TensorParallel, check_tensor_parallel
from livemoe.engine.model.tensor_parallel import ReplicatedExpertParallel
from livemoe.engine.sampling.params import SamplingParams
from tiny_models import make_checkpoint

NEW = 12
GREEDY = SamplingParams(temperature=0, max_tokens=NEW, ignore_eos=True, logprobs=1)
ENGINE = dict(block_size=4, num_kv_blocks=24, max_num_batched_tokens=24)  # 96 KV slots: preempts, chunks
LOGITS_TOL = dict(rtol=1e-4, atol=1e-5)

pytestmark = pytest.mark.usefixtures("one_thread")

# name: (moe, tensor_parallel_size, expert_parallel, checkpoint layout, config overrides)
CASES_2 = {
    "dense": (False, 2, False, "per_expert", {}),
    "dense_1kv_bias_tied": (False, 2, False, "per_expert",
                            dict(num_key_value_heads=1, attention_bias=True, tie_word_embeddings=True)),
    "moe_tp_sharded_files": (True, 2, False, "per_expert", dict(max_shard_size="60KB")),
    "moe_ep_fused": (True, 2, True, "fused", {}),
    "moe_ep_1kv_dense_layer": (True, 2, True, "per_expert", dict(num_key_value_heads=1, mlp_only_layers=[1])),
}
CASES_4 = {
    "moe_tp4_2kv": (True, 4, False, "per_expert", dict(num_attention_heads=8, vocab_size=130)),
    "moe_ep4_2kv": (True, 4, True, "fused", dict(num_attention_heads=8)),
}


def prompts():
    g = torch.Generator().manual_seed(0)
    prefix = torch.randint(3, 120, (21,), generator=g).tolist()  # a shared prefix of whole blocks: cache hits
    return [prefix + torch.randint(3, 120, (k,), generator=g).tolist() for k in (2, 7)] + \
        [torch.randint(3, 120, (k,), generator=g).tolist() for k in (1, 30)]


def expected_numel(cfg, n: int, ep: bool) -> int:
    """A rank's parameter count, from the config alone: 1/N of each split tensor, the vocab padded to a multiple
    of N, and whole what is replicated (norms, routers, the o_proj bias, KV heads when fewer than N)."""
    h, d, layers = cfg.hidden_size, cfg.head_dim, cfg.num_hidden_layers
    vocab_rows = math.ceil(cfg.vocab_size / n)
    kv = max(cfg.num_key_value_heads // n, 1)
    q = cfg.num_attention_heads // n
    total = vocab_rows * h * (1 if cfg.tie_word_embeddings else 2) + h  # embedding, head, final norm
    for i in range(layers):
        attn = (q + 2 * kv) * d * h + h * q * d + 2 * d + 2 * h  # q, k, v, o; q/k norms; the two layer norms
        if cfg.attention_bias:
            attn += (q + 2 * kv) * d + h
        if cfg.is_moe_layer(i):
            experts = cfg.num_experts * 3 * h * cfg.moe_intermediate_size // n
            mlp = cfg.num_experts * h + experts
        else:
            mlp = 3 * h * cfg.intermediate_size // n
        total += attn + mlp
    return total


def padding_numel(cfg, n: int, rank: int) -> int:
    """Zero rows the last ranks hold past the vocab (the embedding's, and the head's when untied)."""
    per = math.ceil(cfg.vocab_size / n)
    pad = max(0, min(per, (rank + 1) * per - cfg.vocab_size))
    return pad * cfg.hidden_size * (1 if cfg.tie_word_embeddings else 2)


class CountingReads:
    """safe_open's handle with get_tensor refused and the bytes of every slice read counted."""
    bytes_read = 0

    def __init__(self, handle):
        self.handle = handle

    def __enter__(self):
        self.f = self.handle.__enter__()
        return self

    def __exit__(self, *exc):
        return self.handle.__exit__(*exc)

    def keys(self):
        return self.f.keys()

    def get_tensor(self, key):
        raise AssertionError(f"a tensor-parallel rank read the whole tensor {key!r}")

    def get_slice(self, key):
        sliced = self.f.get_slice(key)

        class Slice:
            def get_shape(self):
                return sliced.get_shape()

            def __getitem__(self, index):
                t = sliced[index]
                CountingReads.bytes_read += t.numel() * t.element_size()
                return t

        return Slice()


def moe_layer_input(hidden_size: int) -> torch.Tensor:
    return torch.randn(9, hidden_size, generator=torch.Generator().manual_seed(0))


def moe_layer_outputs(block) -> list[torch.Tensor]:
    """A MoE layer's experts on 9 tokens: as the decoder runs them; with expert parallel, also in the fixed-shape
    form a CUDA graph captures (pairs routed elsewhere through local expert 0 with weight 0)."""
    x = moe_layer_input(block.gate.in_features)
    experts, logits = block.experts, block.gate(x)
    args = (x, experts.gate_up_proj, experts.down_proj, logits, block.top_k, block.norm_topk_prob)
    outs = [experts.expert_parallel.fused_moe(*args)]
    if isinstance(experts.expert_parallel, ReplicatedExpertParallel):
        outs.append(experts.expert_parallel.fused_moe(*args, fixed_shapes=True))
    return outs


def run_rank(cases: dict, paths: dict) -> dict:
    """On one gloo rank: each case's shard model -> its logits, greedy outputs, parameter count, bytes read."""
    import torch.distributed as dist

    from livemoe.engine.model import loader

    rank, size = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=60))
    safe_open = loader.safe_open
    loader.safe_open = lambda *a, **k: CountingReads(safe_open(*a, **k))
    out = {}
    for name, (_, n, ep, _, _) in cases.items():
        assert n == size, (name, n, size)
        tp = TensorParallel(rank, size, None, ep)
        CountingReads.bytes_read = 0
        model = load_model(paths[name], dtype=torch.float32, device="cpu", tp=tp)
        bytes_read = CountingReads.bytes_read
        with torch.inference_mode():
            logits = model(torch.tensor([prompts()[0], prompts()[1][:23]]))
        llm = LLM.from_model(model, None, **ENGINE)
        outs = llm.generate(prompts(), GREEDY)
        moe_layer = next((m for m in model.modules() if isinstance(m, SparseMoeBlock)), None)
        out[name] = dict(moe_layer=moe_layer and moe_layer_outputs(moe_layer), tokens=[o.token_ids for o in outs],
                         logits=logits,
                         logprobs=[o.outputs[0].token_logprobs for o in outs], stats=llm.stats(),
                         numel=sum(p.numel() for p in model.parameters()), bytes_read=bytes_read,
                         kv_heads=llm.core.runner.num_kv_heads, layout=model.tensor_parallel.to_dict())
    return out


def hf_greedy(hf, prompt):
    return hf.generate(torch.tensor([prompt]), max_new_tokens=NEW, do_sample=False)[0, len(prompt):].tolist()


def make_cases(tmp_path, cases):
    paths, refs = {}, {}
    for name, (moe, _, _, layout, overrides) in cases.items():
        path, hf = make_checkpoint(tmp_path / name, moe=moe, seed=len(paths), layout=layout, **overrides)
        hf.generation_config.eos_token_id = None
        paths[name], refs[name] = path, [hf_greedy(hf, p) for p in prompts()]
    return paths, refs


def check_case(name, case, path, hf_tokens, ranks):
    moe, n, ep, _, _ = case
    cfg = load_config(path)
    single = load_model(path, dtype=torch.float32, device="cpu")
    with torch.inference_mode():
        expect_logits = single(torch.tensor([prompts()[0], prompts()[1][:23]]))
    engine_outs = LLM.from_model(single, None, **ENGINE).generate(prompts(), GREEDY)
    block = next((m for m in single.modules() if isinstance(m, SparseMoeBlock)), None)
    with torch.inference_mode():
        expect_moe = block and block(moe_layer_input(cfg.hidden_size)[None])[0][0]
    assert len(ranks) == n
    for rank, res in enumerate(ranks):
        r = res[name]
        assert r["logits"].shape == expect_logits.shape  # the full vocab on every rank
        torch.testing.assert_close(r["logits"], expect_logits, **LOGITS_TOL)
        assert len(r["tokens"]) == len(hf_tokens) == 4
        assert r["tokens"] == hf_tokens, f"{name} rank {rank}"
        if moe:
            assert len(r["moe_layer"]) == (2 if ep else 1)
            for got in r["moe_layer"]:
                torch.testing.assert_close(got, expect_moe, **LOGITS_TOL)
        for got, single_out in zip(r["logprobs"], engine_outs):
            torch.testing.assert_close(torch.tensor(got), torch.tensor(single_out.outputs[0].token_logprobs),
                                       atol=1e-5, rtol=0)
        assert r["stats"]["num_preemptions"] > 0 and r["stats"]["prefix_cache_hits"] > 0
        assert r["numel"] == expected_numel(cfg, n, ep)
        assert r["bytes_read"] == 4 * (r["numel"] - padding_numel(cfg, n, rank))
        assert r["kv_heads"] == max(cfg.num_key_value_heads // n, 1)  # this rank's KV cache holds its heads only
        assert r["layout"] == {"tensor_parallel_size": n, "rank": rank, "expert_parallel": ep}
    # the tensors split over ranks are counted once; the replicated ones (norms, routers) N times
    full = sum(p.numel() for p in single.parameters())
    assert sum(r[name]["numel"] for r in ranks) >= full
    assert ranks[0][name]["numel"] < full * (0.6 if n == 2 else 0.35)


@pytest.mark.slow
def test_two_ranks_equal_one_process(tmp_path):
    paths, refs = make_cases(tmp_path, CASES_2)
    ranks = spawn_ranks(run_rank, 2, CASES_2, paths, timeout=120)
    for name, case in CASES_2.items():
        check_case(name, case, paths[name], refs[name], ranks)


@pytest.mark.slow
def test_four_ranks_equal_one_process(tmp_path):
    paths, refs = make_cases(tmp_path, CASES_4)
    ranks = spawn_ranks(run_rank, 4, CASES_4, paths, timeout=120)
    for name, case in CASES_4.items():
        check_case(name, case, paths[name], refs[name], ranks)


@pytest.mark.parametrize("overrides, size, ep, message", [
    (dict(num_attention_heads=6, num_key_value_heads=2), 4, False, "tensor_parallel_size=4 does not divide the "
                                                                   "model's num_attention_heads=6"),
    (dict(num_attention_heads=6, num_key_value_heads=3), 2, False, "num_key_value_heads=3"),
    (dict(num_experts=6), 4, True, "tensor_parallel_size=4 does not divide the model's num_experts=6"),
    (dict(moe_intermediate_size=30), 4, False, "moe_intermediate_size=30"),
    (dict(mlp_only_layers=[0], intermediate_size=90), 4, False, "intermediate_size=90 (of its dense MLP layers [0])"),
    ({}, 0, False, "tensor_parallel_size must be a positive integer, got 0"),
])
def test_check_tensor_parallel_names_the_values(overrides, size, ep, message):
    from livemoe.engine.model.config import ModelConfig
    from tiny_models import BASE, MOE

    raw = {**BASE, **MOE, "model_type": "qwen3_moe", **overrides}
    cfg = ModelConfig.from_dict(raw)
    with pytest.raises(ValueError) as err:
        check_tensor_parallel(cfg, size, ep)
    assert message in str(err.value)
    check_tensor_parallel(cfg, 1, False)  # one rank always fits


def test_a_shard_model_is_not_saved(tmp_path):
    from livemoe.engine.model.loader import empty_model
    from livemoe.engine.model.saver import save_model

    path, _ = make_checkpoint(tmp_path / "m", moe=True)
    shard = empty_model(load_config(path), torch.float32, torch.device("cpu"), TensorParallel(1, 2, None, True))
    with pytest.raises(ValueError, match="one rank's shard"):
        save_model(shard, tmp_path / "out")
    assert not (tmp_path / "out").exists()


def test_expert_parallel_refused_for_a_dense_model():
    from livemoe.engine.model.config import ModelConfig
    from tiny_models import BASE

    with pytest.raises(ValueError, match="enable_expert_parallel needs an MoE model"):
        check_tensor_parallel(ModelConfig.from_dict({**BASE, "model_type": "qwen3"}), 2, True)
