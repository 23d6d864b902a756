"""Prompt log-probs (SamplingParams.prompt_logprobs) of a 4,096-token prompt against the eager formula
(`log_softmax(model(ids).logits)`, the whole [prompt_len, vocab] in fp32, as a client would compute it): the time and
peak memory of the engine's prefill with them (k = 0: the token's own, through the fused log-prob kernel; k = 1: also
the top one, from logits over row chunks of at most 32 MiB) and without them (the same prefill, no log-probs).

A tiny random MoE (H 64) with Qwen3's 151,936-token vocabulary (quick: 512 tokens, a 32,768 vocabulary; `--benchmark`
on the CPU: 2,048 tokens, 4,096 with `--benchmark-full`), fp32 on the CPU, bf16 on a GPU. Peak memory: above what was allocated before the call (CPU: the peak resident set). The model's
layers are small, so the log-probs' lm_head pass is a large share of the time here; on a real model the prefill
dominates.
"""
import pytest
import torch

from bench.common import measure, peak_memory, record
from livemoe.engine.llm import LLM
from livemoe.engine.sampling.params import SamplingParams

SUITE = "prompt_logprobs"
pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module")
def setup(tmp_path_factory, bench_mode, bench_long, device):
    from tiny_models import make_checkpoint

    full_length = 4096 if bench_long or device == "cuda" else 2048  # keeps pytest bench/ --benchmark's CPU time
    length, vocab = (full_length, 151_936) if bench_mode == "full" else (512, 32_768)
    path, _ = make_checkpoint(tmp_path_factory.mktemp("bench_plp") / "ckpt", moe=True, vocab_size=vocab,
                              max_position_embeddings=length + 16)
    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    llm = LLM(path, dtype=dtype, device=device, block_size=16, num_kv_blocks=length // 16 + 8,
              max_num_batched_tokens=length, use_tqdm=False, enable_prefix_caching=False)
    ids = torch.randint(3, vocab, (length,), generator=torch.Generator().manual_seed(0)).tolist()
    return llm, ids


def test_prompt_logprobs_against_the_eager_formula(setup, bench_mode, device):
    llm, ids = setup
    reps = 3 if bench_mode == "full" else 1
    model = llm.core.model

    def engine(k):
        return lambda: llm.generate([ids], SamplingParams(max_tokens=1, prompt_logprobs=k))[0]

    @torch.inference_mode()
    def eager():
        logits = model.compute_logits(model.forward_hidden(torch.tensor([ids], device=model.lm_head_weight.device)))
        lp = torch.log_softmax(logits[0, :-1].float(), dim=-1)
        return lp.gather(-1, torch.tensor(ids[1:], device=lp.device)[:, None])

    ours = engine(0)()
    want = eager()[:, 0].float().cpu()
    got = torch.tensor([lp[t] for t, lp in zip(ids[1:], ours.prompt_logprobs[1:])])
    assert torch.allclose(got, want, atol=1e-3 if device == "cpu" else 5e-2)
    t_eager, m_eager = measure(eager, device, reps=reps), peak_memory(eager, device)
    case = f"{len(ids)} prompt tokens, V {llm.core.vocab_size}"
    for name, fn in (("no prompt logprobs", engine(None)), ("k=0", engine(0)), ("k=1", engine(1))):
        t, m = measure(fn, device, reps=reps), peak_memory(fn, device)
        record(suite=SUITE, case=f"prefill, {name}, {case}", metric="ms", ours=t * 1e3, baseline=t_eager * 1e3,
               baseline_name="eager log_softmax of the whole logits")
        if m is not None and m_eager is not None:
            record(suite=SUITE, case=f"peak mem, {name}, {case}", metric="MiB", ours=m / 2**20,
                   baseline=m_eager / 2**20, baseline_name="eager log_softmax of the whole logits")
    assert t_eager > 0
