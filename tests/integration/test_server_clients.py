"""Third-party clients' exact requests against the server as users start it (`python -m livemoe.engine.server`,
a process): lm-evaluation-harness's loglikelihood body (echo + logprobs; the summed continuation logprob equals
transformers') and its remote-tokenizer probes (/tokenizer_info, /tokenize, /detokenize); lm-eval itself where it
is installed (its accuracies and loglikelihoods equal its `hf` model type's on the same checkpoint); vLLM's
prompt_logprobs on both endpoints; guidellm's stream_options with continuous_usage_stats; the developer role, the
legacy functions / function_call fields and older instructor's response_format.schema; and the Responses API
through the openai client's responses.create and responses.stream."""
import glob
import importlib.util
import json
import os
import subprocess
import sys
import urllib.request

import pytest
import torch

from fixtures import http_json, require_server_extras

openai = require_server_extras()

from livemoe.engine.server import ServerProcess  # noqa: E402
from livemoe.engine.server.__main__ import parser  # noqa: E402
from tiny_tokenizer import make_text_checkpoint  # noqa: E402

MODEL = "tiny"
TOL = 1e-4
# chunks of 32 tokens: the long prompts below are prefilled in several steps
FLAGS = ["--device", "cpu", "--dtype", "float32", "--threads", "1", "--block-size", "16", "--num-kv-blocks", "64",
         "--max-model-len", "256", "--max-num-batched-tokens", "32", "--max-logprobs", "5"]
LOOKUP = {"name": "lookup", "description": "Look a link up by id",
          "parameters": {"type": "object", "properties": {"id": {"enum": [12, 13]}}, "required": ["id"],
                         "additionalProperties": False}}


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    from transformers import AutoModelForCausalLM

    path, tok = make_text_checkpoint(tmp_path_factory.mktemp("clients") / "ckpt", moe=True)
    hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    with ServerProcess(path, MODEL, FLAGS, env={"OMP_NUM_THREADS": "1"}) as server:
        yield server.url, tok, hf


@pytest.fixture(scope="module")
def client(served):
    return openai.OpenAI(base_url=served[0] + "/v1", api_key="none", max_retries=0, timeout=120)


def ok(url: str, body=None) -> dict:
    status, answer = http_json(url, body)
    assert status == 200, answer
    return answer


def refused(url: str, body) -> str:
    status, answer = http_json(url, body)
    assert status == 400, answer
    return answer["error"]["message"]


def hf_logprobs(hf, ids: list[int]) -> torch.Tensor:
    """[len - 1, V]: row p is log p(. | ids[:p + 1])."""
    with torch.no_grad():
        return torch.log_softmax(hf(torch.tensor([ids])).logits[0, :-1].float(), dim=-1)


def test_lm_eval_loglikelihood_requests(served):
    url, tok, hf = served
    pairs = [("The cat sat on the", " mat"), ("hello " * 20 + "and then", " goodbye world")]  # the second: chunked
    contexts = [tok.encode(c) for c, _ in pairs]
    prompts = [ctx + tok.encode(cont) for ctx, (_, cont) in zip(contexts, pairs)]
    # lm-eval's own body (LocalCompletionsAPI._create_payload, generate=False): a batch of token-id prompts
    body = {"model": MODEL, "prompt": prompts, "temperature": 0, "max_tokens": 1, "logprobs": 1, "seed": 1234,
            "echo": True}
    first = ok(url + "/v1/completions", body)
    again = ok(url + "/v1/completions", body)  # the prompts are in the prefix cache now
    for answer in (first, again):
        for choice, ids, ctx in zip(sorted(answer["choices"], key=lambda c: c["index"]), prompts, contexts):
            lp = choice["logprobs"]
            assert len(lp["tokens"]) == len(ids) + 1  # the prompt, then the one generated token
            assert lp["token_logprobs"][0] is None and lp["top_logprobs"][0] is None
            # lm-eval's parse_logprobs: the continuation is [ctxlen:-1]
            got = sum(lp["token_logprobs"][len(ctx):-1])
            ref = hf_logprobs(hf, ids)
            want = sum(ref[p - 1, ids[p]].item() for p in range(len(ctx), len(ids)))
            assert abs(got - want) < TOL * len(ids), (got, want)
            greedy = all(t == max(top.values()) for t, top in zip(lp["token_logprobs"][len(ctx):-1],
                                                                   lp["top_logprobs"][len(ctx):-1]))
            assert greedy == all(ref[p - 1].argmax().item() == ids[p] for p in range(len(ctx), len(ids)))
            assert choice["text"].startswith(tok.decode(ids))
    assert first["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
    assert again["usage"]["prompt_tokens_details"]["cached_tokens"] == 0  # computed again: no hidden states cached


def test_lm_eval_remote_tokenizer_routes(served):
    url, tok, _ = served
    info = ok(url + "/tokenizer_info")
    assert info["eos_token"] == tok.eos_token and info["bos_token"] == tok.bos_token
    assert info["chat_template"] == tok.chat_template and info["tokenizer_class"] == type(tok).__name__
    json.dumps(info)  # plain JSON throughout
    text = "hello 你好 world"
    ids = ok(url + "/tokenize", {"prompt": text, "add_special_tokens": False})  # RemoteTokenizer.encode's body
    assert ids["tokens"] == tok.encode(text, add_special_tokens=False) and ids["count"] == len(ids["tokens"])
    assert ids["max_model_len"] == 256
    assert ok(url + "/detokenize", {"tokens": ids["tokens"]}) == {"prompt": text}
    messages = [{"role": "user", "content": "hi"}]
    chat = ok(url + "/tokenize", {"model": MODEL, "messages": messages, "return_token_strs": True})
    want = tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
    assert chat["tokens"] == list(getattr(want, "input_ids", want)) and len(chat["token_strs"]) == chat["count"]
    assert "send one of prompt or messages" in refused(url + "/tokenize", {"prompt": "a", "messages": messages})
    assert "vocabulary" in refused(url + "/detokenize", {"tokens": [10**6]})
    assert "unknown field" in refused(url + "/tokenize", {"prompt": "a", "truncate": 3})


def test_prompt_logprobs_on_both_endpoints(served, client):
    url, tok, hf = served
    text = "one two three four five six seven eight nine ten eleven twelve"
    ids = tok.encode(text)
    answer = client.completions.create(model=MODEL, prompt=text, max_tokens=2, extra_body={"prompt_logprobs": 2})
    got = answer.choices[0].model_extra["prompt_logprobs"]
    ref = hf_logprobs(hf, ids)
    assert got[0] is None and len(got) == len(ids)
    for p in range(1, len(ids)):
        entry = got[p]
        assert abs(entry[str(ids[p])]["logprob"] - ref[p - 1, ids[p]].item()) < TOL
        top = ref[p - 1].topk(2)
        ranked = {int(t): v for t, v in entry.items() if v["rank"] is not None}
        assert [ranked[t]["rank"] for t in top.indices.tolist()] == [1, 2]
        assert entry[str(ids[p])]["decoded_token"] == tok.decode([ids[p]])
    messages = [{"role": "system", "content": "be brief"}, {"role": "user", "content": text}]
    chat = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=2,
                                          extra_body={"prompt_logprobs": 0})
    chat_ids = ok(url + "/tokenize", {"messages": messages})["tokens"]
    got = chat.model_extra["prompt_logprobs"]
    assert len(got) == len(chat_ids) == chat.usage.prompt_tokens
    ref = hf_logprobs(hf, chat_ids)
    assert max(abs(got[p][str(chat_ids[p])]["logprob"] - ref[p - 1, chat_ids[p]].item())
               for p in range(1, len(chat_ids))) < TOL
    with pytest.raises(openai.BadRequestError, match="prompt_logprobs is not available with stream"):
        client.completions.create(model=MODEL, prompt="hi", stream=True, extra_body={"prompt_logprobs": 1})
    with pytest.raises(openai.BadRequestError, match="prompt_logprobs: 9 is over this server's limit"):
        client.chat.completions.create(model=MODEL, messages=messages, extra_body={"prompt_logprobs": 9})
    with pytest.raises(openai.BadRequestError, match="echo with logprobs is not available with stream"):
        client.completions.create(model=MODEL, prompt="hi", echo=True, logprobs=1, stream=True)


def sse(url: str, body: dict) -> list[dict]:
    req = urllib.request.Request(url, data=json.dumps(body).encode(), headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=120) as r:
        events = [e.removeprefix("data: ") for e in r.read().decode().split("\n\n") if e]
    assert events[-1] == "[DONE]"
    return [json.loads(e) for e in events[:-1]]


def test_guidellm_stream_options_usage_on_every_chunk(served):
    url, tok, _ = served
    # guidellm's text-completions body (TextCompletionsRequestHandler.format with stream and output tokens)
    body = {"model": MODEL, "stream": True, "stream_options": {"include_usage": True, "continuous_usage_stats": True},
            "max_tokens": 8, "stop": None, "ignore_eos": True, "prompt": "benchmark me please"}
    chunks = sse(url + "/v1/completions", body)
    prompt_tokens = len(tok.encode(body["prompt"]))
    assert all(c["usage"] is not None and c["usage"]["prompt_tokens"] == prompt_tokens for c in chunks)
    counts = [c["usage"]["completion_tokens"] for c in chunks]
    assert counts == sorted(counts) and counts[-1] == 8
    assert chunks[-1]["choices"] == []  # include_usage's own last chunk
    assert sum(len(c["usage"]) > 0 for c in chunks if c["choices"]) == len(chunks) - 1
    # continuous alone: usage on the content chunks, no usage-only chunk; both false: no usage at all
    only = sse(url + "/v1/completions", {**body, "stream_options": {"continuous_usage_stats": True}})
    assert all(c["choices"] and c["usage"]["prompt_tokens"] == prompt_tokens for c in only)
    off = sse(url + "/v1/completions", {**body, "stream_options": {"include_usage": False,
                                                                  "continuous_usage_stats": False}})
    assert all("usage" not in c for c in off)
    chat = sse(url + "/v1/chat/completions", {"model": MODEL, "messages": [{"role": "user", "content": "hi"}],
                                              "max_tokens": 4, "stream": True, "ignore_eos": True,
                                              "stream_options": {"include_usage": True,
                                                                 "continuous_usage_stats": True}})
    assert all(c["usage"] is not None for c in chat) and chat[-1]["usage"]["completion_tokens"] == 4


def test_developer_role_is_system(served, client):
    url, _, _ = served
    as_system = [{"role": "system", "content": "answer in French"}, {"role": "user", "content": "hi"}]
    as_developer = [{"role": "developer", "content": "answer in French"}, {"role": "user", "content": "hi"}]
    assert ok(url + "/tokenize", {"messages": as_developer}) == ok(url + "/tokenize", {"messages": as_system})
    kw = dict(model=MODEL, max_tokens=6, temperature=0, extra_body={"return_token_ids": True, "ignore_eos": True})
    a = client.chat.completions.create(messages=as_system, **kw)
    b = client.chat.completions.create(messages=as_developer, **kw)
    assert a.choices[0].model_extra["token_ids"] == b.choices[0].model_extra["token_ids"]
    assert a.usage.prompt_tokens == b.usage.prompt_tokens


def test_legacy_functions_and_function_call(served, client):
    url, _, _ = served
    messages = [{"role": "user", "content": "What is in link 12?"}]
    out = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=120,
                                         functions=[LOOKUP], function_call={"name": "lookup"})
    message = out.choices[0].message
    assert message.tool_calls is None and message.function_call.name == "lookup"
    assert set(json.loads(message.function_call.arguments)) == {"id"}
    assert out.choices[0].finish_reason == "function_call"
    # the same request in tools spelling makes the same call, in the tools shape
    tools = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=120, temperature=1.0, seed=3,
                                           tools=[{"type": "function", "function": LOOKUP}],
                                           tool_choice={"type": "function", "function": {"name": "lookup"}})
    legacy = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=120, temperature=1.0, seed=3,
                                            functions=[LOOKUP], function_call={"name": "lookup"})
    assert legacy.choices[0].message.function_call.arguments == tools.choices[0].message.tool_calls[0].function.arguments
    streamed = list(client.chat.completions.create(model=MODEL, messages=messages, max_tokens=120, temperature=1.0, seed=3,
                                                   functions=[LOOKUP], function_call={"name": "lookup"}, stream=True))
    calls = [c.choices[0].delta.function_call for c in streamed if c.choices and c.choices[0].delta.function_call]
    assert len(calls) == 1 and calls[0].arguments == legacy.choices[0].message.function_call.arguments
    assert streamed[-1].choices[0].finish_reason == "function_call"
    # a legacy conversation: the assistant's function_call and the function's result go back in
    history = messages + [{"role": "assistant", "content": None, "function_call": {"name": "lookup",
                                                                                   "arguments": '{"id": 12}'}},
                          {"role": "function", "name": "lookup", "content": "pork zongzi"}]
    again = client.chat.completions.create(model=MODEL, messages=history, max_tokens=4, functions=[LOOKUP],
                                           function_call="none")
    assert again.choices[0].message.function_call is None
    both = {"model": MODEL, "messages": messages, "functions": [LOOKUP],
            "tools": [{"type": "function", "function": LOOKUP}]}
    assert "send one or the other" in refused(url + "/v1/chat/completions", both)
    assert "function_call needs functions" in refused(url + "/v1/chat/completions",
                                                      {"model": MODEL, "messages": messages, "function_call": "auto"})


def test_response_format_schema_as_older_instructor_sends_it(served, client):
    url, _, _ = served
    schema = {"type": "object", "properties": {"action": {"enum": ["reply", "ignore"]}}, "required": ["action"],
              "additionalProperties": False}
    out = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "decide"}],
                                         max_tokens=30, response_format={"type": "json_object", "schema": schema})
    assert json.loads(out.choices[0].message.content)["action"] in ("reply", "ignore")
    body = {"model": MODEL, "messages": [{"role": "user", "content": "x"}]}
    for rf in ({"type": "text", "schema": schema},
               {"type": "json_schema", "schema": schema, "json_schema": {"name": "x", "schema": schema}}):
        assert "send the schema as response_format.json_schema.schema" in refused(
            url + "/v1/chat/completions", {**body, "response_format": rf})
    assert "only allowed with type json_schema" in refused(
        url + "/v1/chat/completions", {**body, "response_format": {"type": "json_object",
                                                                    "json_schema": {"name": "x", "schema": schema}}})


def test_help_says_what_each_none_default_means():
    text = parser().format_help()
    assert "default: None" not in text
    assert "default: 1 (torch CPU threads" in " ".join(text.split())


SCHEMA = {"type": "object", "properties": {"action": {"enum": ["reply", "ignore"]}}, "required": ["action"],
          "additionalProperties": False}


def test_responses_api_with_the_openai_client(served, client):
    url, tok, _ = served
    out = client.responses.create(model=MODEL, input="hello", instructions="be brief", max_output_tokens=6,
                                  temperature=0)
    assert out.status == "incomplete" and out.incomplete_details.reason == "max_output_tokens"
    assert [i.type for i in out.output] == ["message"] and out.output_text
    # the same prompt and tokens as the chat request it means
    chat = client.chat.completions.create(model=MODEL, max_tokens=6, temperature=0,
                                          messages=[{"role": "system", "content": "be brief"},
                                                    {"role": "user", "content": "hello"}])
    assert out.output_text == chat.choices[0].message.content
    assert (out.usage.input_tokens, out.usage.output_tokens) == (chat.usage.prompt_tokens, 6)
    # streamed: the typed events join to the JSON answer
    events = list(client.responses.create(model=MODEL, input=[{"role": "user", "content": "hello"}],
                                          instructions="be brief", max_output_tokens=6, temperature=0, stream=True))
    kinds = [e.type for e in events]
    assert kinds[:4] == ["response.created", "response.in_progress", "response.output_item.added",
                         "response.content_part.added"]
    assert kinds[-4:] == ["response.output_text.done", "response.content_part.done", "response.output_item.done",
                          "response.incomplete"]
    assert [e.sequence_number for e in events] == list(range(len(events)))
    assert "".join(e.delta for e in events if e.type == "response.output_text.delta") == out.output_text
    assert events[-1].response.output[0].content[0].text == out.output_text
    # responses.stream with a json_schema text format (the grammar ends the output: completed)
    with client.responses.stream(model=MODEL, input="decide", max_output_tokens=60, extra_body={"seed": 1},
                                 text={"format": {"type": "json_schema", "name": "decision", "schema": SCHEMA}}) as s:
        deltas = "".join(e.delta for e in s if e.type == "response.output_text.delta")
        final = s.get_final_response()
    assert final.status == "completed" and deltas == final.output_text
    assert json.loads(final.output_text)["action"] in ("reply", "ignore")


def test_responses_api_tools_and_conversation_items(served, client):
    url, _, _ = served
    tool = {"type": "function", **LOOKUP}
    out = client.responses.create(model=MODEL, input="What is in link 12?", tools=[tool], tool_choice="required",
                                  max_output_tokens=120, extra_body={"seed": 3})
    [call] = out.output
    assert call.type == "function_call" and call.name == "lookup" and set(json.loads(call.arguments)) == {"id"}
    named = client.responses.create(model=MODEL, input="x", tools=[tool], max_output_tokens=120, extra_body={"seed": 3},
                                    tool_choice={"type": "function", "name": "lookup"})
    assert named.output[0].type == "function_call"
    # the whole conversation goes back as items: the earlier call, its output, an assistant message
    items = [{"role": "developer", "content": "use tools"},
             {"role": "user", "content": [{"type": "input_text", "text": "What is in link 12?"}]},
             *[i.model_dump(exclude_none=True) for i in out.output],
             {"type": "function_call_output", "call_id": call.call_id, "output": "pork zongzi"}]
    again = client.responses.create(model=MODEL, input=items, tools=[tool], tool_choice="none", max_output_tokens=4)
    assert again.output[0].type == "message" and again.usage.input_tokens > out.usage.input_tokens
    body = {"model": MODEL, "input": "x"}
    for extra, words in [({"previous_response_id": "resp_1"}, "keeps no conversation state"),
                         ({"store": True}, "store: true is not supported"),
                         ({"background": True}, "background: true is not supported"),
                         ({"include": ["reasoning.encrypted_content"]}, "include"),
                         ({"truncation": "auto"}, "truncation: auto"),
                         ({"reasoning": {"effort": "high"}}, "reasoning: not supported"),
                         ({"top_logprobs": 2}, "top_logprobs: unknown field"),
                         ({"tools": [{"type": "web_search"}]}, "tools.0"),
                         ({"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "x"}]}]},
                          "input"),
                         ({"text": {"format": {"type": "json_schema", "name": "x"}}}, "needs name and schema"),
                         ({"max_output_tokens": 10**6}, "maximum context length")]:
        assert words in refused(url + "/v1/responses", {**body, **extra}), extra
    assert ok(url + "/v1/responses", {**body, "store": False, "truncation": "disabled", "max_output_tokens": 2,
                                       "metadata": {"k": "v"}})["status"] == "incomplete"


LM_EVAL_TASKS = {
    "tiny_mc": ("multiple_choice", 'doc_to_choice: "{{choices}}"\ndoc_to_target: "{{answer}}"\n'
                "metric_list:\n  - metric: acc\n  - metric: acc_norm\n"),
    "tiny_gen": ("generate_until", 'doc_to_target: "{{answer}}"\ngeneration_kwargs:\n  until: ["\\n"]\n'
                 "  max_gen_toks: 8\n  do_sample: false\nmetric_list:\n  - metric: exact_match\n"),
}


def write_lm_eval_tasks(folder) -> None:
    """Two local JSON tasks: a multiple-choice one (loglikelihood requests) and a generate_until one."""
    words = "red green blue cat dog sun moon tree car book".split()
    mc = [{"question": " ".join(words[(i * 3 + k) % 10] for k in range(5)) + " is",
           "choices": [" " + words[(i + k) % 10] for k in range(4)], "answer": i % 4} for i in range(12)]
    gen = [{"question": " ".join(words[(i * 7 + k) % 10] for k in range(4)), "answer": words[i]} for i in range(4)]
    for name, docs in (("tiny_mc", mc), ("tiny_gen", gen)):
        with open(os.path.join(folder, f"{name}.jsonl"), "w") as f:
            f.writelines(json.dumps(d) + "\n" for d in docs)
        kind, rest = LM_EVAL_TASKS[name]
        with open(os.path.join(folder, f"{name}.yaml"), "w") as f:
            f.write(f"task: {name}\ndataset_path: json\ndataset_kwargs:\n  data_files:\n"
                    f"    test: {os.path.join(folder, name + '.jsonl')}\ntest_split: test\noutput_type: {kind}\n"
                    f'doc_to_text: "{{{{question}}}}"\n{rest}')


def lm_eval(folder, out: str, model: str, model_args: str) -> dict:
    """Runs lm-eval's CLI on the two tasks; returns each task's logged samples."""
    cmd = [sys.executable, "-m", "lm_eval", "--model", model, "--model_args", model_args, "--tasks", "tiny_mc,tiny_gen",
           "--include_path", str(folder), "--output_path", str(folder / out), "--log_samples", "--device", "cpu"]
    env = {**os.environ, "HF_DATASETS_OFFLINE": "1", "HF_HUB_OFFLINE": "1", "OMP_NUM_THREADS": "1"}
    done = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    samples = {}
    for task in LM_EVAL_TASKS:
        [path] = glob.glob(str(folder / out / "**" / f"samples_{task}_*.jsonl"), recursive=True)
        with open(path) as f:
            samples[task] = [json.loads(line) for line in f]
    return samples


@pytest.mark.skipif(importlib.util.find_spec("lm_eval") is None, reason="needs lm-evaluation-harness (lm-eval)")
def test_lm_eval_itself_matches_its_hf_model_type(served, tmp_path):
    url, _, hf = served
    write_lm_eval_tasks(tmp_path)
    remote = lm_eval(tmp_path, "server", "local-completions",
                     f"model={MODEL},base_url={url}/v1/completions,tokenizer_backend=remote,num_concurrent=1,"
                     "max_retries=1")
    local = lm_eval(tmp_path, "hf", "hf", f"pretrained={hf.name_or_path},dtype=float32")
    for a, b in zip(remote["tiny_mc"], local["tiny_mc"], strict=True):
        for (lp_a, greedy_a), (lp_b, greedy_b) in zip((r[0] for r in a["resps"]), (r[0] for r in b["resps"])):
            assert abs(float(lp_a) - float(lp_b)) < 1e-3 and greedy_a == greedy_b
        assert (a["acc"], a["acc_norm"]) == (b["acc"], b["acc_norm"])
    assert [s["resps"] for s in remote["tiny_gen"]] == [s["resps"] for s in local["tiny_gen"]]
