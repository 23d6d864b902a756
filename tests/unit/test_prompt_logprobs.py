"""Prompt log-probs (SamplingParams.prompt_logprobs) equal transformers' log_softmax of its own logits, on a tiny
random MoE checkpoint: in one prefill and in chunks, with and without top-k, when the prompt is in the prefix cache
(the request computes it anyway), with n > 1, after preemption, beside speculative decoding, and through an
engine-core process."""
import asyncio

import pytest
import torch

from livemoe.engine.async_llm import AsyncLLM
from livemoe.engine.errors import RequestError
from livemoe.engine.llm import LLM
from livemoe.engine.sampling.params import SamplingParams
from tiny_models import make_checkpoint

pytestmark = pytest.mark.usefixtures("one_thread")
TOL = 1e-4


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    path, hf = make_checkpoint(tmp_path_factory.mktemp("plp") / "ckpt", moe=True)
    return path, hf


def prompt(length: int, seed: int = 0) -> list[int]:
    return torch.randint(3, 131, (length,), generator=torch.Generator().manual_seed(seed)).tolist()


def reference(hf, ids: list[int]) -> torch.Tensor:
    """[len - 1, V]: row p is log p(. | ids[:p + 1]) under transformers."""
    with torch.no_grad():
        return torch.log_softmax(hf(torch.tensor([ids])).logits[0, :-1].float(), dim=-1)


def assert_matches(got, ids, ref, k):
    assert got[0] is None and len(got) == len(ids)
    for p in range(1, len(ids)):
        row = ref[p - 1]
        entry = got[p]
        assert abs(entry[ids[p]] - row[ids[p]].item()) < TOL, (p, entry[ids[p]], row[ids[p]].item())
        top = row.topk(k)
        assert set(entry) == {ids[p], *top.indices.tolist()}, (p, entry)
        for t, v in zip(top.indices.tolist(), top.values.tolist()):
            assert abs(entry[t] - v) < TOL


@pytest.mark.parametrize("k", [0, 3])
def test_chunked_prefill_and_prefix_cache_hits_give_transformers_values(checkpoint, k):
    path, hf = checkpoint
    llm = LLM(path, dtype=torch.float32, device="cpu", block_size=4, num_kv_blocks=128, max_num_batched_tokens=16)
    ids = prompt(45)
    ref = reference(hf, ids)
    params = SamplingParams(temperature=0, max_tokens=2, prompt_logprobs=k)
    first = llm.generate([ids], params)[0]  # 45 tokens in chunks of at most 16
    assert_matches(first.prompt_logprobs, ids, ref, k)
    assert llm.generate([ids], SamplingParams(max_tokens=1))[0].metrics.num_cached_tokens > 0  # it is cached
    again = llm.generate([ids], params)[0]
    assert again.metrics.num_cached_tokens == 0  # the request computed the prompt anyway
    assert_matches(again.prompt_logprobs, ids, ref, k)
    assert again.token_ids == first.token_ids
    assert llm.generate([ids], SamplingParams(max_tokens=1))[0].prompt_logprobs is None  # not asked: not computed


def test_n_samples_one_token_prompt_and_a_batch(checkpoint):
    path, hf = checkpoint
    llm = LLM(path, dtype=torch.float32, device="cpu", block_size=4, num_kv_blocks=128, max_num_batched_tokens=8)
    prompts = [prompt(20, 1), prompt(7, 2), [5]]
    outs = llm.generate(prompts, SamplingParams(max_tokens=3, n=3, seed=1, prompt_logprobs=1))
    for ids, out in zip(prompts[:2], outs):
        assert_matches(out.prompt_logprobs, ids, reference(hf, ids), 1)
        assert len(out.outputs) == 3
    assert outs[2].prompt_logprobs == [None]


def test_preempted_request_still_completes_its_prompt_logprobs(checkpoint):
    path, hf = checkpoint
    # 12 blocks of 4 tokens: four 30-token prompts cannot all run, so sequences are preempted and recomputed
    llm = LLM(path, dtype=torch.float32, device="cpu", block_size=4, num_kv_blocks=24, max_num_batched_tokens=16)
    prompts = [prompt(30, s) for s in range(4)]
    outs = llm.generate(prompts, SamplingParams(max_tokens=12, ignore_eos=True, prompt_logprobs=2))
    assert llm.core.scheduler.num_preemptions > 0
    for ids, out in zip(prompts, outs):
        assert_matches(out.prompt_logprobs, ids, reference(hf, ids), 2)


def test_beside_speculative_decoding(checkpoint):
    path, hf = checkpoint
    llm = LLM(path, dtype=torch.float32, device="cpu", block_size=4, num_kv_blocks=128, max_num_batched_tokens=16,
              speculative_config={"method": "ngram", "num_speculative_tokens": 3})
    ids = prompt(12, 7) * 3  # repeats: the ngram drafter proposes from the prompt
    plain = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    decoding = llm.add_request(prompt(9, 8) * 3, plain)  # another request decodes with drafts meanwhile
    llm.step()
    out = llm.generate([ids], SamplingParams(temperature=0, max_tokens=12, ignore_eos=True, prompt_logprobs=2))[0]
    assert_matches(out.prompt_logprobs, ids, reference(hf, ids), 2)
    assert llm.core.speculator.num_verifications > 0  # drafts were verified in the steps that computed them
    llm.abort(decoding)
    assert out.token_ids == llm.generate([ids], plain)[0].token_ids


def test_through_an_engine_core_process(checkpoint):
    path, hf = checkpoint
    ids = prompt(33, 5)

    async def run():
        engine = AsyncLLM(path, dtype=torch.float32, device="cpu", engine_core="process", threads=1, block_size=4,
                          num_kv_blocks=64, max_num_batched_tokens=16, use_tqdm=False)
        try:
            stream = await engine.add_request(ids, SamplingParams(max_tokens=3, prompt_logprobs=2))
            return [d async for d in stream]
        finally:
            engine.shutdown()

    deltas = asyncio.run(run())
    assert [d.prompt_logprobs is not None for d in deltas] == [True] + [False] * (len(deltas) - 1)
    assert_matches(deltas[0].prompt_logprobs, ids, reference(hf, ids), 2)


@pytest.mark.parametrize("bad", [-1, 1.5, True])
def test_bad_values_are_refused(bad):
    with pytest.raises(RequestError, match="prompt_logprobs"):
        SamplingParams(prompt_logprobs=bad)
