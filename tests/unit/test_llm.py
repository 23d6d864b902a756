"""The decoder end to end on tiny random checkpoints (fp32, CPU): greedy tokens equal transformers'
generate; prefix caching, chunked prefill and preemption change no token; sampling, stops, n > 1,
logprobs, bad input, abort, the KV-cache lifetime, and the Triton path under the interpreter."""
import pytest
import torch

from livemoe.engine.errors import EngineConfigError, EngineDeadError
from livemoe.engine.llm import LLM
from livemoe.engine.model.loader import load_model
from livemoe.engine.sampling.params import SamplingParams
from livemoe.engine.errors import RequestError
from tiny_models import make_checkpoint

NEW = 24
GREEDY = SamplingParams(temperature=0, max_tokens=NEW, ignore_eos=True)


pytestmark = pytest.mark.usefixtures("one_thread")


def add_tokenizer(path, vocab_size=131):
    """A character-level tokenizer over the tiny vocabulary (ids 0-2 special), so text paths run."""
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {"<pad>": 0, "<s>": 1, "</s>": 2}
    for i in range(3, vocab_size):
        vocab[chr(ord("a") + i - 3) if i - 3 < 26 else chr(0x100 + i)] = i
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<pad>"))
    tok.pre_tokenizer = pre_tokenizers.Split(Regex("."), "isolated")
    tok.decoder = decoders.Fuse()
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="<pad>", bos_token="<s>", eos_token="</s>")
    fast.chat_template = ("{% for m in messages %}{{ m['content'] }}{% endfor %}"
                          "{% if add_generation_prompt %}z{% endif %}")
    fast.save_pretrained(path)


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    out = {}
    for moe in (False, True):
        path, hf = make_checkpoint(tmp_path_factory.mktemp("moe" if moe else "dense") / "ckpt", moe=moe)
        hf.generation_config.eos_token_id = None  # ignore_eos: transformers must not stop or mask EOS either
        add_tokenizer(path)
        out[moe] = (path, hf)
    return out


def prompts_with_shared_prefix():
    g = torch.Generator().manual_seed(0)
    prefix = torch.randint(3, 131, (37,), generator=g).tolist()  # long shared prefix: many blocks
    return ([prefix + torch.randint(3, 131, (k,), generator=g).tolist() for k in (1, 6, 13)]
            + [torch.randint(3, 131, (k,), generator=g).tolist() for k in (1, 9, 30)])


def hf_greedy(hf, prompt, n=NEW):
    out = hf.generate(torch.tensor([prompt]), max_new_tokens=n, do_sample=False)
    return out[0, len(prompt):].tolist()


# the Triton backend: compiled on a GPU where there is one, else on CPU tensors under the interpreter
TRITON_DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
triton_here = pytest.mark.triton  # skips where neither a GPU nor TRITON_INTERPRET=1 (set by conftest) is there


def engine(path, device="cpu", **options):
    options.setdefault("block_size", 4)
    options.setdefault("num_kv_blocks", 256)
    return LLM(path, dtype=torch.float32, device=device, **options)


@pytest.fixture(scope="module")
def reference(checkpoints):
    prompts = prompts_with_shared_prefix()
    return prompts, {moe: [hf_greedy(hf, p) for p in prompts] for moe, (_, hf) in checkpoints.items()}


@pytest.mark.parametrize("moe", [False, True], ids=["dense", "moe"])
def test_greedy_equals_transformers(checkpoints, reference, moe):
    prompts, expected = reference
    # a small token budget chunks the long prompts across steps while the short ones decode
    llm = engine(checkpoints[moe][0], max_num_batched_tokens=24)
    outs = llm.generate(prompts, GREEDY)
    for o, exp in zip(outs, expected[moe]):
        assert o.token_ids == exp
        assert o.finish_reason == "length" and len(o.token_ids) == NEW
    stats = llm.stats()
    assert stats["prefix_cache_hits"] > 0 and stats["kv_blocks_used"] == 0 and stats["num_requests"] == 0


def test_prefix_caching_on_off_and_repeat(checkpoints, reference):
    prompts, expected = reference
    path = checkpoints[True][0]
    off = engine(path, enable_prefix_caching=False).generate(prompts, GREEDY)
    llm = engine(path)
    first = llm.generate(prompts, GREEDY)
    hits1 = llm.stats()["prefix_cache_hits"]
    second = llm.generate(prompts, GREEDY)
    stats = llm.stats()
    assert [o.token_ids for o in off] == [o.token_ids for o in first] == [o.token_ids for o in second] == expected[True]
    assert hits1 > 0 and stats["prefix_cache_hit_rate"] > 0
    assert stats["prefix_cache_hits"] - hits1 > hits1  # the second run finds every prompt cached
    assert all(o.metrics.num_cached_tokens > 0 for o in second if len(o.prompt_token_ids) > 4)


def test_preemption_keeps_tokens(checkpoints, reference):
    prompts, expected = reference
    # 40 blocks of 4 = 160 tokens: the six sequences (up to ~75 tokens each) cannot all fit
    llm = engine(checkpoints[True][0], num_kv_blocks=40)
    outs = llm.generate(prompts, GREEDY)
    assert [o.token_ids for o in outs] == expected[True]
    assert llm.stats()["num_preemptions"] > 0
    assert sum(o.metrics.num_preemptions for o in outs) > 0


def test_seeded_sampling_reproducible_across_batches(checkpoints):
    path = checkpoints[True][0]
    p = SamplingParams(temperature=1.0, top_p=0.9, seed=1234, max_tokens=12, ignore_eos=True)
    alone = engine(path).generate([[5, 6, 7]], p)[0].token_ids
    others = [[9] * 20, [11, 12], [40, 41, 42, 43]]
    mixed = engine(path).generate(others[:2] + [[5, 6, 7]] + others[2:],
                                  [SamplingParams(temperature=1.0, max_tokens=7)] * 2 + [p]
                                  + [SamplingParams(temperature=0.7, max_tokens=5)])
    assert mixed[2].token_ids == alone
    other_seed = engine(path).generate([[5, 6, 7]], SamplingParams(temperature=1.0, top_p=0.9, seed=99,
                                                                   max_tokens=12, ignore_eos=True))
    assert other_seed[0].token_ids != alone


def test_n_greater_than_one(checkpoints):
    path = checkpoints[True][0]
    p = SamplingParams(temperature=1.0, n=3, seed=5, max_tokens=10, ignore_eos=True)
    out = engine(path).generate([[3, 4, 5, 6]], p)[0]
    assert [c.index for c in out.outputs] == [0, 1, 2]
    assert len({tuple(c.token_ids) for c in out.outputs}) == 3
    again = engine(path).generate([[3, 4, 5, 6]], p)[0]
    assert [c.token_ids for c in again.outputs] == [c.token_ids for c in out.outputs]
    assert out.metrics.num_output_tokens == 30
    greedy = engine(path).generate([[3, 4, 5, 6]], SamplingParams(temperature=0, n=2, max_tokens=6))[0]
    assert greedy.outputs[0].token_ids == greedy.outputs[1].token_ids


def test_stop_strings_and_ids(checkpoints):
    path = checkpoints[False][0]
    llm = engine(path)
    base = llm.generate(["hello"], GREEDY)[0]
    assert base.text and len(base.token_ids) == NEW
    # a stop id: the output ends at its first occurrence, the token kept in token_ids, not in text
    stop_id = base.token_ids[6]
    first = base.token_ids.index(stop_id)
    out = llm.generate(["hello"], SamplingParams(temperature=0, max_tokens=NEW, ignore_eos=True,
                                                 stop_token_ids=[stop_id]))[0]
    assert out.token_ids == base.token_ids[:first + 1]
    assert out.finish_reason == "stop" and out.stop_reason == stop_id
    assert out.text == llm.tokenizer.decode(base.token_ids[:first], skip_special_tokens=True)
    # a stop string: the text ends before it
    stop = base.text[8:10]
    cut = base.text.index(stop)
    out = llm.generate(["hello"], SamplingParams(temperature=0, max_tokens=NEW, ignore_eos=True, stop=[stop]))[0]
    assert out.text == base.text[:cut] and out.finish_reason == "stop" and out.stop_reason == stop
    assert out.token_ids == base.token_ids[:len(out.token_ids)] and len(out.token_ids) < NEW
    # EOS stops unless ignore_eos
    eos_prompt_out = llm.generate(["hello"], SamplingParams(temperature=0, max_tokens=NEW, stop_token_ids=[2]))[0]
    assert eos_prompt_out.token_ids == base.token_ids[:len(eos_prompt_out.token_ids)]


def test_text_prompt_and_chat(checkpoints):
    llm = engine(checkpoints[False][0])
    ids = llm.tokenizer.encode("abc")
    by_text = llm.generate("abc", GREEDY)[0]
    by_ids = llm.generate([ids], GREEDY)[0]
    assert by_text.token_ids == by_ids.token_ids and by_text.prompt == "abc"
    chat = llm.chat([{"role": "user", "content": "ab"}], GREEDY)[0]
    assert chat.prompt_token_ids == llm.tokenizer.encode("abz")


def test_logprobs_match_model_recomputation(checkpoints):
    """Raw logprobs are what a trainer recomputes from the same weights (fp32: tight tolerance)."""
    path, _ = checkpoints[True]
    llm = engine(path, max_num_batched_tokens=8)
    prompt = [7, 8, 9, 10, 11, 12, 13, 14, 15, 16, 17]
    p = SamplingParams(temperature=0.8, top_k=20, seed=3, max_tokens=10, ignore_eos=True, logprobs=2)
    out = llm.generate([prompt], p)[0]
    model = load_model(path, dtype=torch.float32, device="cpu")
    with torch.no_grad():
        logits = model(torch.tensor([prompt + out.token_ids]))[0, len(prompt) - 1:-1]
    expect = (logits / 0.8).log_softmax(-1)
    got = torch.tensor(out.outputs[0].token_logprobs)
    torch.testing.assert_close(got, expect.gather(1, torch.tensor(out.token_ids)[:, None])[:, 0], atol=1e-5, rtol=0)
    for lp, row in zip(out.logprobs, expect):
        assert len(lp) <= 3
        top = row.topk(2)
        for t, v in zip(top.indices.tolist(), top.values.tolist()):
            assert lp[t] == pytest.approx(v, abs=1e-5)


def test_bad_input_rejected_and_engine_keeps_serving(checkpoints, reference):
    prompts, expected = reference
    path = checkpoints[True][0]
    llm = engine(path, max_model_len=100)
    good = llm.add_request(prompts[0], GREEDY)
    llm.step()
    bad = [
        ([], GREEDY, "empty"),
        ([5] * 100, GREEDY, "context"),
        ([5, 131], GREEDY, "vocabulary"),
        ([5, -1], GREEDY, r"\[0, 131\)"),
        (["x"], GREEDY, "integers"),
        ([1, 2], "greedy", "SamplingParams"),
        (3.5, GREEDY, "string or a list"),
        ([5], SamplingParams(stop_token_ids=[500]), "stop_token_ids"),
    ]
    for prompt, params, words in bad:
        with pytest.raises(RequestError, match=words):
            llm.add_request(prompt, params)
    with pytest.raises(RequestError, match="already in flight"):
        llm.add_request([5], GREEDY, request_id=good)
    with pytest.raises(RequestError, match="KV cache"):
        engine(path, num_kv_blocks=4).add_request([5] * 10, GREEDY)
    with pytest.raises(RequestError):
        llm.generate([prompts[1], []], GREEDY)  # validated up front: nothing was queued
    with pytest.raises(EngineConfigError, match="block_size"):
        engine(path, block_size=3)
    with pytest.raises(EngineConfigError, match="unknown engine option"):
        engine(path, max_num_seq=3)
    done = None
    while llm.has_unfinished_requests():
        for o in llm.step():
            if o.finished:
                done = o
    assert done.request_id == good and done.token_ids == expected[True][0]


def test_no_tokenizer(checkpoints, tmp_path):
    path, _ = make_checkpoint(tmp_path / "bare", moe=False)
    llm = engine(path)
    assert llm.tokenizer is None
    with pytest.raises(RequestError, match="tokenizer"):
        llm.generate("abc")
    with pytest.raises(RequestError, match="stop strings"):
        llm.generate([[4, 5]], SamplingParams(stop=["x"]))
    out = llm.generate([[4, 5]], SamplingParams(max_tokens=3, ignore_eos=True))[0]
    assert len(out.token_ids) == 3 and out.text == ""


def test_add_step_abort_frees_blocks(checkpoints):
    llm = engine(checkpoints[True][0])
    a = llm.add_request([3] * 30, SamplingParams(max_tokens=50, ignore_eos=True))
    b = llm.add_request([4] * 10, SamplingParams(temperature=0, max_tokens=5, ignore_eos=True))
    seen = []
    for _ in range(3):
        seen += llm.step()
    for o in seen:  # in-flight text: the decode of the tokens so far, up to its last complete character
        full = llm.tokenizer.decode(o.token_ids, skip_special_tokens=True)
        assert full.startswith(o.text) and set(full[len(o.text):]) <= {"\ufffd"}, (o.text, full)
    assert any(o.text for o in seen)
    assert llm.stats()["kv_blocks_used"] > 0
    assert llm.abort(a) and not llm.abort(a)
    while llm.has_unfinished_requests():
        seen += llm.step()
    assert llm.stats()["kv_blocks_used"] == 0
    final = [o for o in seen if o.finished]
    assert [o.request_id for o in final] == [b] and len(final[0].token_ids) == 5
    # a caller's own id that the counter will reach next: generated ids step around it
    mine = llm.add_request([6] * 4, SamplingParams(max_tokens=2, ignore_eos=True), request_id=str(int(b) + 1))
    outs = llm.generate([[7] * 3, [8] * 3], SamplingParams(max_tokens=2, ignore_eos=True))
    assert mine not in {o.request_id for o in outs} and len({o.request_id for o in outs}) == 2
    assert final[0].metrics.ttft > 0 and final[0].metrics.tpot > 0 and final[0].metrics.decode_flops > 0


def test_from_model_shares_weights_and_kv_cache_release(checkpoints):
    path, _ = checkpoints[True]
    model = load_model(path, dtype=torch.float32, device="cpu")
    model.train()
    llm = LLM.from_model(model, None, block_size=4, num_kv_blocks=64)
    prompt = [[3, 4, 5, 6, 7, 8, 9, 10, 11]]
    before = llm.generate(prompt, GREEDY)[0].token_ids
    assert model.training  # the engine restores the caller's mode
    with llm.kv_cache_released():
        assert llm.core.runner.kv_cache is None
        # plain (training) path still works while the decoder holds no cache
        assert model(torch.tensor(prompt)).shape == (1, 9, 131)
        with torch.no_grad():
            for p in model.parameters():
                p.mul_(1.5)  # an optimizer step, in place: the engine sees it without a copy
    after = llm.generate(prompt, GREEDY)[0].token_ids
    assert after != before
    # weights change while the cache is kept: cached prefixes are dropped, not reused
    resets = llm.core.num_prefix_cache_resets
    with torch.no_grad():
        for p in model.parameters():
            p.div_(1.5)
    again = llm.generate(prompt, GREEDY)[0].token_ids
    assert llm.core.num_prefix_cache_resets == resets + 1 and again == before
    llm.add_request(prompt[0], GREEDY)
    with pytest.raises(RuntimeError, match="in flight"):
        llm.release_kv_cache()


def test_close_aborts_frees_the_cache_and_refuses_new_requests(checkpoints):
    llm = engine(checkpoints[True][0])
    llm.add_request([3] * 6, SamplingParams(max_tokens=20, ignore_eos=True))
    llm.step()
    llm.close()
    assert llm.core.runner.kv_cache is None and not llm.has_unfinished_requests()
    with pytest.raises(EngineDeadError, match="closed"):
        llm.generate([[3, 4]], GREEDY)
    llm.close()  # a second close does nothing


@pytest.mark.gpu
def test_a_closed_engine_gives_its_memory_to_the_next(checkpoints):
    # each engine sizes its cache from the memory in use: without the close freeing it, the second engine
    # found no room for one block (bench_tp's first H200 run)
    path = checkpoints[True][0]
    for _ in range(2):
        llm = LLM(path, dtype=torch.float32, device="cuda", gpu_memory_utilization=0.85)
        assert llm.generate([[3, 4, 5]], GREEDY)[0].token_ids
        llm.close()


@triton_here
def test_triton_backend_matches_transformers(checkpoints, reference):
    prompts, expected = reference
    llm = engine(checkpoints[True][0], TRITON_DEVICE, attention_backend="triton", block_size=16, num_kv_blocks=32)
    outs = llm.generate([prompts[0], prompts[4]], SamplingParams(temperature=0, max_tokens=6, ignore_eos=True))
    assert outs[0].token_ids == expected[True][0][:6] and outs[1].token_ids == expected[True][4][:6]


@pytest.mark.gpu
def test_cuda_graph_decode_matches_eager(checkpoints, reference):
    prompts, _ = reference
    path = checkpoints[True][0]
    eager_llm = LLM(path, dtype=torch.float32, device="cuda", enforce_eager=True, num_kv_blocks=64)
    eager = eager_llm.generate(prompts, GREEDY)
    llm = LLM(path, dtype=torch.float32, device="cuda", num_kv_blocks=64, max_num_seqs=4, max_graph_batch_size=4)
    graphed = llm.generate(prompts, GREEDY)
    assert [o.token_ids for o in graphed] == [o.token_ids for o in eager]
    assert llm.stats()["num_graph_replays"] > 0 and llm.stats()["num_eager_fallbacks"] == 0


@pytest.mark.parametrize("backend,block_size", [("reference", 4), pytest.param("triton", 16, marks=triton_here)])
def test_padded_decode_rows_as_in_cuda_graphs(checkpoints, backend, block_size):
    """A decode step padded the way a CUDA graph of a larger batch runs it (slot -1, context 0) gives
    the real rows the same hidden states and stores nothing for the padding. Graph capture itself
    needs a GPU; this checks everything the graph replays."""
    device = TRITON_DEVICE if backend == "triton" else "cpu"
    llm = engine(checkpoints[True][0], device, attention_backend=backend, block_size=block_size, num_kv_blocks=16)
    for p in ([3, 4, 5, 6, 7], [8, 9, 10]):
        llm.add_request(p, SamplingParams(temperature=0, max_tokens=4, ignore_eos=True))
    llm.step()  # prefill both
    runner, sched = llm.core.runner, llm.core.scheduler
    out = sched.schedule()
    assert out.is_decode_only and len(out.seqs) == 2
    input_ids, positions, ctx, *_ = runner.prepare(out)
    with torch.inference_mode():
        cache_before = runner.kv_cache.clone()
        eager = runner._run_eager(input_ids, positions, ctx).clone()
        after_eager = runner.kv_cache.clone()
        runner.kv_cache.copy_(cache_before)
        runner.graph_vars = runner._graph_buffers(4)
        runner._fill_graph_buffers(input_ids, positions, ctx, 4)
        runner._graph_forward(4)
        padded = runner.graph_vars["hidden"]
    torch.testing.assert_close(padded[:2], eager, atol=1e-5, rtol=1e-5)
    assert torch.isfinite(padded).all()
    # the real rows' K/V agree (a batch of 4 may round differently than one of 2) ...
    torch.testing.assert_close(runner.kv_cache, after_eager, atol=1e-5, rtol=1e-5)
    # ... and every other slot is untouched: the padding rows stored nothing
    def flat(c):  # [2, layers, slots, Hkv, D]
        return c.flatten(2, 3)

    others = torch.ones(flat(cache_before).shape[2], dtype=torch.bool, device=cache_before.device)
    others[ctx.slot_mapping] = False
    assert torch.equal(flat(runner.kv_cache)[:, :, others], flat(cache_before)[:, :, others])

