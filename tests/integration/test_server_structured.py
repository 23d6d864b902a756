"""Structured output, tools, reasoning content and penalties through the OpenAI server, driven by the
official `openai` client against a tiny random MoE whose tokenizer is byte-level BPE (any JSON can be
spelled): json_schema outputs validate for 20 prompts, json_object parses, regex / choice / grammar
match, tool_choice required and named give valid calls, a tool result goes back through the chat
template, reasoning is split off with --reasoning-parser, streamed equals non-streamed with a seed,
and unknown fields or bad schemas are a 400 naming them."""
import json
import re
from concurrent.futures import ThreadPoolExecutor

import pytest
import torch

from fixtures import require_server_extras

openai = require_server_extras()
jsonschema = pytest.importorskip("jsonschema", reason="needs the test extras (pip install -e .[test])")
pytest.importorskip("xgrammar", reason="needs xgrammar (a runtime dependency: pip install -e .)")

from livemoe.engine.async_llm import AsyncLLM  # noqa: E402
from livemoe.engine.server import BackgroundServer  # noqa: E402
from tiny_models import hf_model  # noqa: E402
from tiny_tokenizer import byte_token_ids, train_tokenizer  # noqa: E402

MODEL = "tiny"
pytestmark = pytest.mark.usefixtures("one_thread")

# Qwen3's way of showing tools, calls and tool results, in brief
TOOLS_TEMPLATE = (
    "{%- if tools %}<|im_start|>system\n<tools>\n{% for t in tools %}{{ t | tojson }}\n{% endfor %}</tools><|im_end|>\n"
    "{% endif %}"
    "{%- for m in messages %}"
    "{%- if m.role == 'tool' %}<|im_start|>user\n<tool_response>\n{{ m.content }}\n</tool_response><|im_end|>\n"
    "{%- elif m.role == 'assistant' and m.tool_calls %}<|im_start|>assistant\n{{ m.content }}"
    "{% for c in m.tool_calls %}<tool_call>\n{\"name\": \"{{ c.function.name }}\", \"arguments\": "
    "{{ c.function.arguments | tojson }}}\n</tool_call>{% endfor %}<|im_end|>\n"
    "{%- else %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endif %}{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")

SCHEMA = {
    "type": "object",
    "properties": {
        "action": {"type": "string", "enum": ["reply", "ignore", "escalate"]},
        "score": {"type": "integer", "minimum": -5, "maximum": 50},
        "tags": {"type": "array", "items": {"type": "string", "enum": ["a", "bb", "c"]}, "minItems": 1, "maxItems": 3},
        "detail": {"type": "object",
                   "properties": {"ok": {"type": "boolean"}, "note": {"type": "string", "maxLength": 8}},
                   "required": ["ok", "note"], "additionalProperties": False},
    },
    "required": ["action", "score", "tags", "detail"],
    "additionalProperties": False,
}
LOOKUP = {"type": "function", "function": {
    "name": "lookup", "description": "find a product",
    "parameters": {"type": "object", "properties": {"id": {"type": "integer", "minimum": 0, "maximum": 99},
                                                    "field": {"type": "string", "enum": ["price", "stock"]}},
                   "required": ["id", "field"], "additionalProperties": False}}}
RECOMMEND = {"type": "function", "function": {
    "name": "recommend", "parameters": {"type": "object", "properties": {"n": {"type": "integer", "minimum": 1,
                                                                             "maximum": 3}},
                                        "required": ["n"], "additionalProperties": False}}}


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    path = tmp_path_factory.mktemp("structured_srv") / "ckpt"
    tok = train_tokenizer()
    tok.chat_template = TOOLS_TEMPLATE
    hf_model(True, 0, vocab_size=len(tok), max_position_embeddings=1024).save_pretrained(path)
    tok.save_pretrained(path)
    # the engine in its own process (livemoe/engine/core), as `livemoe serve` runs it
    engine = AsyncLLM(str(path), dtype=torch.float32, device="cpu", use_tqdm=False, block_size=16,
                      num_kv_blocks=800, max_model_len=1024, engine_core="process", threads=1)
    plain = BackgroundServer(engine, MODEL).start()
    thinking = BackgroundServer(engine, MODEL, reasoning_parser="qwen3").start()
    yield engine, plain, thinking, tok
    thinking.stop()
    plain.stop()
    engine.shutdown()


def make_client(server):
    return openai.OpenAI(base_url=server.url + "/v1", api_key="none", max_retries=0, timeout=120)


@pytest.fixture(scope="module")
def client(served):
    return make_client(served[1])


def json_schema_format(schema=SCHEMA):
    return {"type": "json_schema", "json_schema": {"name": "decision", "schema": schema, "strict": True}}


def test_json_schema_validates_for_20_prompts(client):
    def ask(i):
        return client.chat.completions.create(
            model=MODEL, messages=[{"role": "user", "content": f"viewer {i} asks: {'why ' * (i % 5)}?"}],
            response_format=json_schema_format(), temperature=1.0, seed=i, max_tokens=200)

    with ThreadPoolExecutor(20) as pool:  # one batch in the engine
        answers = list(pool.map(ask, range(20)))
    assert len(answers) == 20
    for a in answers:
        choice = a.choices[0]
        assert choice.finish_reason == "stop", choice.message.content
        jsonschema.validate(json.loads(choice.message.content), SCHEMA)
    assert len({a.choices[0].message.content for a in answers}) > 1


def test_streamed_equals_non_streamed(client):
    kw = dict(model=MODEL, messages=[{"role": "user", "content": "decide"}], response_format=json_schema_format(),
              temperature=1.0, seed=11, max_tokens=200)
    full = client.chat.completions.create(**kw).choices[0].message.content
    chunks = list(client.chat.completions.create(stream=True, **kw))
    streamed = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert streamed == full and json.loads(full)
    kw = dict(model=MODEL, prompt="pick", temperature=1.0, seed=5, max_tokens=40,
              extra_body={"guided_regex": r"[a-z]{2,6}-[0-9]{1,3}"})
    full = client.completions.create(**kw).choices[0].text
    streamed = "".join(c.choices[0].text for c in client.completions.create(stream=True, **kw) if c.choices)
    assert streamed == full and re.fullmatch(r"[a-z]{2,6}-[0-9]{1,3}", full)


@pytest.mark.parametrize("stream", [False, True], ids=["json", "sse"])
def test_json_object_regex_choice_grammar(client, served, stream):
    tok = served[3]

    def completion(**kw):
        if not stream:
            return client.completions.create(model=MODEL, stream=False, **kw).choices[0].text
        return "".join(c.choices[0].text for c in client.completions.create(model=MODEL, stream=True, **kw)
                       if c.choices)

    def chat(**kw):
        msgs = [{"role": "user", "content": "go"}]
        if not stream:
            return client.chat.completions.create(model=MODEL, messages=msgs, **kw).choices[0].message.content
        return "".join(c.choices[0].delta.content or "" for c in
                       client.chat.completions.create(model=MODEL, messages=msgs, stream=True, **kw) if c.choices)

    # the random model rarely closes a free string: favour '"' and '}' so outputs end in time
    bias = {str(t): 6.0 for t in byte_token_ids(tok, '"}')}
    for seed in range(3):
        text = chat(response_format={"type": "json_object"}, logit_bias=bias, temperature=1.0, seed=seed,
                    max_tokens=150)
        assert isinstance(json.loads(text), dict)
        text = completion(prompt="x", extra_body={"guided_json": {"type": "array", "items": {"type": "boolean"},
                                                                  "minItems": 2, "maxItems": 2}},
                          temperature=1.0, seed=seed, max_tokens=30)
        assert len(json.loads(text)) == 2
        text = completion(prompt="y", extra_body={"guided_choice": ["alpha", "beta gamma", "直播"]},
                          temperature=1.0, seed=seed, max_tokens=20)
        assert text in ("alpha", "beta gamma", "直播")
        text = chat(extra_body={"guided_regex": r"(yes|no), [0-9]{2}"}, temperature=1.0, seed=seed, max_tokens=20)
        assert re.fullmatch(r"(yes|no), [0-9]{2}", text)
        text = chat(extra_body={"guided_grammar": 'root ::= "[" ("x" | "y"){1,4} "]"'}, temperature=1.0, seed=seed,
                    max_tokens=20)
        assert re.fullmatch(r"\[[xy]{1,4}\]", text)


def tool_calls_of(answer_or_chunks, stream):
    if not stream:
        choice = answer_or_chunks.choices[0]
        return choice.finish_reason, choice.message.content, [
            (c.function.name, c.function.arguments, c.id) for c in choice.message.tool_calls]
    calls, content, finish = [], "", None
    for chunk in answer_or_chunks:
        if not chunk.choices:
            continue
        d = chunk.choices[0].delta
        content += d.content or ""
        for c in d.tool_calls or []:
            assert c.index == len(calls)
            calls.append((c.function.name, c.function.arguments, c.id))
        finish = chunk.choices[0].finish_reason or finish
    return finish, content or None, calls


@pytest.mark.parametrize("stream", [False, True], ids=["json", "sse"])
def test_tool_choice_required_and_named(client, stream):
    params = {t["function"]["name"]: t["function"]["parameters"] for t in (LOOKUP, RECOMMEND)}
    for seed in range(4):
        for choice, names in (("required", {"lookup", "recommend"}),
                              ({"type": "function", "function": {"name": "recommend"}}, {"recommend"})):
            out = client.chat.completions.create(
                model=MODEL, messages=[{"role": "user", "content": f"what costs less? {seed}"}],
                tools=[LOOKUP, RECOMMEND], tool_choice=choice, temperature=1.0, seed=seed, max_tokens=120,
                stream=stream)
            finish, content, calls = tool_calls_of(out, stream)
            assert finish == "tool_calls" and content is None and len(calls) == 1
            name, args, call_id = calls[0]
            assert name in names and call_id.startswith("call_")
            jsonschema.validate(json.loads(args), params[name])


def test_tool_calls_stream_equals_json(client):
    kw = dict(model=MODEL, messages=[{"role": "user", "content": "stock?"}], tools=[LOOKUP, RECOMMEND],
              tool_choice="required", parallel_tool_calls=False, temperature=1.0, seed=3, max_tokens=120)
    f1, c1, calls1 = tool_calls_of(client.chat.completions.create(**kw), False)
    f2, c2, calls2 = tool_calls_of(client.chat.completions.create(stream=True, **kw), True)
    assert (f1, c1) == (f2, c2) and [c[:2] for c in calls1] == [c[:2] for c in calls2] and len(calls1) == 1


def test_tool_result_round_trip(client, served):
    tok = served[3]
    first = client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "price of 7?"}], tools=[LOOKUP],
        tool_choice={"type": "function", "function": {"name": "lookup"}}, temperature=0, max_tokens=120)
    call = first.choices[0].message.tool_calls[0]
    messages = [{"role": "user", "content": "price of 7?"},
                {"role": "assistant", "content": None, "tool_calls": [call.model_dump()]},
                {"role": "tool", "tool_call_id": call.id, "content": '{"price": 12.5}'}]
    second = client.chat.completions.create(model=MODEL, messages=messages, tools=[LOOKUP], tool_choice="auto",
                                            temperature=0, max_tokens=8, extra_body={"ignore_eos": True})
    # the prompt the server built is the template's rendering of the call and the tool result
    rendered = tok.apply_chat_template(
        [messages[0], {"role": "assistant", "content": "", "tool_calls": [
            {"type": "function", "function": {"name": call.function.name,
                                              "arguments": json.loads(call.function.arguments)}}]},
         {"role": "tool", "content": '{"price": 12.5}'}],
        tools=[LOOKUP], tokenize=False, add_generation_prompt=True)
    assert "<tool_response>\n{\"price\": 12.5}\n</tool_response>" in rendered and "<tool_call>" in rendered
    assert second.usage.prompt_tokens == len(tok.encode(rendered, add_special_tokens=False))
    assert second.choices[0].finish_reason == "length"


def test_reasoning_parser_splits_think_block(served):
    thinking = make_client(served[2])
    regex = r"<think>[a-z ]{1,12}</think>\n\n[a-z]{1,8}"
    kw = dict(model=MODEL, messages=[{"role": "user", "content": "think"}], temperature=1.0, max_tokens=60,
              extra_body={"guided_regex": regex})
    for seed in range(3):
        full = thinking.chat.completions.create(seed=seed, **kw).choices[0].message
        reasoning = full.model_extra["reasoning_content"]
        assert re.fullmatch(r"[a-z ]{1,12}", reasoning) and re.fullmatch(r"[a-z]{1,8}", full.content)
        chunks = [c for c in thinking.chat.completions.create(seed=seed, stream=True, **kw) if c.choices]
        streamed_r = "".join(c.choices[0].delta.model_extra.get("reasoning_content") or "" for c in chunks)
        streamed_c = "".join(c.choices[0].delta.content or "" for c in chunks)
        assert (streamed_r, streamed_c) == (reasoning, full.content)
    plain = make_client(served[1]).chat.completions.create(seed=0, **kw).choices[0].message
    assert plain.content.startswith("<think>") and "reasoning_content" not in (plain.model_extra or {})


def test_penalties_and_logit_bias(client, served):
    tok = served[3]
    target = byte_token_ids(tok, "Q")[0]
    out = client.completions.create(model=MODEL, prompt="hello", max_tokens=6, temperature=0,
                                    logit_bias={str(target): 100}, extra_body={"return_token_ids": True})
    assert out.choices[0].model_extra["token_ids"] == [target] * 6
    kw = dict(model=MODEL, prompt="hello hello", max_tokens=16, temperature=0,
              extra_body={"ignore_eos": True, "return_token_ids": True})
    plain = client.completions.create(**kw).choices[0].model_extra["token_ids"]
    penal = client.completions.create(frequency_penalty=2.0, presence_penalty=2.0, **kw).choices[0].model_extra
    rep = client.completions.create(model=MODEL, prompt="hello hello", max_tokens=16, temperature=0,
                                    extra_body={"ignore_eos": True, "return_token_ids": True,
                                                "repetition_penalty": 3.0}).choices[0].model_extra
    assert len(set(penal["token_ids"])) > len(set(plain)) and rep["token_ids"] != plain
    eos = tok.eos_token_id
    out = client.completions.create(model=MODEL, prompt="hi", max_tokens=20, temperature=0,
                                    logit_bias={str(eos): 100}, extra_body={"min_tokens": 3, "return_token_ids": True})
    ids = out.choices[0].model_extra["token_ids"]
    assert ids[3:] == [eos] and eos not in ids[:3]
    for key in (" 5", "5_0", "\u0663", "+5", "-1", ""):  # int() takes the first four: none is a token id
        with pytest.raises(openai.BadRequestError, match="logit_bias"):
            client.completions.create(model=MODEL, prompt="hi", max_tokens=2, logit_bias={key: 1})


BAD = [
    (dict(extra_body={"guided_decoding_backend": "outlines"}), "guided_decoding_backend: unknown field"),
    (dict(extra_body={"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {},
                                                                                  "bogus": 1}}}),
     "response_format.json_schema.bogus: unknown field"),
    (dict(response_format=json_schema_format({"type": "object", "properties": 3})),
     "response_format.json_schema.schema: invalid json"),
    (dict(extra_body={"guided_regex": "[a-"}), "guided_regex: invalid regex"),
    (dict(extra_body={"guided_grammar": "root ::= nothing_here"}), "guided_grammar: invalid grammar"),
    (dict(extra_body={"guided_regex": "a", "guided_choice": ["b"]}), "only one output constraint"),
    (dict(tools=[LOOKUP], tool_choice={"type": "function", "function": {"name": "nope"}}), "nope"),
    (dict(tools=[LOOKUP], tool_choice="required", response_format={"type": "json_object"}), "cannot be combined"),
    (dict(tool_choice="required"), "tool_choice needs tools"),
    (dict(tools=[LOOKUP], parallel_tool_calls=False), "parallel_tool_calls"),
    (dict(logit_bias={"abc": 1}), "logit_bias"),
    (dict(logit_bias={"1": 500}), "logit_bias"),
    (dict(logit_bias={"100000": 1}), "out of the vocabulary"),
    (dict(extra_body={"min_tokens": 50}, max_tokens=10), "min_tokens"),
    (dict(reasoning_effort="high"), "reasoning_effort: unknown field"),
]


@pytest.mark.parametrize("stream", [False, True], ids=["json", "sse"])
def test_unknown_fields_and_bad_constraints_are_400(client, stream):
    for overrides, words in BAD:
        kw = dict(model=MODEL, messages=[{"role": "user", "content": "hi"}], max_tokens=4, stream=stream)
        kw.update(overrides)
        with pytest.raises(openai.BadRequestError) as err:
            client.chat.completions.create(**kw)
        assert words in err.value.body["message"], (overrides, err.value.body["message"])
    with pytest.raises(openai.BadRequestError, match=r"messages\.0\.weight: unknown field"):
        client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "hi", "weight": 2}])
    # the fields that mean nothing to a local server are accepted
    out = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "hi"}], max_tokens=2,
                                         user="u1", metadata={"k": "v"}, store=False, stream=stream)
    assert out is not None


def test_reasoning_server_constrains_the_answer_only(tmp_path):
    from test_structured import think_checkpoint

    path, tok = think_checkpoint(tmp_path / "think")
    end = tok.convert_tokens_to_ids("</think>")
    engine = AsyncLLM(path, dtype=torch.float32, device="cpu", use_tqdm=False, block_size=16, num_kv_blocks=128)
    server = BackgroundServer(engine, MODEL, reasoning_parser="deepseek_r1").start()
    try:
        client = make_client(server)
        kw = dict(model=MODEL, messages=[{"role": "user", "content": "think first"}], temperature=1.0,
                  max_tokens=100, logit_bias={str(end): 4.0}, extra_body={"guided_regex": "[a-z]{1,8}"})
        for seed in range(3):
            message = client.chat.completions.create(seed=seed, **kw).choices[0].message
            assert re.fullmatch("[a-z]{1,8}", message.content), message
            reasoning = message.model_extra["reasoning_content"]
            chunks = [c for c in client.chat.completions.create(seed=seed, stream=True, **kw) if c.choices]
            assert "".join(c.choices[0].delta.model_extra.get("reasoning_content") or "" for c in chunks) == \
                (reasoning or "")
            assert "".join(c.choices[0].delta.content or "" for c in chunks) == message.content
    finally:
        server.stop()
        engine.shutdown()


def test_echo_prepends_the_prompt(client):
    kw = dict(model=MODEL, prompt=["echo 你好", "two"], max_tokens=5, temperature=0, n=2, echo=True)
    plain = client.completions.create(**{**kw, "echo": False})
    full = client.completions.create(**kw)
    assert len(full.choices) == len(plain.choices) == 4
    for c, p in zip(full.choices, plain.choices):
        assert c.text == kw["prompt"][c.index // 2] + p.text
    streamed = {}
    for chunk in client.completions.create(stream=True, **kw):
        for c in chunk.choices:
            streamed[c.index] = streamed.get(c.index, "") + c.text
    assert streamed == {c.index: c.text for c in full.choices}
    with pytest.raises(openai.BadRequestError, match="echo with logprobs is not available with stream"):
        client.completions.create(logprobs=1, stream=True, **kw)
