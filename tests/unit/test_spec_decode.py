"""Speculative decoding (livemoe.engine.decoder.spec) is exact: greedy tokens equal decoding without it on the
committed student and two random MoE checkpoints, at batch 1, 7 and 32, with prefix hits, chunked prefill,
preemption, stop strings, penalties, logit_bias, min_tokens and grammars; the verification rule draws from the
target distribution (a chi-square test over many seeds); logprobs are the target's; KV blocks come back."""
import json

import pytest
import torch

from livemoe.engine.decoder.spec.config import SpeculativeConfig
from livemoe.engine.decoder.spec.proposers import NgramProposer
from livemoe.engine.decoder.spec import verify
from livemoe.engine.decoder.spec.verify import verified_tokens
from livemoe.engine.errors import EngineConfigError
from livemoe.engine.llm import LLM
from livemoe.engine.model import fused_decode
from livemoe.engine.sampling.params import SamplingParams
from livemoe.engine.sampling.sampler import Sampler
from livemoe.train.config import DEFAULT_STUDENT
from test_llm import add_tokenizer
from tiny_models import make_checkpoint

pytestmark = pytest.mark.usefixtures("one_thread")

# speculating at every batch size the tests use (the default turns it off above 4 decoding sequences)
NGRAM = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 1, "prompt_lookup_max": 3,
         "disable_by_batch_size": 64}


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    out = {"student": DEFAULT_STUDENT}
    for seed in (0, 1):
        path, _ = make_checkpoint(tmp_path_factory.mktemp(f"moe{seed}") / "ckpt", moe=True, seed=seed)
        add_tokenizer(path)
        out[f"moe{seed}"] = path
    return out


def engines(path, **options):
    options = dict(dtype=torch.float32, block_size=4, num_kv_blocks=512, use_tqdm=False) | options
    return LLM(path, **options), LLM(path, speculative_config=NGRAM, **options)


def repetitive_prompts(n: int, vocab: int, seed: int = 0) -> list[list[int]]:
    """Prompts with repeats in them (so prompt lookup finds something), some sharing a prefix (prefix hits)."""
    g = torch.Generator().manual_seed(seed)
    shared = torch.randint(3, vocab, (9,), generator=g).tolist()
    out = []
    for i in range(n):
        motif = torch.randint(3, vocab, (int(torch.randint(2, 6, (1,), generator=g)),), generator=g).tolist()
        head = shared if i % 3 == 0 else []
        out.append(head + motif * int(torch.randint(2, 5, (1,), generator=g)) + motif[:1])
    return out


def vocab_of(llm) -> int:
    return llm.model.config.vocab_size


@pytest.mark.parametrize("name", ["student", "moe0", "moe1"])
@pytest.mark.parametrize("batch", [1, 7, 32])
def test_greedy_tokens_equal_decoding_without_speculation(checkpoints, name, batch):
    base, spec = engines(checkpoints[name], max_num_batched_tokens=64)  # chunked prefill for the long batches
    prompts = repetitive_prompts(batch, min(vocab_of(base), 120), seed=batch)
    params = SamplingParams(temperature=0, max_tokens=32, ignore_eos=True)
    expected = [o.token_ids for o in base.generate(prompts, params)]
    assert [o.token_ids for o in spec.generate(prompts, params)] == expected
    # again: the shared prefixes now hit the cache
    assert [o.token_ids for o in spec.generate(prompts, params)] == expected
    stats = spec.stats()
    assert stats["spec_drafted_tokens"] > 0 and stats["spec_accepted_tokens"] > 0, stats
    assert stats["prefix_cache_hits"] > 0
    assert stats["kv_blocks_used"] == 0  # every slot back, the rejected drafts' too


def test_greedy_equal_under_preemption_and_stop_strings(checkpoints):
    base, spec = engines(checkpoints["moe0"], num_kv_blocks=40, max_num_seqs=8)  # too few blocks: preemption
    prompts = repetitive_prompts(8, 120, seed=3)
    params = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)
    expected = base.generate(prompts, params)
    got = spec.generate(prompts, params)
    assert [o.token_ids for o in got] == [o.token_ids for o in expected]
    assert spec.stats()["num_preemptions"] > 0 and spec.stats()["spec_accepted_tokens"] > 0
    # a stop string inside an accepted run ends the output where decoding without speculation ends it
    text = expected[0].text
    stop = text[len(text) // 2:len(text) // 2 + 2]
    params = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True, stop=[stop])
    a, b = base.generate(prompts[:4], params), spec.generate(prompts[:4], params)
    assert [(o.text, o.token_ids, o.finish_reason) for o in b] == [(o.text, o.token_ids, o.finish_reason) for o in a]


def test_processing_and_logprobs_equal_decoding_without_speculation(checkpoints):
    base, spec = engines(checkpoints["moe1"])
    prompts = repetitive_prompts(5, 120, seed=4)
    eos = sorted(base.core.eos_token_ids)
    cases = [
        SamplingParams(temperature=0, max_tokens=24, ignore_eos=True, repetition_penalty=1.3,
                       frequency_penalty=0.4, presence_penalty=0.2),
        SamplingParams(temperature=0, max_tokens=24, ignore_eos=True, logit_bias={7: 4.0, 9: -100.0}),
        SamplingParams(temperature=0, max_tokens=24, min_tokens=20, stop_token_ids=eos),
        SamplingParams(temperature=0, max_tokens=24, ignore_eos=True, logprobs=3),
    ]
    for params in cases:
        a, b = base.generate(prompts, params), spec.generate(prompts, params)
        assert [o.token_ids for o in b] == [o.token_ids for o in a], params
        if params.logprobs:
            for x, y in zip(a, b):
                for ex, got in zip(x.outputs[0].logprobs, y.outputs[0].logprobs):
                    assert ex.keys() == got.keys()
                    # a k+1-token chunk and a 1-token decode sum in another order: fp32 rounding apart
                    assert all(abs(ex[t] - got[t]) < 1e-4 for t in ex), (ex, got)
    assert spec.stats()["spec_accepted_tokens"] > 0


def test_grammar_constrained_greedy_equal(tmp_path):
    pytest.importorskip("xgrammar", reason="needs xgrammar (a runtime dependency: pip install -e .)")
    from livemoe.engine.sampling.structured import StructuredOutput
    from tiny_tokenizer import make_text_checkpoint

    path, _ = make_text_checkpoint(tmp_path / "ckpt", moe=True)
    options = dict(dtype=torch.float32, block_size=16, num_kv_blocks=256, max_model_len=512, use_tqdm=False)
    base, spec = LLM(path, **options), LLM(path, speculative_config=NGRAM, **options)
    schema = {"type": "object", "properties": {"a": {"type": "array", "items": {"type": "integer"}, "maxItems": 6}},
              "required": ["a"], "additionalProperties": False}
    prompts = [f"list {i} {i} {i}: [1, 2, 1, 2, 1, 2" for i in range(4)]
    params = SamplingParams(temperature=0, max_tokens=80, structured=StructuredOutput(json=schema))
    a, b = base.generate(prompts, params), spec.generate(prompts, params)
    assert [o.text for o in b] == [o.text for o in a]
    for o in b:  # a random model may run out of tokens inside the array; what ends must validate
        if o.finish_reason == "stop":
            assert isinstance(json.loads(o.text)["a"], list), o.text
        else:
            assert o.finish_reason == "length" and o.text.startswith('{"a": ['), o.text
    assert spec.stats()["spec_drafted_tokens"] > 0


def test_seeded_sampling_gives_the_tokens_of_decoding_without_speculation(checkpoints):
    """ngram verification draws each token as decoding without speculation does, from the same generator: a seeded
    request's tokens are the same with and without it, alone or in a batch, speculating or turned off."""
    base, spec = engines(checkpoints["moe0"])
    prompts = repetitive_prompts(6, 120, seed=5)
    params = [SamplingParams(temperature=0.8, top_p=0.9, seed=100 + i, max_tokens=24, ignore_eos=True)
              for i in range(len(prompts))]
    expected = [o.token_ids for o in base.generate(prompts, params)]
    assert [o.token_ids for o in spec.generate(prompts, params)] == expected
    assert [spec.generate([p], [sp])[0].token_ids for p, sp in zip(prompts, params)] == expected
    off_above_2 = LLM(checkpoints["moe0"], dtype=torch.float32, block_size=4, num_kv_blocks=512, use_tqdm=False,
                      speculative_config=dict(NGRAM, disable_by_batch_size=2))
    assert [o.token_ids for o in off_above_2.generate(prompts, params)] == expected
    assert spec.stats()["spec_accepted_tokens"] > 0 and off_above_2.stats()["spec_disabled_steps"] > 0


CHI2_CRITICAL_0001 = [10.83, 13.82, 16.27, 18.47, 20.52, 22.46, 24.32]  # p = 0.001, 1..7 degrees of freedom


def chi2_below_critical(counts: torch.Tensor, p: torch.Tensor) -> bool:
    """Pearson's goodness of fit of counts to p at p = 0.001, the bins expected under 20 pooled into one (the test
    needs sizeable expected counts). Nothing may fall where p is 0 (outside top_p)."""
    assert counts[p == 0].sum() == 0, counts
    expected = counts.sum() * p
    small = (expected < 20) & (p > 0)
    obs = torch.cat([counts[~small & (p > 0)], counts[small].sum()[None]]) if small.any() else counts[p > 0]
    exp = torch.cat([expected[~small & (p > 0)], expected[small].sum()[None]]) if small.any() else expected[p > 0]
    stat = float(((obs - exp) ** 2 / exp).sum())
    assert len(obs) >= 2
    assert stat < CHI2_CRITICAL_0001[len(obs) - 2], (stat, obs.tolist(), exp.tolist())
    return True


@pytest.mark.parametrize("temperature,top_p", [(1.0, 1.0), (0.7, 1.0), (1.0, 0.8)])
@pytest.mark.parametrize("q_kind", ["point", "draft", "draft, kernel path"])
def test_verification_draws_from_the_target_distribution(temperature, top_p, q_kind, monkeypatch):
    """Over many seeds, the first and (given the first draft kept) second emitted tokens are distributed as the
    target's filtered softmax: chi-square at p = 0.001. "kernel path": the CUDA path (all rows in one call of the
    rejection sampler, which runs its reference here) forced on the CPU."""
    if q_kind == "draft, kernel path":
        monkeypatch.setattr(verify, "use_rejection_kernel", lambda logits: True)
    V, trials = 8, 6000
    g = torch.Generator().manual_seed(7)
    logits = torch.randn(3, V, generator=g) * 1.5
    drafts = [2, 5]  # ngram's: fixed, a point mass each
    q = None
    if q_kind != "point":  # a draft model's: each trial draws its drafts from q, as the rule assumes
        q = torch.softmax(torch.randn(2, V, generator=g), -1)
    params = SamplingParams(temperature=temperature, top_p=top_p, max_tokens=8)
    sampler = Sampler()
    target = sampler.distributions(logits, [params] * 3).filtered.softmax(-1)
    firsts, seconds = torch.zeros(V), torch.zeros(V)

    class Seq:  # what verification reads of a sequence
        token_ids, num_prompt_tokens, grammar = [1], 1, None

    for t in range(trials):
        seq = Seq()
        seq.params, seq.generator = params, torch.Generator().manual_seed(t)
        if q is not None:
            drafts = torch.multinomial(q, 1, generator=g)[:, 0].tolist()
        emitted = [(tok, kept) for tok, _, kept in verified_tokens(sampler, seq, logits, drafts, q)]
        firsts[emitted[0][0]] += 1
        if emitted[0][1]:  # the first draft kept: the second token is drawn given it
            seconds[emitted[1][0]] += 1

    assert seconds.sum() > 300
    assert chi2_below_critical(firsts, target[0]) and chi2_below_critical(seconds, target[1])


def naive_lookup(tokens: list[int], k: int, lo: int, hi: int) -> list[int]:
    for n in range(min(hi, len(tokens) - 1), lo - 1, -1):
        suffix = tokens[len(tokens) - n:]
        starts = [s for s in range(len(tokens) - n) if tokens[s:s + n] == suffix]
        if starts:
            return tokens[starts[-1] + n:starts[-1] + n + k]
    return []


def test_ngram_lookup_equals_a_naive_search():
    g = torch.Generator().manual_seed(0)
    for _ in range(400):
        lo = int(torch.randint(1, 4, (1,), generator=g))
        hi = lo + int(torch.randint(0, 4, (1,), generator=g))
        tokens = torch.randint(0, 4, (int(torch.randint(1, 30, (1,), generator=g)),), generator=g).tolist()
        k = int(torch.randint(1, 6, (1,), generator=g))
        assert NgramProposer(lo, hi).lookup(tokens, k) == naive_lookup(tokens, k, lo, hi), (tokens, k, lo, hi)


def test_ngram_lookup_with_recent_outputs_equals_a_naive_search():
    """The byte search over int64 tokens: ids whose bytes also match across token boundaries (0, 1, 256, 2**32 ...),
    with and without kept outputs, give what a plain list search gives."""
    class Seq:
        def __init__(self, tokens):
            self.token_ids, self.num_prompt_tokens, self.num_output_tokens = tokens, 0, len(tokens)

    ids = [0, 1, 256, 65536, 2 ** 32, 2 ** 32 + 1, 151935]
    g = torch.Generator().manual_seed(1)

    def draw(n):
        return [ids[int(i)] for i in torch.randint(0, len(ids), (n,), generator=g)]

    for _ in range(300):
        lo = int(torch.randint(1, 3, (1,), generator=g))
        hi = lo + int(torch.randint(0, 4, (1,), generator=g))
        k = int(torch.randint(1, 6, (1,), generator=g))
        ngram = NgramProposer(lo, hi, recent_outputs=3)
        outputs = [draw(int(torch.randint(1, 12, (1,), generator=g))) for _ in range(int(torch.randint(0, 4, (1,),
                                                                                                      generator=g)))]
        for out in outputs:
            ngram.finished(Seq(out))
        tokens = draw(int(torch.randint(1, 25, (1,), generator=g)))
        expected = naive_lookup(tokens, k, lo, hi)
        own = max((n for n in range(lo, min(hi, len(tokens) - 1) + 1)
                   if any(tokens[s:s + n] == tokens[-n:] for s in range(len(tokens) - n))), default=0)
        hist = [t for out in outputs[-3:] for t in out + [-1]]
        for n in range(min(hi, len(tokens)), max(own, lo - 1), -1):  # a longer match in the kept outputs drafts
            ends = [s + n - 1 for s in range(len(hist) - n + 1) if hist[s:s + n] == tokens[-n:]]
            if ends:
                follow = hist[ends[-1] + 1:ends[-1] + 1 + k]
                follow = follow[:follow.index(-1)] if -1 in follow else follow
                expected = follow or expected
                break
        expected = expected if len(tokens) > lo else []  # no longer than prompt_lookup_min: nothing to match
        assert ngram.lookup(tokens, k) == expected, (tokens, outputs, k, lo, hi)


def test_ngram_lookup():
    ngram = NgramProposer(1, 3)
    assert ngram.lookup([5, 6, 7, 8, 9, 5, 6, 7], 3) == [8, 9, 5]  # the 3-token suffix seen before
    assert ngram.lookup([1, 2, 3, 1, 2, 4, 1, 2], 2) == [4, 1]  # the latest earlier occurrence
    assert ngram.lookup([1, 2, 3, 4], 2) == []
    assert ngram.lookup([7, 7], 0) == []
    assert NgramProposer(2, 3).lookup([1, 2, 9, 2], 2) == []  # a 1-token match is below prompt_lookup_min


def test_ngram_lookup_in_recent_outputs():
    """lookup_recent_outputs: a match in a finished sequence's output (or its prompt's last tokens) drafts when it is
    longer than the sequence's own; drafts stop at that output's end; the oldest output leaves first."""
    class Seq:
        def __init__(self, prompt, output):
            self.token_ids, self.num_prompt_tokens, self.num_output_tokens = prompt + output, len(prompt), len(output)

    ngram = NgramProposer(1, 3, recent_outputs=2)
    ngram.finished(Seq([50] * 20 + [1, 2], [3, 4, 5, 6]))  # kept: the prompt's last 8 tokens and the output
    assert ngram.lookup([9, 2, 3], 4) == [4, 5, 6]  # "2 3" there; own: nothing
    assert ngram.lookup([50, 1], 3) == [2, 3, 4]  # from the prompt's kept end
    assert ngram.lookup([3, 9, 8, 3], 3) == [9, 8, 3]  # own 1-token match, history's is not longer: own wins
    ngram.finished(Seq([7], [8, 9]))
    ngram.finished(Seq([7], [8, 1, 2, 3, 0]))  # the first output leaves (two kept)
    assert ngram.lookup([4, 1, 2, 3], 3) == [0]  # drafts stop at the output's end
    assert ngram.lookup([9, 3, 0, 6, 2, 3, 0], 2) == [6, 2]  # history's "2 3 0" ends an output: the own "3 0" drafts
    assert ngram.lookup([9, 5, 6], 2) == []
    assert NgramProposer(1, 3).lookup([9, 2, 3], 4) == []  # off by default
    ngram.finished(Seq([7], []))  # nothing generated: nothing kept
    assert len(ngram.recent) == 2


def test_recent_outputs_lookup_is_exact_and_drafts_from_earlier_answers(checkpoints):
    """The committed student answering product questions one after another: with lookup_recent_outputs the greedy
    tokens are those of decoding without speculation, and a question asked again is drafted from the earlier
    answer."""
    from livemoe.train.data import build_prompt
    from livemoe.train.synthetic.world import make_rooms

    base, _ = engines(checkpoints["student"])
    recent = LLM(checkpoints["student"], speculative_config=NGRAM | {"lookup_recent_outputs": 16}, dtype=torch.float32,
                 block_size=4, num_kv_blocks=512, use_tqdm=False)
    prompts = [build_prompt(r, base.tokenizer) for r in make_rooms(8, seed=5, prefix="eval")]
    params = SamplingParams(temperature=0, max_tokens=32)
    expected = [o.token_ids for o in base.generate(prompts, params)]
    first = [o for p in prompts for o in recent.generate([p], params)]
    assert [o.token_ids for o in first] == expected
    again = recent.generate([prompts[3]], params)[0]
    assert again.token_ids == expected[3]
    # its answer's words now come from the earlier answer (the opening "link" still from the prompt's examples)
    assert again.metrics.num_accepted_tokens >= first[3].metrics.num_accepted_tokens + 3
    assert again.metrics.num_accepted_tokens >= len(again.token_ids) // 2


def test_blocks_are_trimmed_after_each_verification(checkpoints):
    _, spec = engines(checkpoints["moe0"])
    prompt = repetitive_prompts(1, 120, seed=6)[0]
    spec.add_request(prompt, SamplingParams(temperature=0, max_tokens=30, ignore_eos=True))
    seq = next(iter(spec.core.requests.values())).seqs[0]
    while spec.has_unfinished_requests():
        spec.step()
        if not seq.is_finished:
            assert seq.num_draft_tokens == 0  # drafts never outlive their step
            assert seq.num_computed_tokens == len(seq.token_ids) - 1
            # the blocks its tokens need (the last one's slot may come with the next step), no more
            assert -(-seq.num_computed_tokens // 4) <= len(seq.block_table) <= -(-len(seq.token_ids) // 4)
    assert spec.stats()["kv_blocks_used"] == 0 and seq.num_accepted_tokens > 0
    # an abort between steps gives every block back
    rid = spec.add_request(prompt, SamplingParams(temperature=0, max_tokens=30, ignore_eos=True))
    for _ in range(4):
        spec.step()
    assert spec.abort(rid) and spec.stats()["kv_blocks_used"] == 0


def test_request_metrics_and_auto_off(checkpoints):
    path = checkpoints["moe0"]
    spec = LLM(path, dtype=torch.float32, block_size=4, num_kv_blocks=512, use_tqdm=False,
               speculative_config=dict(NGRAM, disable_by_batch_size=2))
    prompts = repetitive_prompts(4, 120, seed=8)
    params = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)
    spec.generate(prompts, params)  # 4 decoding sequences > 2: no speculation while they all run
    s = spec.stats()
    assert s["spec_disabled_steps"] > 0
    out = spec.generate(prompts[:1], params)[0]
    m = out.metrics
    assert m.num_spec_steps > 0 and m.num_draft_tokens >= m.num_accepted_tokens
    assert m.mean_acceptance_length == (m.num_accepted_tokens + m.num_spec_steps) / m.num_spec_steps


@pytest.mark.parametrize("value,message", [
    ({"method": "eagle", "num_speculative_tokens": 2}, "method must be one of"),
    ({"method": "ngram", "num_speculative_tokens": 0}, "num_speculative_tokens must be a positive integer"),
    ({"method": "ngram"}, "missing \\['num_speculative_tokens'\\]"),
    ({"method": "ngram", "num_speculative_tokens": 2, "prompt_lookup_min": 4, "prompt_lookup_max": 2},
     "prompt_lookup_min \\(4\\) must be <= prompt_lookup_max"),
    ({"method": "ngram", "num_speculative_tokens": 2, "lookahead": 3}, "unknown key\\(s\\) \\['lookahead'\\]"),
    ({"method": "draft_model", "num_speculative_tokens": 2}, "needs 'model'"),
    ({"method": "ngram", "num_speculative_tokens": 2, "lookup_recent_outputs": -1}, "must be an int >= 0"),
    ({"method": "draft_model", "num_speculative_tokens": 2, "model": "m", "lookup_recent_outputs": 4},
     "is for method 'ngram'"),
    ("{not json", "not valid JSON"),
    ([1, 2], "must be a JSON object"),
])
def test_bad_speculative_config_is_refused(value, message):
    with pytest.raises(EngineConfigError, match=message):
        SpeculativeConfig.parse(value)


def test_speculative_config_as_json_string_and_flag():
    from livemoe.engine.server.__main__ import parser

    args = parser().parse_args(["--model", "m", "--speculative-config", '{"method": "ngram", "num_speculative_tokens": 3}'])
    parsed = SpeculativeConfig.parse(args.speculative_config)
    assert parsed == SpeculativeConfig(method="ngram", num_speculative_tokens=3)


@pytest.mark.parametrize("core", ["thread", "process"])
def test_async_llm_streams_what_llm_gives_without_speculation(tmp_path, core):
    import asyncio

    from fixtures import collect_deltas, wait_idle
    from livemoe.engine.async_llm import AsyncLLM
    from tiny_tokenizer import make_text_checkpoint

    path, _ = make_text_checkpoint(tmp_path / "ckpt", moe=True)
    options = dict(dtype=torch.float32, device="cpu", block_size=4, num_kv_blocks=256, use_tqdm=False)
    prompts = [f"ab ab ab ab {i} cd cd cd" for i in range(4)]
    params = SamplingParams(temperature=0, max_tokens=20, ignore_eos=True)
    expected = LLM(path, **options).generate(prompts, params)
    engine = AsyncLLM(path, engine_core=core, speculative_config=NGRAM, **options)
    try:
        async def main():
            got = await asyncio.gather(*(collect_deltas(engine.generate(p, params)) for p in prompts))
            return got, await wait_idle(engine)

        results, stats = asyncio.run(main())
    finally:
        engine.shutdown()
    assert [(ids, text) for ids, text, _ in results] == [(o.token_ids, o.text) for o in expected]
    assert stats["spec_accepted_tokens"] > 0
    assert sum(d[-1].metrics.num_accepted_tokens for _, _, d in results) == stats["spec_accepted_tokens"]


def draft_engine(path, draft, **options):
    options = dict(dtype=torch.float32, block_size=4, num_kv_blocks=512, use_tqdm=False) | options
    return LLM(path, speculative_config={"method": "draft_model", "num_speculative_tokens": 3, "model": draft,
                                         "disable_by_batch_size": 64}, **options)


def test_draft_model_is_exact_and_a_self_draft_is_always_kept(checkpoints, tmp_path):
    path = checkpoints["moe0"]
    small, _ = make_checkpoint(tmp_path / "draft", moe=True, seed=0, num_hidden_layers=1)
    add_tokenizer(small)
    base, _ = engines(path)
    prompts = repetitive_prompts(7, 120, seed=9)
    greedy = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    expected = [o.token_ids for o in base.generate(prompts, greedy)]
    for draft in (path, small):  # the target drafting for itself, and a 1-layer random model
        spec = draft_engine(path, draft, num_kv_blocks=48, max_num_seqs=7)  # few blocks: preemption too
        assert [o.token_ids for o in spec.generate(prompts, greedy)] == expected
        s = spec.stats()
        assert s["kv_blocks_used"] == 0 and s["spec_drafted_tokens"] > 0
        if draft == path:  # its drafts are the target's own argmax: every one is kept
            assert s["spec_accepted_tokens"] == s["spec_drafted_tokens"]
    # sampled: the draft's q is the target's p (up to the chunk's rounding), so min(1, p/q) keeps nearly all
    spec = draft_engine(path, path)
    sampled = [SamplingParams(temperature=0.9, top_p=0.95, seed=i, max_tokens=24, ignore_eos=True) for i in range(7)]
    outs = spec.generate(prompts, sampled)
    s = spec.stats()
    assert s["spec_accepted_tokens"] >= 0.97 * s["spec_drafted_tokens"] > 0
    # and seeded sampling is reproducible
    assert [o.token_ids for o in spec.generate(prompts, sampled)] == [o.token_ids for o in outs]


def test_draft_model_with_another_vocabulary_or_tokenizer_is_refused(checkpoints, tmp_path):
    path = checkpoints["moe0"]
    other_vocab, _ = make_checkpoint(tmp_path / "v", moe=True, vocab_size=150)
    add_tokenizer(other_vocab, vocab_size=150)
    with pytest.raises(EngineConfigError, match="vocab_size 150, the target 131"):
        draft_engine(path, other_vocab)
    other_tokenizer, _ = make_checkpoint(tmp_path / "t", moe=True)
    add_tokenizer(other_tokenizer, vocab_size=100)
    with pytest.raises(EngineConfigError, match="another tokenizer"):
        draft_engine(path, other_tokenizer)


@pytest.mark.parametrize("temperature,top_p", [(1.0, 1.0), (0.7, 0.9)])
@pytest.mark.parametrize("method", ["ngram", "draft_model"])
def test_engine_samples_the_same_distribution_with_and_without_speculation(tmp_path, temperature, top_p, method):
    """1,500 seeded samples of 3 tokens each way on a 12-token vocabulary: the 2nd and 3rd tokens (drawn in
    verifications) have the same distribution (two-sample chi-square, p = 0.001: 31.3 for 11 degrees of freedom).
    ngram's drafts are mostly rejected here (the residual path), a self-draft's nearly all kept (the accept path)."""
    path, _ = make_checkpoint(tmp_path / "v12", moe=True, vocab_size=12)
    options = dict(dtype=torch.float32, block_size=4, num_kv_blocks=4096, max_num_seqs=2048, use_tqdm=False)
    spec_config = {"ngram": dict(NGRAM, prompt_lookup_min=1),
                   "draft_model": {"method": "draft_model", "num_speculative_tokens": 2, "model": path}}[method]
    base = LLM(path, **options)
    spec = LLM(path, speculative_config=dict(spec_config, disable_by_batch_size=4096), **options)
    prompt = list(range(12)) * 2 + [5, 6]  # every token occurs before: prompt lookup always drafts
    n = 1500

    def samples(llm, first_seed):
        params = [SamplingParams(temperature=temperature, top_p=top_p, seed=first_seed + i, max_tokens=3,
                                 ignore_eos=True) for i in range(n)]
        return torch.tensor([o.token_ids for o in llm.generate([prompt] * n, params)])

    a, b = samples(base, 0), samples(spec, n)
    s = spec.stats()
    assert s["spec_num_verifications"] >= 0.9 * n
    if method == "draft_model":
        assert s["spec_accepted_tokens"] > 0.9 * s["spec_drafted_tokens"]
    for position in (1, 2):
        x, y = torch.bincount(a[:, position], minlength=12).float(), torch.bincount(b[:, position], minlength=12).float()
        seen = (x + y) > 0
        stat = float(((x - y)[seen] ** 2 / (x + y)[seen]).sum())
        assert stat < 31.3, (position, x.tolist(), y.tolist())


def test_routed_experts_cover_the_kept_tokens_with_speculation(checkpoints):
    """return_routed_experts with ngram drafts: the array holds the routing of the tokens kept (rejected drafts'
    positions are overwritten later), equal to decoding without speculation."""
    import numpy as np

    base, spec = engines(checkpoints["moe0"])
    prompts = repetitive_prompts(4, 120, seed=10)
    params = SamplingParams(temperature=0, max_tokens=20, ignore_eos=True, return_routed_experts=True)
    a, b = base.generate(prompts, params), spec.generate(prompts, params)
    assert spec.stats()["spec_accepted_tokens"] > 0
    for x, y in zip(a, b):
        assert x.token_ids == y.token_ids
        ra, rb = x.outputs[0].routed_experts, y.outputs[0].routed_experts
        assert rb.shape == ra.shape == (len(x.prompt_token_ids) + len(x.token_ids) - 1, *ra.shape[1:])
        # a k+1-token chunk and a one-token decode may order a near-tie of router logits differently
        assert np.mean(np.sort(ra, -1) == np.sort(rb, -1)) > 0.99, np.mean(np.sort(ra, -1) == np.sort(rb, -1))


@pytest.mark.gpu
def test_cuda_verification_graphs_and_the_triton_rejection_sampler(checkpoints, monkeypatch):
    """On a GPU: verification steps replay CUDA graphs of their (sequences, tokens each) shape and give the greedy
    tokens of the eager speculative engine and of decoding without speculation, alone and 4 at once; a draft
    model's sampled drafts go through the Triton rejection sampler, keep nearly all of a self-draft's drafts, and the
    seeds reproduce them."""
    from livemoe.kernels import rejection_sampler

    path = checkpoints["moe0"]
    opts = dict(dtype=torch.float32, device="cuda", block_size=16, num_kv_blocks=256, max_num_seqs=4, use_tqdm=False)
    base = LLM(path, enforce_eager=True, **opts)
    eager = LLM(path, speculative_config=NGRAM, enforce_eager=True, **opts)
    graphed = LLM(path, speculative_config=NGRAM, **opts)
    prompts = repetitive_prompts(4, 120, seed=5)
    greedy = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    expected = [o.token_ids for o in base.generate(prompts, greedy)]
    for batch in (prompts[:1], prompts):
        want = expected[:len(batch)]
        assert [o.token_ids for o in eager.generate(batch, greedy)] == want
        assert [o.token_ids for o in graphed.generate(batch, greedy)] == want
    s = graphed.stats()
    assert s["num_verify_graph_replays"] > 0 and s["spec_accepted_tokens"] > 0, s
    assert eager.stats()["num_verify_graph_replays"] == 0

    calls = []
    kernel = rejection_sampler.rejection_sample

    def counted(*args):
        calls.append(args[0].device.type)
        return kernel(*args)

    monkeypatch.setattr(rejection_sampler, "rejection_sample", counted)
    spec = draft_engine(path, path, device="cuda", block_size=16, max_num_seqs=4)
    sampled = [SamplingParams(temperature=0.9, top_p=0.95, seed=i, max_tokens=24, ignore_eos=True) for i in range(4)]
    outs = spec.generate(prompts, sampled)
    s = spec.stats()
    assert calls and set(calls) == {"cuda"}
    assert s["spec_accepted_tokens"] >= 0.97 * s["spec_drafted_tokens"] > 0
    # a fresh engine (no prefix-cache hits: the prefill runs as before)
    again = draft_engine(path, path, device="cuda", block_size=16, max_num_seqs=4).generate(prompts, sampled)
    assert [o.token_ids for o in again] == [o.token_ids for o in outs]


def test_uniform_verification_steps_are_the_ones_given_to_graphs(checkpoints, monkeypatch):
    """The runner's choice of verification graph (CPU: the graph runs replaced by the eager forward): every step
    whose S sequences each verify q - 1 drafts goes to the (S, q) graph, S up to the batch where speculation turns
    off and q up to k + 1 (a prefill step of these longer prompts does not); the tokens stay those of decoding without
    speculation."""
    base, spec = engines(checkpoints["moe0"], max_num_seqs=3)
    runner = spec.core.runner
    monkeypatch.setattr(runner, "use_cuda_graphs", True)
    shapes, drafted = [], []
    monkeypatch.setattr(runner, "_run_decode_graph", runner._run_eager)
    monkeypatch.setattr(runner, "_run_verify_graph", lambda shape, *a: (shapes.append(shape), runner._run_eager(*a))[1])
    plan = runner.plan

    def recorded(out):
        p = plan(out)
        if not p.is_decode:
            drafted.append([s.num_draft_tokens for s in out.seqs] if all(s.num_draft_tokens for s in out.seqs) else None)
        return p

    monkeypatch.setattr(runner, "plan", recorded)
    assert runner.verify_graph_limits() == (3, NGRAM["num_speculative_tokens"] + 1)
    prompts = repetitive_prompts(3, 120, seed=4)
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    expected = [o.token_ids for o in base.generate(prompts, params)]
    assert [o.token_ids for o in spec.generate(prompts[:1], params)] + \
        [o.token_ids for o in spec.generate(prompts[1:], params)] == expected
    uniform = [(len(d), d[0] + 1) for d in drafted if d is not None and len(set(d)) == 1]
    assert uniform and shapes == uniform, (shapes, drafted)


def test_verification_graph_buffers_give_the_eager_hidden_states(checkpoints):
    """What a verification graph replays, run eagerly on the CPU: a real verification step (2 sequences of 5 tokens)
    copied into the graph's static buffers and run over the captured StepContext (static cu_seqlens, the upper
    bound for max_context_len) gives the eager forward's hidden states and K/V. Graph capture itself needs a GPU."""
    _, spec = engines(checkpoints["moe0"], max_num_seqs=2)
    core, runner = spec.core, spec.core.runner
    runner.use_cuda_graphs = True  # (only for verify_graph_shape; nothing here captures)
    params = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)
    for p in ([5, 6, 7, 8, 9, 5, 6, 7, 8, 9, 5, 6], [11, 12, 13, 14, 15, 11, 12, 13, 14, 15, 11]):
        spec.add_request(p, params)
    spec.step()  # prefill both
    for seq in core.scheduler.running:  # any 4 drafts (what is kept does not matter here)
        seq.add_drafts(seq.token_ids[:4])
    out = core.scheduler.schedule()
    assert [s.num_draft_tokens for s in out.seqs] == [4, 4]
    plan = runner.plan(out)
    assert runner.verify_graph_shape(plan) == (2, 5)
    input_ids, positions, ctx = runner.step_inputs(plan)
    with torch.inference_mode():
        cache_before = runner.kv_cache.clone()
        eager = runner._run_eager(input_ids, positions, ctx).clone()
        after_eager = runner.kv_cache.clone()
        runner.kv_cache.copy_(cache_before)
        runner.verify_vars = runner._verify_buffers(*runner.verify_graph_limits())
        runner._fill_verify_buffers(input_ids, positions, ctx)
        runner._forward_rows(runner.verify_vars, 10, runner._verify_graph_context((2, 5)))
        graphed = runner.verify_vars["hidden"][:10]
    assert torch.equal(graphed, eager)
    assert torch.equal(runner.kv_cache, after_eager)
    for seq in out.seqs:
        seq.drop_drafts()


@pytest.mark.skipif(not fused_decode.BUILT, reason="the C++ extension (livemoe._C) is not built")
@pytest.mark.parametrize("name", ["student", "moe0"])
def test_verification_takes_the_one_call_cpu_step_and_gives_the_modules_tokens(checkpoints, name, monkeypatch):
    """Every forward of a speculating engine on the CPU (prefill, decode, and the k+1-token verification) is one
    decode_step call; turning that path off (the modules) gives bitwise the same tokens and logprobs; and a
    verification that rejects drafts gives back the blocks its drafts' slots took."""
    _, spec = engines(checkpoints[name])
    prompts = repetitive_prompts(3, min(vocab_of(spec), 120), seed=11)
    params = SamplingParams(temperature=0, max_tokens=30, ignore_eos=True, logprobs=2)
    runner, bm, bs = spec.core.runner, spec.core.block_manager, 4
    verifying, fused_calls, forwards, held = [False], [], [0], [0]
    real_step, real_run = fused_decode.run_step, runner.run

    def run_step(call, input_ids, positions, step):
        fused_calls.append((verifying[0], input_ids.shape[1]))
        return real_step(call, input_ids, positions, step)

    def run(out):  # one sequence per step here
        verifying[0] = bool(out.seqs[0].num_draft_tokens)
        held[0] = len(out.seqs[0].block_table)  # with its drafts' slots
        forwards[0] += 1
        try:
            return real_run(out)
        finally:
            verifying[0] = False

    monkeypatch.setattr(fused_decode, "run_step", run_step)
    monkeypatch.setattr(runner, "run", run)
    fused, returned = [], 0
    for prompt in prompts:  # one at a time
        spec.add_request(prompt, params)
        seq = next(iter(spec.core.requests.values())).seqs[0]
        while spec.has_unfinished_requests():
            fused += [(o.outputs[0].token_ids, o.outputs[0].logprobs) for o in spec.step() if o.finished]
            if not seq.is_finished:
                # the committed tokens' blocks, no more (the last token's slot may come with the next step)
                assert len(seq.block_table) <= -(-len(seq.token_ids) // bs)
                assert bm.num_used_blocks == len(seq.block_table)
                returned += len(seq.block_table) < held[0]
        assert spec.stats()["kv_blocks_used"] == 0
    verify_calls = [n for v, n in fused_calls if v]
    assert len(fused_calls) == forwards[0], "a forward took the module path"
    assert verify_calls and max(verify_calls) == NGRAM["num_speculative_tokens"] + 1
    s = spec.stats()
    assert s["spec_accepted_tokens"] > 0 and s["spec_accepted_histogram"][0] > 0  # kept and rejected drafts
    assert returned > 0, "no rejected draft's block came back"

    monkeypatch.setattr(fused_decode, "ENABLED", False)
    fused_calls.clear()
    _, on_modules = engines(checkpoints[name])
    modules = [(o.outputs[0].token_ids, o.outputs[0].logprobs) for p in prompts for o in on_modules.generate([p], params)]
    assert not fused_calls
    assert [t for t, _ in fused] == [t for t, _ in modules]
    assert [lp for _, lp in fused] == [lp for _, lp in modules]  # the same kernels in the same order: bitwise
