"""stream(llm, ...) / LLM.stream: deltas joined equal generate()'s result (tokens and text, stop
strings and stop tokens, n > 1), the first token comes alone right after its step, characters split
over tokens never stream a U+FFFD, and closing the generator early frees the request's KV blocks."""
import pytest
import torch

from livemoe.engine.llm import LLM
from livemoe.engine.sampling.params import SamplingParams
from livemoe.engine.errors import RequestError
from livemoe.engine.text.streaming import merge_deltas, stream
from tiny_tokenizer import make_cycle_checkpoint, make_text_checkpoint

CYCLE_TEXT = "aé你b🙂界"


pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module")
def cycle(tmp_path_factory):
    return make_cycle_checkpoint(tmp_path_factory.mktemp("cycle") / "ckpt", CYCLE_TEXT)


@pytest.fixture(scope="module")
def text_ckpt(tmp_path_factory):
    return make_text_checkpoint(tmp_path_factory.mktemp("text") / "ckpt")


def engine(path, **options):
    return LLM(path, dtype=torch.float32, device="cpu", block_size=4, num_kv_blocks=128, use_tqdm=False, **options)


def joined(deltas, index=0):
    mine = [d for d in deltas if d.index == index]
    return [t for d in mine for t in d.token_ids], "".join(d.text for d in mine)


def test_split_characters_stream_without_replacement(cycle):
    path, tok, ids = cycle
    llm = engine(path)
    p = SamplingParams(temperature=0, max_tokens=3 * len(ids), ignore_eos=True)
    ref = llm.generate([ids], p)[0]
    assert ref.text == CYCLE_TEXT * 3  # the model repeats the text one byte token at a time
    deltas = list(stream(llm, ids, p))
    assert joined(deltas) == (ref.token_ids, ref.text)
    assert all(len(d.token_ids) == 1 for d in deltas)  # one delta per step: nothing is batched up
    assert not any("\ufffd" in d.text for d in deltas)
    assert [d.text for d in deltas[:7]] == ["a", "", "é", "", "", "你", "b"]
    assert deltas[-1].finish_reason == "length" and deltas[-1].metrics.num_output_tokens == len(ref.token_ids)
    assert all(d.finish_reason is None and d.metrics is None for d in deltas[:-1])


def test_stop_string_and_stop_token(cycle):
    path, tok, ids = cycle
    llm = engine(path)
    # a stop string made of two split characters: never streamed, the text ends before it
    p = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True, stop=["🙂界"])
    ref = llm.generate([ids], p)[0]
    deltas = list(stream(llm, ids, p))
    assert ref.text == "aé你b" and ref.finish_reason == "stop"
    assert joined(deltas) == (ref.token_ids, ref.text)
    assert deltas[-1].stop_reason == "🙂界"
    # a stop token: in the token ids, not in the text
    b = tok.convert_tokens_to_ids("b")
    p = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True, stop_token_ids=[b])
    ref = llm.generate([ids], p)[0]
    deltas = list(stream(llm, ids, p))
    assert ref.token_ids[-1] == b and ref.text == "aé你"
    assert joined(deltas) == (ref.token_ids, ref.text)


def test_random_model_streams_what_generate_gives(text_ckpt):
    path, tok = text_ckpt
    llm = engine(path)
    prompts = ["hello 你好", "live stream 🙂", "直播"]
    p = SamplingParams(temperature=0.9, seed=7, max_tokens=20, n=2, logprobs=1)
    refs = llm.generate(prompts, p)
    for prompt, ref in zip(prompts, refs):
        deltas = list(stream(llm, prompt, p))
        for c in ref.outputs:
            assert joined(deltas, c.index) == (c.token_ids, c.text)
            lps = [lp for d in deltas if d.index == c.index for lp in d.logprobs]
            # the same tokens; values to fp32 rounding (generate batched three prompts, stream runs one)
            assert [list(lp) for lp in lps] == [list(lp) for lp in c.logprobs]
            assert [v for lp in lps for v in lp.values()] == pytest.approx(
                [v for lp in c.logprobs for v in lp.values()], abs=1e-5)
        assert deltas[-1].metrics is not None and sum(d.metrics is not None for d in deltas) == 1


def test_closing_early_aborts_and_frees_blocks(text_ckpt):
    path, _ = text_ckpt
    llm = engine(path)
    gen = stream(llm, "a long answer", SamplingParams(max_tokens=100, ignore_eos=True))
    first = next(gen)
    assert len(first.token_ids) == 1 and llm.stats()["kv_blocks_used"] > 0
    gen.close()
    assert llm.stats()["kv_blocks_used"] == 0 and not llm.has_unfinished_requests()
    with pytest.raises(RequestError, match="empty"):
        next(llm.stream([], SamplingParams()))  # validated when iterated; nothing left queued
    assert not llm.has_unfinished_requests()


def test_llm_stream_with_other_requests_in_flight(text_ckpt):
    path, _ = text_ckpt
    llm = engine(path)
    p = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    expected = llm.generate(["other", "mine"], p)
    other = llm.add_request("other", p)
    got = joined(list(llm.stream("mine", p)))
    assert got == (expected[1].token_ids, expected[1].text)
    # the other request advanced meanwhile and its result is not lost
    done = [o for _ in range(20) for o in llm.step() if o.finished]
    assert [o.request_id for o in done] == [other] and done[0].token_ids == expected[0].token_ids


def test_merge_deltas_joins_what_piled_up(text_ckpt):
    path, _ = text_ckpt
    llm = engine(path)
    p = SamplingParams(temperature=1.0, seed=3, max_tokens=9, n=2, logprobs=0, ignore_eos=True)
    deltas = list(stream(llm, "merge me", p))
    merged = merge_deltas(deltas[:5]) + merge_deltas(deltas[5:])
    for i in (0, 1):
        assert joined(merged, i) == joined(deltas, i)
        assert [lp for d in merged if d.index == i for lp in d.logprobs] == \
            [lp for d in deltas if d.index == i for lp in d.logprobs]
    assert len(merged) == 4 and merged[-1].metrics is deltas[-1].metrics and merged[-1].finish_reason == "length"
    assert all(d.metrics is None for d in merged[:-1])
