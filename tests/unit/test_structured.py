"""Structured output and logits processing in the engine: grammar-constrained requests (JSON schema,
json_object, regex, choice, EBNF) in a continuous batch with unconstrained ones, whose tokens stay
exactly what they are alone; the matcher's advance/rollback; bad specs refused; penalties, logit_bias
and min_tokens equal a plain PyTorch reference of vLLM's formulas."""
import json
import re
from types import SimpleNamespace

import pytest
import torch

jsonschema = pytest.importorskip("jsonschema", reason="needs jsonschema (pip install -e .[test])")
pytest.importorskip("xgrammar", reason="needs xgrammar (a runtime dependency: pip install -e .)")

from livemoe.engine.llm import LLM  # noqa: E402
from livemoe.engine.sampling.sampler import Sampler  # noqa: E402
from livemoe.engine.sampling.params import SamplingParams  # noqa: E402
from livemoe.engine.errors import RequestError  # noqa: E402
from livemoe.engine.sampling.structured import StructuredOutput, tool_call_schema  # noqa: E402
from tiny_tokenizer import byte_token_ids, make_text_checkpoint  # noqa: E402

pytestmark = pytest.mark.usefixtures("one_thread")

SCHEMA = {
    "type": "object",
    "properties": {
        "action": {"type": "string", "enum": ["reply", "ignore", "escalate"]},
        "count": {"type": "integer", "minimum": 0, "maximum": 99},
        "flags": {"type": "array", "items": {"type": "boolean"}, "minItems": 1, "maxItems": 3},
        "target": {"type": "object", "properties": {"name": {"type": "string", "maxLength": 6}},
                   "required": ["name"], "additionalProperties": False},
    },
    "required": ["action", "count", "flags", "target"],
    "additionalProperties": False,
}


@pytest.fixture(scope="module")
def llm(tmp_path_factory):
    path, tok = make_text_checkpoint(tmp_path_factory.mktemp("structured") / "ckpt", moe=True)
    return LLM(path, dtype=torch.float32, device="cpu", block_size=16, num_kv_blocks=256, max_model_len=512,
               use_tqdm=False)


def test_json_schema_outputs_validate(llm):
    prompts = [f"request {i}: {'x' * i}" for i in range(12)]
    params = [SamplingParams(temperature=1.0, seed=i, max_tokens=160, structured=StructuredOutput(json=SCHEMA))
              for i in range(len(prompts))]
    outs = llm.generate(prompts, params)
    assert len(outs) == len(prompts)
    for o in outs:
        assert o.finish_reason == "stop" and o.stop_reason in llm.core.eos_token_ids, o.text
        jsonschema.validate(json.loads(o.text), SCHEMA)
    assert len({o.text for o in outs}) > 1  # sampled, not one forced string


@pytest.mark.parametrize("spec,check", [
    (StructuredOutput(regex=r"[a-z]{3}-\d{2}"), lambda t: re.fullmatch(r"[a-z]{3}-\d{2}", t)),
    (StructuredOutput(choice=["yes", "no way", "你好 🙂"]), lambda t: t in ("yes", "no way", "你好 🙂")),
    (StructuredOutput(grammar='root ::= "(" [0-9]{1,3} ("+" [0-9]{1,3})? ")"'),
     lambda t: re.fullmatch(r"\(\d{1,3}(\+\d{1,3})?\)", t)),
])
def test_regex_choice_grammar(llm, spec, check):
    outs = llm.generate([f"q{i}" for i in range(6)],
                        [SamplingParams(temperature=1.0, seed=i, max_tokens=40, structured=spec) for i in range(6)])
    assert len(outs) == 6
    for o in outs:
        assert o.finish_reason == "stop" and check(o.text), o.text


def test_json_object_parses(llm):
    tok = llm.tokenizer
    # the random model rarely closes a string by itself: favour '"' and '}' so outputs end in time
    bias = {t: 6.0 for t in byte_token_ids(tok, '"}')}
    outs = llm.generate([f"j{i}" for i in range(6)], [
        SamplingParams(temperature=1.0, seed=i, max_tokens=120, logit_bias=bias,
                       structured=StructuredOutput(json_object=True)) for i in range(6)])
    assert len(outs) == 6
    for o in outs:
        assert o.finish_reason == "stop", o.text
        assert isinstance(json.loads(o.text), dict)


def test_constrained_request_leaves_batch_neighbours_unchanged(llm):
    prompts = ["hello there", "the quick brown fox", "你好世界", "numbers 0123"]
    plain = [SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True),
             SamplingParams(temperature=0.8, seed=7, max_tokens=12, ignore_eos=True),
             SamplingParams(temperature=1.0, seed=9, top_k=20, max_tokens=12, ignore_eos=True, logprobs=2)]
    alone = [llm.generate(prompts[i], plain[i])[0] for i in range(3)]
    constrained = SamplingParams(temperature=1.0, seed=1, max_tokens=160, structured=StructuredOutput(json=SCHEMA))
    mixed = llm.generate(prompts, plain + [constrained])
    assert len(mixed) == 4
    for a, m in zip(alone, mixed[:3]):
        assert a.token_ids == m.token_ids and len(a.token_ids) == 12
    for a_lp, m_lp in zip(alone[2].logprobs, mixed[2].logprobs):
        assert a_lp.keys() == m_lp.keys() and all(abs(a_lp[k] - m_lp[k]) < 1e-5 for k in a_lp)
    jsonschema.validate(json.loads(mixed[3].text), SCHEMA)


def test_rollback_restores_the_matcher(llm):
    state = llm.core.input_processor.grammars().state(StructuredOutput(choice=["abc", "abd"]))
    ids = byte_token_ids(llm.tokenizer, "ab")
    V = llm.core.vocab_size
    mask = torch.zeros(1, (V + 31) // 32, dtype=torch.int32)
    state.fill(mask, 0)
    before = mask.clone()
    state.advance(ids)
    state.fill(mask, 0)
    assert not torch.equal(mask, before)
    state.rollback(len(ids))
    state.fill(mask, 0)
    assert torch.equal(mask, before) and state.num_tokens == 0


@pytest.mark.parametrize("spec,needle", [
    (StructuredOutput(json={"type": "nonsense"}), "invalid json"),
    (StructuredOutput(regex="[a-"), "invalid regex"),
    (StructuredOutput(grammar="root ::= undefined_rule"), "invalid grammar"),
])
def test_bad_spec_is_refused(llm, spec, needle):
    with pytest.raises(RequestError, match=needle):
        llm.generate("x", SamplingParams(max_tokens=4, structured=spec))
    assert not llm.core.requests


def test_spec_validation():
    with pytest.raises(RequestError, match="exactly one"):
        StructuredOutput(regex="a", choice=["b"])
    with pytest.raises(RequestError, match="exactly one"):
        StructuredOutput()
    with pytest.raises(RequestError, match="not valid JSON"):
        StructuredOutput(json="{oops")
    with pytest.raises(RequestError, match="ignore_eos"):
        SamplingParams(structured=StructuredOutput(regex="a"), ignore_eos=True)
    with pytest.raises(RequestError, match="min_tokens"):
        SamplingParams(structured=StructuredOutput(choice=["yes"]), min_tokens=3)
    with pytest.raises(RequestError, match="logit_bias"):
        SamplingParams(logit_bias={3: 101.0})
    with pytest.raises(RequestError, match="min_tokens"):
        SamplingParams(min_tokens=5, max_tokens=4)
    with pytest.raises(RequestError, match="repetition_penalty"):
        SamplingParams(repetition_penalty=0.0)
    with pytest.raises(RequestError, match="presence_penalty"):
        SamplingParams(presence_penalty=2.5)
    assert tool_call_schema([{"name": "f"}])["properties"]["name"] == {"const": "f"}


def test_tool_call_grammar(llm):
    fn = {"name": "lookup", "parameters": {"type": "object",
                                           "properties": {"id": {"type": "integer", "minimum": 0, "maximum": 999}},
                                           "required": ["id"], "additionalProperties": False}}
    outs = llm.generate(["t0", "t1"], [SamplingParams(temperature=1.0, seed=i, max_tokens=80,
                                                      structured=StructuredOutput(tool_call=[fn]))
                                       for i in range(2)])
    for o in outs:
        m = re.fullmatch(r"<tool_call>\n(.*)\n</tool_call>", o.text, re.S)
        assert m and o.finish_reason == "stop", o.text
        call = json.loads(m.group(1))
        assert call["name"] == "lookup"
        jsonschema.validate(call["arguments"], fn["parameters"])


NODE = {"$defs": {"node": {"type": "object", "properties": {"v": {"type": "integer", "minimum": 0, "maximum": 9},
                                                          "next": {"$ref": "#/$defs/node"}},
                          "required": ["v"], "additionalProperties": False}}, "$ref": "#/$defs/node"}
TREE = {"type": "object", "properties": {"kids": {"type": "array", "maxItems": 2, "items": {"$ref": "#"}}},
        "additionalProperties": False}


def test_recursive_defs_are_accepted_in_tool_parameters_as_in_response_format(llm):
    """A schema with recursive $defs (or a `#` self-reference) compiles as response_format, so it must as a tool's
    parameters too: the call schema moves each function's definitions to its root (it was refused: `Cannot find
    field '$defs'`), and the calls made validate against the function's own schema."""
    llm.compile_grammar(StructuredOutput(json=NODE))
    fns = [{"name": "walk", "parameters": NODE}, {"name": "grow", "parameters": TREE}]
    outs = llm.generate(["r0", "r1", "r2"], [SamplingParams(temperature=1.0, seed=i, max_tokens=120,
                                                            structured=StructuredOutput(tool_call=fns))
                                             for i in range(3)])
    parsed = 0
    for o in outs:
        m = re.fullmatch(r"<tool_call>\n(.*)\n</tool_call>", o.text, re.S)
        if m is None:  # cut by max_tokens (a recursion may run long): still a prefix of a call
            assert o.finish_reason == "length", o.text
            continue
        call = json.loads(m.group(1))
        jsonschema.validate(call["arguments"], {"walk": NODE, "grow": TREE}[call["name"]])
        parsed += 1
    assert parsed >= 1


# -- penalties, logit_bias, min_tokens against a plain reference ------------------------------------


def reference_processed(logits, prompt, output, p: SamplingParams, eos):
    """vLLM's definitions, one token at a time."""
    x = logits.clone()
    if len(output) < p.min_tokens:
        for t in set(eos) | set(p.stop_token_ids):
            x[t] = float("-inf")
    for t, b in (p.logit_bias or {}).items():
        x[t] += b
    for t in set(prompt) | set(output):
        x[t] = x[t] / p.repetition_penalty if x[t] > 0 else x[t] * p.repetition_penalty
    for t in set(output):
        x[t] -= p.frequency_penalty * output.count(t) + p.presence_penalty
    return x


def test_penalties_and_bias_equal_reference():
    torch.manual_seed(0)
    V, eos = 50, [2]
    params = [
        SamplingParams(temperature=0.0, logprobs=3, logprobs_mode="processed"),  # untouched row
        SamplingParams(temperature=0.0, repetition_penalty=1.7, logprobs=3, logprobs_mode="processed"),
        SamplingParams(temperature=0.0, frequency_penalty=0.9, presence_penalty=-0.4, logprobs=3,
                       logprobs_mode="processed"),
        SamplingParams(temperature=0.0, logit_bias={5: 30.0, 7: -100.0}, min_tokens=4, stop_token_ids=[9],
                       repetition_penalty=0.6, frequency_penalty=-1.5, presence_penalty=2.0, logprobs=3,
                       logprobs_mode="processed"),
    ]
    prompts = [[1, 3, 3, 8], [4, 4, 4, 12, 7], [0, 9], [11, 12, 7, 9]]
    outputs = [[5, 6], [4, 13, 13, 40], [9, 9, 9, 17, 2], [7, 7, 1]]
    seqs = [SimpleNamespace(token_ids=a + b, num_prompt_tokens=len(a), grammar=None) for a, b in zip(prompts, outputs)]
    logits = torch.randn(4, V) * 3
    res = Sampler(eos_token_ids=eos)(logits, params, [None] * 4, seqs)
    assert len(res.token_ids) == 4
    for i, p in enumerate(params):
        ref = reference_processed(logits[i], prompts[i], outputs[i], p, eos)
        assert res.token_ids[i] == int(ref.argmax())
        lp = ref.log_softmax(-1)
        assert res.logprobs[i].keys() >= set(lp.topk(3).indices.tolist())
        for t, v in res.logprobs[i].items():
            assert v == pytest.approx(float(lp[t]), abs=1e-5)
    assert res.token_ids[3] == 5  # the +30 bias wins
    # raw logprobs ignore the processing (what a trainer recomputes from the weights)
    raw = Sampler(eos_token_ids=eos)(logits[1:2], [SamplingParams(temperature=0.0, repetition_penalty=1.7, logprobs=0)],
                                     [None], seqs[1:2])
    assert raw.logprobs[0][raw.token_ids[0]] == pytest.approx(float(logits[1].log_softmax(-1)[raw.token_ids[0]]))


def test_min_tokens_and_penalties_in_the_engine(llm):
    eos = next(iter(llm.core.eos_token_ids))
    bias = {eos: 100.0}  # EOS would come first, but min_tokens bans it until 5 tokens exist
    out = llm.generate("hi", SamplingParams(temperature=0.0, max_tokens=20, min_tokens=5, logit_bias=bias))[0]
    assert len(out.token_ids) == 6 and out.token_ids[-1] == eos and out.finish_reason == "stop"
    assert eos not in out.token_ids[:5]
    plain = llm.generate("hi there", SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True))[0]
    penal = llm.generate("hi there", SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True,
                                                    presence_penalty=2.0, frequency_penalty=2.0))[0]
    assert len(set(penal.token_ids)) > len(set(plain.token_ids))  # repeats are discouraged


def test_chat_with_tools_returns_parsed_calls(llm):
    fn = {"name": "lookup", "parameters": {"type": "object", "properties": {"field": {"enum": ["price", "stock"]}},
                                           "required": ["field"], "additionalProperties": False}}
    tools = [{"type": "function", "function": fn}, {"type": "function", "function": {"name": "other"}}]
    msgs = [{"role": "user", "content": "price?"}]
    for choice in ("required", "lookup"):
        outs = llm.chat([msgs, msgs], SamplingParams(temperature=1.0, seed=4, max_tokens=80), tools=tools,
                        tool_choice=choice)
        assert len(outs) == 2
        for o in outs:
            calls = o.outputs[0].tool_calls
            assert o.finish_reason == "stop" and len(calls) == 1, o.text
            if choice == "lookup" or calls[0]["name"] == "lookup":
                assert calls[0]["name"] == "lookup"
                jsonschema.validate(json.loads(calls[0]["arguments"]), fn["parameters"])
    auto = llm.chat(msgs, SamplingParams(temperature=0.0, max_tokens=8), tools=tools)[0]
    assert auto.outputs[0].tool_calls == [] and auto.outputs[0].text  # the random model calls nothing
    with pytest.raises(RequestError, match="tool_choice"):
        llm.chat(msgs, tools=tools, tool_choice="missing")
    with pytest.raises(RequestError, match="needs tools"):
        llm.chat(msgs, tool_choice="required")


def think_checkpoint(path):
    """A tiny random MoE whose tokenizer has <think> and </think> as single tokens, as Qwen3's does."""
    from tiny_models import hf_model
    from tiny_tokenizer import train_tokenizer

    tok = train_tokenizer()
    tok.add_tokens(["<think>", "</think>"])
    hf_model(True, 0, vocab_size=len(tok)).save_pretrained(path)
    tok.save_pretrained(path)
    return str(path), tok


def test_grammar_applies_after_the_think_block(tmp_path):
    from livemoe.engine.text.reasoning import split_reasoning, think_token_ids

    path, tok = think_checkpoint(tmp_path / "think")
    llm = LLM(path, dtype=torch.float32, device="cpu", block_size=16, num_kv_blocks=128, use_tqdm=False)
    start, end = think_token_ids(tok)
    spec = StructuredOutput(regex="[a-z]{1,8}", think_tokens=(start, end))
    # the random model rarely writes </think>: a bias brings it after a few free tokens
    outs = llm.generate([f"question {i}" for i in range(8)], [
        SamplingParams(temperature=1.0, seed=i, max_tokens=100, logit_bias={end: 4.0}, structured=spec)
        for i in range(8)])
    assert len(outs) == 8
    reasonings = []
    for o in outs:
        assert end in o.token_ids and o.finish_reason == "stop", o.text
        reasoning, content = split_reasoning("deepseek_r1", o.text)
        assert re.fullmatch("[a-z]{1,8}", content), o.text
        reasonings.append(reasoning or "")
    assert any(not re.fullmatch("[a-z]*", r) for r in reasonings)  # the think block was not constrained
    # a prompt that closed its think block (thinking turned off): constrained from the first token
    closed = tok.encode("question<think>\n\n</think>\n\n")
    assert closed.count(end) == 1
    for seed in range(4):
        o = llm.generate(closed, SamplingParams(temperature=1.0, seed=seed, max_tokens=20, structured=spec))[0]
        assert re.fullmatch("[a-z]{1,8}", o.text) and o.finish_reason == "stop", o.text


def test_n_samples_and_async_llm_constrained(llm):
    import asyncio

    from livemoe.engine.async_llm import AsyncLLM

    out = llm.generate("n", SamplingParams(temperature=1.0, seed=2, n=4, max_tokens=40,
                                           structured=StructuredOutput(regex=r"[0-9]{2}[a-c]")))[0]
    assert len(out.outputs) == 4 and all(re.fullmatch(r"[0-9]{2}[a-c]", c.text) for c in out.outputs)
    assert len({c.text for c in out.outputs}) > 1  # each sample has its own matcher

    engine = AsyncLLM(llm=llm)

    async def run():
        text = "".join([d.text async for d in engine.generate("a", SamplingParams(
            temperature=1.0, seed=1, max_tokens=40, structured=StructuredOutput(choice=["left", "right"])))])
        with pytest.raises(RequestError, match="invalid regex"):
            await engine.add_request("a", SamplingParams(structured=StructuredOutput(regex="(")))
        return text

    try:
        assert asyncio.run(run()) in ("left", "right")
    finally:
        engine.shutdown()
