"""Decoding cost, the LiveThinking seed's measure: tokens per response (TPR) and decode FLOPs per
response (2 x active parameters x tokens, livemoe.engine.model.flops), and the decode FLOP/s the engine achieves.

- The seed's Table 3 rows for the three published configs: our accounting against the table's D. TFLOPs
  at the table's TPR (a check that the cost measure the trainers report is the seed's).
- A tiny Qwen3-MoE sampling with EOS on (temperature 0.7, seeded): TPR and decode GFLOPs per response
  from the decoder's per-request metrics, and decode GFLOP/s of livemoe.engine.LLM against transformers'
  generate producing the same number of tokens in the same process.
"""
import time

import pytest
import torch

from bench.common import record
from livemoe.engine.model import flops

SUITE = "decode cost"
# Table 3 (Tblive-E-Commerce QA): (TPR, D. TFLOPs)
TABLE3 = {"qwen3-30b-a3b": (396, 2.38), "qwen3-235b-a22b": (387, 17.03), "qwen3-32b": (368, 23.55)}


@pytest.mark.parametrize("name", sorted(TABLE3))
def test_table3_decode_cost(name):
    tpr, paper = TABLE3[name]
    ours = flops.decode_flops(flops.resolve_config(name), tpr) / 1e12
    record(suite=SUITE, case=f"{name} at TPR {tpr} (seed Table 3)", metric="D. TFLOPs", ours=ours,
           baseline=paper, baseline_name="seed Table 3", kind="reproduction", extra={"ratio_to_paper": ours / paper})
    assert abs(ours / paper - 1) < 0.03


def test_tpr_and_decode_flops_tiny_moe(benchmark, bench_mode, tmp_path_factory):
    from livemoe.engine.llm import LLM
    from livemoe.engine.sampling.params import SamplingParams
    from tiny_models import make_checkpoint

    path, hf = make_checkpoint(tmp_path_factory.mktemp("bench_flops") / "moe", moe=True, seed=11)
    num, max_tokens = (32, 64) if bench_mode == "full" else (4, 12)
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(3, hf.config.vocab_size, (int(n),), generator=g).tolist()
               for n in torch.randint(8, 33, (num,), generator=g)]
    llm = LLM(path, dtype=torch.float32, device="cpu", use_tqdm=False)
    params = SamplingParams(temperature=0.7, max_tokens=max_tokens, seed=0)
    llm.generate(prompts[:1], SamplingParams(temperature=0, max_tokens=2))  # warm-up (KV cache, first-call costs)
    hf.generate(torch.tensor(prompts[:1]), max_new_tokens=2, do_sample=False, pad_token_id=0)
    box = {}

    def ours():
        t0 = time.perf_counter()
        box["outs"] = llm.generate(prompts, params)
        box["t"] = time.perf_counter() - t0

    benchmark.pedantic(ours, rounds=1, iterations=1)
    outs, t_ours = box["outs"], box["t"]
    lens = [len(o.token_ids) for o in outs]
    tpr = sum(lens) / num
    gflops_per_response = sum(o.metrics.decode_flops for o in outs) / num / 1e9
    assert gflops_per_response == pytest.approx(flops.decode_flops(llm.model.config, sum(lens)) / num / 1e9)
    case = f"tiny MoE, {num} sampled responses (T=0.7, <= {max_tokens} tokens)"
    record(suite=SUITE, case=case, metric="TPR", ours=tpr, extra={"min": min(lens), "max": max(lens)})
    record(suite=SUITE, case=case, metric="decode GFLOPs/response", ours=gflops_per_response)

    # the same number of tokens per prompt through transformers' generate, one batch, left-padded
    width = max(map(len, prompts))
    ids = torch.tensor([[0] * (width - len(p)) + p for p in prompts])
    mask = (ids != 0).long()
    hf.generation_config.eos_token_id = None
    t0 = time.perf_counter()
    hf.generate(ids, attention_mask=mask, max_new_tokens=max(lens), min_new_tokens=max(lens), do_sample=False,
                pad_token_id=0)
    t_hf = time.perf_counter() - t0
    total = flops.decode_flops(llm.model.config, sum(lens))
    record(suite=SUITE, case=case, metric="decode GFLOP/s (useful tokens)", ours=total / t_ours / 1e9,
           baseline=total / t_hf / 1e9, baseline_name="transformers generate (batched)", higher_is_better=True)
