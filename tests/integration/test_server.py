"""The OpenAI-compatible server, driven by the official `openai` client over loopback: completions and
chat, streaming and not, give the same tokens and text; usage counts; n, seed, stop, logprobs; the
400 cases (the server keeps serving); 32 concurrent streams each get exactly the non-streaming tokens
and dropping half of them mid-stream brings the KV blocks back to idle; split multi-byte characters
stream without U+FFFD; /v1/models, /health, /metrics.

Each server runs in-process on a free 127.0.0.1 port (a thread) and is stopped at the end."""
import asyncio
import json
import logging
import re
import time
import urllib.error
import urllib.request

import pytest
import torch

from fixtures import require_server_extras

openai = require_server_extras()

from livemoe.engine.async_llm import AsyncLLM  # noqa: E402
from livemoe.engine.server import BackgroundServer, ServerProcess  # noqa: E402
from tiny_tokenizer import make_cycle_checkpoint, make_text_checkpoint  # noqa: E402

MODEL = "tiny"
CYCLE_TEXT = "aé你b🙂界"
WAIT_S = 30.0  # bound on waiting for the engine to go idle (it needs well under a second here)


pytestmark = pytest.mark.usefixtures("one_thread")


def start(path, **options):
    """An engine in its own process (livemoe/engine/core), as `livemoe serve` runs it, and a server."""
    engine = AsyncLLM(path, dtype=torch.float32, device="cpu", use_tqdm=False, engine_core="process", threads=1,
                      **options)
    return engine, BackgroundServer(engine, MODEL).start()


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    path, tok = make_text_checkpoint(tmp_path_factory.mktemp("srv") / "ckpt", moe=True)
    engine, server = start(path, block_size=16, num_kv_blocks=160, max_model_len=256)
    yield engine, server, tok
    server.stop()
    engine.shutdown()


@pytest.fixture(scope="module")
def client(served):
    return openai.OpenAI(base_url=served[1].url + "/v1", api_key="none", max_retries=0, timeout=60)


def metric(url: str, name: str) -> float:
    """A metric's value, summed over the engine replicas' samples (labelled `replica`)."""
    text = urllib.request.urlopen(url + "/metrics", timeout=10).read().decode()
    if name.endswith("}"):
        found = re.findall(rf"^{re.escape(name)} (\S+)$", text, re.M)
    else:
        found = re.findall(rf"^{re.escape(name)}(?:{{replica=\"\d+\"}})? (\S+)$", text, re.M)
    assert found, f"{name} not in /metrics"
    return sum(map(float, found))


def token_ids(choice) -> list[int]:
    return choice.model_extra["token_ids"]


def test_completions_stream_equals_non_stream(served, client):
    _, _, tok = served
    n = 160  # enough decode steps that the stream has several events however fast the engine runs
    kw = dict(model=MODEL, prompt="hello 你好 🙂", max_tokens=n, temperature=0, extra_body={"ignore_eos": True,
                                                                                          "return_token_ids": True})
    full = client.completions.create(**kw)
    choice = full.choices[0]
    assert choice.finish_reason == "length" and len(token_ids(choice)) == n
    prompt_tokens = len(tok.encode("hello 你好 🙂"))
    u = full.usage
    assert (u.prompt_tokens, u.completion_tokens, u.total_tokens) == (prompt_tokens, n, prompt_tokens + n)
    m = u.model_extra["metrics"]
    assert m["output_tokens"] == n and m["ttft_s"] > 0 and m["tpot_s"] > 0 and m["decode_flops"] > 0
    chunks = list(client.completions.create(stream=True, stream_options={"include_usage": True}, **kw))
    body = [c for c in chunks if c.choices]
    assert "".join(c.choices[0].text for c in body) == choice.text
    assert [t for c in body for t in token_ids(c.choices[0])] == token_ids(choice)
    # one event per token unless the server fell behind the engine (then what piled up is merged)
    assert len(body) > 1 and all(token_ids(c.choices[0]) for c in body)
    assert body[-1].choices[0].finish_reason == "length"
    assert chunks[-1].usage.completion_tokens == n and chunks[-1].usage.prompt_tokens == prompt_tokens
    assert all(c.usage is None for c in chunks[:-1])


def test_chat_stream_equals_non_stream(served, client):
    _, _, tok = served
    messages = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "直播 what's up?"}]
    kw = dict(model=MODEL, messages=messages, max_tokens=10, temperature=0, extra_body={"ignore_eos": True})
    full = client.chat.completions.create(**kw)
    text = full.choices[0].message.content
    assert full.choices[0].message.role == "assistant" and full.usage.completion_tokens == 10
    prompt = tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    assert full.usage.prompt_tokens == len(tok.encode(prompt, add_special_tokens=False))
    chunks = list(client.chat.completions.create(stream=True, **kw))
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in chunks) == text
    assert chunks[-1].choices[0].finish_reason == "length"
    # no max_tokens: the rest of the context (256) is the limit
    out = client.chat.completions.create(model=MODEL, messages=messages, temperature=0, extra_body={"ignore_eos": True})
    assert out.usage.prompt_tokens + out.usage.completion_tokens == 256 and out.choices[0].finish_reason == "length"


def test_n_seed_stop_and_logprobs(served, client):
    kw = dict(model=MODEL, prompt="viewers ask", max_tokens=8, temperature=1.0, seed=11, n=3, logprobs=2,
              extra_body={"ignore_eos": True, "top_k": 40, "min_p": 0.01, "return_token_ids": True})
    a, b = client.completions.create(**kw), client.completions.create(**kw)
    assert [c.index for c in a.choices] == [0, 1, 2] and a.usage.completion_tokens == 24
    assert [token_ids(c) for c in a.choices] == [token_ids(c) for c in b.choices]  # seeded
    assert len({tuple(token_ids(c)) for c in a.choices}) > 1  # n samples, not one copied
    for c in a.choices:
        lp = c.logprobs
        assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == 8
        for top, v in zip(lp.top_logprobs, lp.token_logprobs):
            assert len(top) <= 2 and max(top.values()) >= v - 1e-6  # the top ones, sampled or not
    streamed: dict[int, list] = {}
    for chunk in client.completions.create(stream=True, **kw):
        for c in chunk.choices:
            streamed.setdefault(c.index, []).extend(c.logprobs.token_logprobs)
    for c in a.choices:
        assert streamed[c.index] == pytest.approx(c.logprobs.token_logprobs, abs=1e-5)
    # several prompts: choice k * n + j is completion j of prompt k, as if each prompt came alone
    kw.update(n=2, prompt=["viewers ask", "直播 question"])
    both = client.completions.create(**kw)
    alone = [client.completions.create(**{**kw, "prompt": p}) for p in kw["prompt"]]
    assert [c.index for c in both.choices] == [0, 1, 2, 3]
    assert [token_ids(c) for c in both.choices] == [token_ids(c) for a in alone for c in a.choices]
    assert both.usage.prompt_tokens == sum(a.usage.prompt_tokens for a in alone)
    # chat logprobs
    chat = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "hi"}], max_tokens=5,
                                          temperature=0, logprobs=True, top_logprobs=3,
                                          extra_body={"ignore_eos": True})
    content = chat.choices[0].logprobs.content
    assert len(content) == 5 and all(len(c.top_logprobs) == 3 for c in content)
    assert all(c.top_logprobs[0].logprob == pytest.approx(c.logprob) for c in content)  # greedy: the top one
    # stop strings: the text ends before the first one
    base = client.completions.create(model=MODEL, prompt="stop test", max_tokens=16, temperature=0,
                                     extra_body={"ignore_eos": True})
    stop = base.choices[0].text[5:7]
    cut = client.completions.create(model=MODEL, prompt="stop test", max_tokens=16, temperature=0, stop=[stop],
                                    extra_body={"ignore_eos": True})
    assert cut.choices[0].text == base.choices[0].text[:base.choices[0].text.index(stop)]
    assert cut.choices[0].finish_reason == "stop"
    streamed = "".join(c.choices[0].text for c in client.completions.create(
        model=MODEL, prompt="stop test", max_tokens=16, temperature=0, stop=[stop], stream=True,
        extra_body={"ignore_eos": True}))
    assert streamed == cut.choices[0].text


BAD = [
    (dict(max_tokens=-1), "max_tokens"),
    (dict(temperature=-0.5), "temperature"),
    (dict(top_p=0), "top_p"),
    (dict(top_p=1.5), "top_p"),
    (dict(prompt="word " * 300), "context"),
    (dict(max_tokens=100000), "maximum context length is 256 tokens"),  # refused, not clamped
    (dict(extra_body={"top_k": "many"}), "top_k"),
    (dict(presence_penalty=2.5), "presence_penalty"),
    (dict(extra_body={"prompt_logprob": 1}), "prompt_logprob: unknown field"),
    (dict(extra_body={"prompt_logprobs": -1}), "prompt_logprobs"),  # json: out of range; sse: not with stream
    (dict(logprobs=99), "logprobs"),
    # integers the engine cannot hold: once a 500 for every request in flight
    (dict(seed=2**64), "seed"),
    (dict(seed=2**63 - 1, n=2), "seed + n - 1"),
    (dict(extra_body={"top_k": 2**63}), "top_k"),
    (dict(n=10**6), "n: 1000000 is over this server's limit"),
    # no coercion, no non-finite numbers
    (dict(extra_body={"max_tokens": "5"}), "max_tokens"),
    (dict(extra_body={"max_tokens": True}), "max_tokens"),
    (dict(extra_body={"n": 2.0}), "n"),
]
# bodies a JSON library would not write: non-finite numbers (Python's json reads them), lone surrogates
RAW_BAD = [
    (b'{"model": "tiny", "prompt": "hi", "temperature": Infinity}', "temperature"),
    (b'{"model": "tiny", "prompt": "hi", "temperature": NaN}', "temperature"),
    (b'{"model": "tiny", "prompt": "hi", "temperature": 1e999}', "temperature"),
    (b'{"model": "tiny", "prompt": "lone \\ud800 surrogate"}', "not valid Unicode"),
    (b'{"model": "tiny", "messages": [{"role": "user", "content": "x \\udfff"}]}', "not valid Unicode"),
    (b'{"model": "tiny", "messages": [{"role": "hacker", "content": "hi"}]}', "role"),
    (b'{"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "max_tokens": "5"}', "max_tokens"),
]


@pytest.mark.parametrize("stream", [False, True], ids=["json", "sse"])
def test_bad_requests_get_400_and_server_keeps_serving(served, client, stream):
    _, server, _ = served
    for overrides, words in BAD:
        kw = dict(model=MODEL, prompt="hi", max_tokens=4, stream=stream)
        kw.update(overrides)
        with pytest.raises(openai.BadRequestError) as err:
            client.completions.create(**kw)
        assert err.value.status_code == 400
        assert words in err.value.body["message"] and err.value.body["type"] == "invalid_request_error"
    with pytest.raises(openai.BadRequestError, match="messages"):
        client.chat.completions.create(model=MODEL, messages=[], stream=stream)
    raw_bad = [(raw, "") for raw in (b"{not json", b'{"model": "tiny", "prompt": "hi", "max_tokens": 4', b"[1, 2]")]
    for raw, words in raw_bad + RAW_BAD:
        route = "/v1/chat/completions" if b"messages" in raw else "/v1/completions"
        req = urllib.request.Request(server.url + route, data=raw, headers={"Content-Type": "application/json"})
        with pytest.raises(urllib.error.HTTPError) as err:
            urllib.request.urlopen(req, timeout=10)
        assert err.value.code == 400, raw
        error = json.loads(err.value.read())["error"]
        assert error["type"] == "invalid_request_error" and words in error["message"], (raw, error)
    ok = client.completions.create(model=MODEL, prompt="hi", max_tokens=3, extra_body={"ignore_eos": True})
    assert ok.usage.completion_tokens == 3
    assert urllib.request.urlopen(server.url + "/health", timeout=10).status == 200


def test_32_concurrent_streams_then_drop_half(tmp_path):
    # its own server, with a 512-token context so that the streams that leave ask for 460 tokens: the engine
    # (its own process) ran 200 for 32 streams in ~0.3 s, which a client on a loaded host (sharing this
    # process's interpreter lock with the server) could take to read 3 events, and the server had sent them all
    path, _ = make_text_checkpoint(tmp_path / "ckpt", moe=True)
    engine, server = start(path, block_size=16, num_kv_blocks=560, max_model_len=512)
    try:
        drop_half(engine, server, long_tokens=460)
    finally:
        server.stop()
        engine.shutdown()


def drop_half(engine, server, long_tokens: int) -> None:
    client = openai.AsyncOpenAI(base_url=server.url + "/v1", api_key="none", max_retries=0, timeout=120)
    prompts = [f"viewer {i}: {'你好' * (i % 3)} question {i * 7}?" for i in range(32)]
    extra = {"ignore_eos": True, "return_token_ids": True}
    idle = engine.stats()["kv_blocks_used"]

    async def full(p, n):
        r = await client.completions.create(model=MODEL, prompt=p, max_tokens=n, temperature=0, extra_body=extra)
        return token_ids(r.choices[0]), r.choices[0].text

    async def streamed(p, n, drop_after=None):
        ids, text, chunks = [], [], 0
        stream = await client.completions.create(model=MODEL, prompt=p, max_tokens=n, temperature=0, stream=True,
                                                 extra_body=extra)
        async for chunk in stream:
            ids += token_ids(chunk.choices[0])
            text.append(chunk.choices[0].text)
            chunks += 1
            if drop_after is not None and chunks == drop_after:
                await stream.close()  # the client goes away mid-stream
                break
        return ids, "".join(text)

    async def main():
        expected = await asyncio.gather(*(full(p, 16) for p in prompts))
        got = await asyncio.gather(*(streamed(p, 16) for p in prompts))
        aborts = metric(server.url, 'livemoe_requests_finished_total{finish_reason="abort"}')
        # half run to the end; half ask for long_tokens and leave after 3 chunks
        mixed = await asyncio.gather(*(streamed(p, 16) if i % 2 else streamed(p, long_tokens, drop_after=3)
                                       for i, p in enumerate(prompts)))
        await client.close()
        return expected, got, mixed, aborts

    expected, got, mixed, aborts_before = asyncio.run(main())
    assert got == expected  # every token, none lost or duplicated, and the same text
    for i, (ids, _) in enumerate(mixed):
        if i % 2:
            assert (ids, _) == expected[i]
        else:
            # three events (more tokens if some were merged while the server lagged), then gone
            # (greedy: its first tokens are the 16-token answer's; it may have got more than 16 before leaving)
            n = min(len(ids), len(expected[i][0]))
            assert 3 <= len(ids) < long_tokens and ids[:n] == expected[i][0][:n]
    wait_idle(engine, idle)
    aborts = metric(server.url, 'livemoe_requests_finished_total{finish_reason="abort"}')
    assert aborts - aborts_before == 16  # the dropped streams were aborted, not run to long_tokens


def test_split_characters_stream_without_replacement(tmp_path):
    path, tok, cycle = make_cycle_checkpoint(tmp_path / "cycle", CYCLE_TEXT)
    engine, server = start(path, block_size=16, num_kv_blocks=32)
    try:
        client = openai.OpenAI(base_url=server.url + "/v1", api_key="none", max_retries=0, timeout=60)
        kw = dict(model=MODEL, prompt=cycle, max_tokens=2 * len(cycle), temperature=0,
                  extra_body={"ignore_eos": True})
        full = client.completions.create(**kw).choices[0].text
        assert full == CYCLE_TEXT * 2
        parts = [c.choices[0].text for c in client.completions.create(stream=True, **kw)]
        assert "".join(parts) == full and not any("\ufffd" in p for p in parts)
        # some event ended inside a character: it carries no text, its bytes wait for the next event (counting events
        # against characters instead would depend on how many steps the server merged while it lagged)
        assert "" in parts[:-1]
    finally:
        server.stop()
        engine.shutdown()


def wait_idle(engine, idle=0):
    deadline = time.monotonic() + WAIT_S
    while engine.stats()["kv_blocks_used"] != idle or engine.stats()["num_requests"]:
        assert time.monotonic() < deadline, f"KV blocks not back to idle: {engine.stats()}"
        time.sleep(0.02)


def test_client_leaving_a_json_request_aborts_it(served):
    engine, server, _ = served
    before = metric(server.url, 'livemoe_requests_finished_total{finish_reason="abort"}')
    impatient = openai.OpenAI(base_url=server.url + "/v1", api_key="none", max_retries=0, timeout=0.05)
    # 16 completions of 240 tokens take about a second here (one took ~0.1 s once the CPU decode step got faster)
    with pytest.raises(openai.APITimeoutError):
        impatient.completions.create(model=MODEL, prompt="long", max_tokens=240, n=16, extra_body={"ignore_eos": True})
    wait_idle(engine)
    assert metric(server.url, 'livemoe_requests_finished_total{finish_reason="abort"}') == before + 16  # each completion


def test_models_health_metrics_and_log_line(served, client, caplog):
    engine, server, _ = served
    assert [m.id for m in client.models.list().data] == [MODEL]
    health = json.loads(urllib.request.urlopen(server.url + "/health", timeout=10).read())
    assert health == {"status": "ok"}
    with caplog.at_level(logging.INFO, logger="livemoe.engine.server"):
        client.completions.create(model=MODEL, prompt="count me", max_tokens=4, extra_body={"ignore_eos": True})
    lines = [r.getMessage() for r in caplog.records if "finished" in r.getMessage()]
    assert len(lines) == 1 and all(w in lines[0] for w in ("output_tokens=4", "ttft=", "tpot=", "decode_flops="))
    text = urllib.request.urlopen(server.url + "/metrics", timeout=10).read().decode()
    for name in ("livemoe_time_to_first_token_seconds_bucket", "livemoe_time_per_output_token_seconds_count",
                 "livemoe_num_requests_running", "livemoe_num_requests_waiting", "livemoe_kv_blocks_used",
                 "livemoe_prefix_cache_hit_rate", "livemoe_eager_fallbacks_total", "livemoe_decode_flops_total"):
        assert name in text, name
    assert metric(server.url, "livemoe_time_to_first_token_seconds_count") >= 1
    assert metric(server.url, "livemoe_decode_flops_total") > 0
    assert metric(server.url, "livemoe_kv_blocks_total") == engine.stats()["kv_blocks_total"]


def test_command_line(tmp_path):
    """`livemoe serve` as a user runs it: engine options as flags, then one request."""
    from livemoe.engine.server.__main__ import main, parser

    path, _ = make_text_checkpoint(tmp_path / "cli")
    flags = ["--dtype", "float32", "--device", "cpu", "--num-kv-blocks", "32", "--block-size", "16",
             "--no-enable-prefix-caching", "--threads", "1", "--max-n", "3"]
    with ServerProcess(path, MODEL, flags, env={"OMP_NUM_THREADS": "1", "LIVEMOE_API_KEY": "k3y"}) as server:
        client = openai.OpenAI(base_url=server.url + "/v1", api_key="k3y", max_retries=0, timeout=60)
        out = client.completions.create(model=MODEL, prompt="cli", max_tokens=5, extra_body={"ignore_eos": True})
        assert out.usage.completion_tokens == 5
        assert metric(server.url, "livemoe_kv_blocks_total") == 32
        with pytest.raises(openai.BadRequestError, match="--max-n"):
            client.completions.create(model=MODEL, prompt="cli", max_tokens=2, n=4)
        with pytest.raises(openai.NotFoundError):  # --served-model-name tiny: the folder's name is not served
            client.completions.create(model="cli", prompt="cli", max_tokens=2)
        with pytest.raises(openai.AuthenticationError):  # the key came from LIVEMOE_API_KEY
            openai.OpenAI(base_url=server.url + "/v1", api_key="none", max_retries=0).models.list()
    assert server.proc.returncode is not None
    with pytest.raises(SystemExit, match="block_size must be a power of two"):
        main(["--model", path, "--block-size", "3"])
    with pytest.raises(SystemExit, match="max_body_bytes must be a positive int"):
        main(["--model", path, "--max-body-bytes", "0"])
    args = parser().parse_args(["--model", path] + flags)
    assert (args.num_kv_blocks, args.enable_prefix_caching) == (32, False) and not hasattr(args, "max_num_seqs")
