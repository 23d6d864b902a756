"""The lean path of the generation routes (livemoe/engine/server/hot_routes.py) answers exactly as the FastAPI
routes do: two servers over one engine, one with the hot routes and one without, get the same requests,
valid (completions and chat, JSON and streamed, n, seed, stop, logprobs, echo, token ids, usage) and
invalid (malformed JSON, wrong types, NaN, unknown and missing fields, other content types, an unknown
model, limits, context overflow, unsupported fields); statuses and bodies must match, apart from ids,
timestamps and timings. The valid ones are checked to have taken the lean path, the invalid ones the
FastAPI route (its 400 names the field)."""
import json
import math
import urllib.error
import urllib.request

import pytest
import torch

from fixtures import require_server_extras

require_server_extras()

from livemoe.engine.async_llm import AsyncLLM  # noqa: E402
from livemoe.engine.server import BackgroundServer, ServerConfig  # noqa: E402
from livemoe.engine.server import hot_routes  # noqa: E402
from tiny_tokenizer import make_text_checkpoint  # noqa: E402

MODEL = "tiny"
pytestmark = pytest.mark.usefixtures("one_thread")

C, CHAT = "/v1/completions", "/v1/chat/completions"
GEN = dict(model=MODEL, max_tokens=6, temperature=0, ignore_eos=True)
MSG = [{"role": "user", "content": "hi 你好"}]
VALID = [
    (C, dict(GEN, prompt="hello 你好 🙂")),
    (C, dict(GEN, prompt="hello", stream=True, stream_options={"include_usage": True}, return_token_ids=True)),
    (C, dict(GEN, prompt=["one", "two"], n=2, temperature=0.8, seed=7, logprobs=2)),
    (C, dict(GEN, prompt=[5, 6, 7], echo=True, stop=["a"], stream=True)),
    (CHAT, dict(GEN, messages=MSG, logprobs=True, top_logprobs=2)),
    (CHAT, dict(GEN, messages=MSG, stream=True, max_completion_tokens=5)),
    (C, dict(GEN, prompt=["one", "two"], echo=True, logprobs=1, prompt_logprobs=2)),
    (CHAT, dict(GEN, messages=MSG, prompt_logprobs=0)),
]
INVALID = [  # (path, raw body, content type)
    (C, b'{"model": "tiny", "prompt": "x"', "application/json"),  # malformed JSON
    (C, b'{"model": "tiny", "prompt": "x", "max_tokens": "5"}', "application/json"),  # no coercion
    (C, b'{"model": "tiny", "prompt": "x", "temperature": NaN}', "application/json"),
    (C, b'{"model": "tiny", "prompt": "x", "prompt_logprob": 1}', "application/json"),  # unknown field
    (C, b'{"model": "tiny"}', "application/json"),  # missing prompt
    (C, b'[1, 2]', "application/json"),
    (C, b'', "application/json"),
    (C, b'\xff\xfe{', "application/json"),
    (C, json.dumps(dict(GEN, prompt="x")).encode(), "text/plain"),
    (C, json.dumps(dict(GEN, prompt="x")).encode(), "application/vnd.x+json"),  # valid, FastAPI reads +json
    (C, json.dumps(dict(GEN, prompt="x", model="other")).encode(), "application/json"),  # 404
    (C, json.dumps(dict(GEN, prompt="x", max_tokens=100000)).encode(), "application/json"),  # over the context
    (C, json.dumps(dict(GEN, prompt="x", n=9)).encode(), "application/json"),  # over --max-n
    (C, json.dumps(dict(GEN, prompt="x", suffix="y")).encode(), "application/json"),
    (C, json.dumps(dict(GEN, prompt="x", stream_options={"include_usage": True})).encode(), "application/json"),
    (C, json.dumps(dict(GEN, prompt=[])).encode(), "application/json"),
    (CHAT, json.dumps(dict(GEN, messages=[])).encode(), "application/json"),
    (CHAT, json.dumps(dict(GEN, messages=[{"role": "user", "content": "x", "weight": 1}])).encode(),
     "application/json"),
    (CHAT, json.dumps(dict(GEN, messages=MSG, top_logprobs=2)).encode(), "application/json"),
    (CHAT, json.dumps(dict(GEN, messages=MSG, guided_regex="(")).encode(), "application/json"),
]


@pytest.fixture(scope="module")
def servers(tmp_path_factory):
    path, _ = make_text_checkpoint(tmp_path_factory.mktemp("hot") / "ckpt", moe=True)
    engine = AsyncLLM(path, dtype=torch.float32, device="cpu", use_tqdm=False, block_size=16, num_kv_blocks=128,
                      max_model_len=256, enable_prefix_caching=False)  # (cached_tokens would differ)
    config = ServerConfig(max_n=8)
    lean = BackgroundServer(engine, MODEL, config=config).start()
    old = BackgroundServer(engine, MODEL, config=config, hot_routes=False).start()
    yield lean, old
    lean.stop()
    old.stop()
    engine.shutdown()


def post(server, path: str, body: bytes, content_type: str) -> tuple[int, str, bytes]:
    req = urllib.request.Request(server.url + path, data=body, method="POST", headers={"Content-Type": content_type})
    try:
        with urllib.request.urlopen(req, timeout=60) as r:
            return r.status, r.headers["content-type"], r.read()
    except urllib.error.HTTPError as e:
        return e.code, e.headers["content-type"], e.read()


def comparable(content_type: str, body: bytes):
    """The answer without what differs between two runs: ids, timestamps, timings (usage.metrics), and, in
    a stream, how the tokens were split into events (merged when the server falls behind): each choice's
    joined text, token ids and logprobs, its finish reason, and the other events' fields."""
    if content_type.startswith("application/json"):
        return _strip(json.loads(body))
    assert content_type.startswith("text/event-stream"), content_type
    events = [e.removeprefix("data: ") for e in body.decode().split("\n\n") if e]
    assert events[-1] == "[DONE]"
    choices, others = {}, set()
    for e in map(json.loads, events[:-1]):
        e = _strip(e)
        for c in e.pop("choices"):
            _join(choices.setdefault(c.pop("index"), {}), c)
        others.add(json.dumps(e, sort_keys=True))
    return choices, sorted(others)


def _join(into: dict, part: dict) -> None:
    """Adds one event's choice to the choice joined so far (text and lists concatenated; a finish reason,
    null until the last event, set)."""
    for key, value in part.items():
        if isinstance(value, str) and isinstance(into.get(key), str):
            into[key] += value
        elif isinstance(value, list):
            into[key] = into.get(key, []) + value
        elif isinstance(value, dict):
            _join(into.setdefault(key, {}), value)
        elif value is not None or key not in into:
            into[key] = value


def assert_same(got, want, where="answer"):
    """Equal structures, floats (logprobs) within 1e-5: the two servers share one engine, so the second of a pair
    finds the first's prompt in the prefix cache and computes from cached KV instead of one prefill (seen 2e-7
    apart)."""
    if isinstance(want, float) or isinstance(got, float):
        assert math.isclose(got, want, rel_tol=1e-5, abs_tol=1e-6), (where, got, want)
    elif isinstance(want, dict):
        assert isinstance(got, dict) and got.keys() == want.keys(), (where, got, want)
        for k in want:
            assert_same(got[k], want[k], f"{where}.{k}")
    elif isinstance(want, (list, tuple)):
        assert isinstance(got, (list, tuple)) and len(got) == len(want), (where, got, want)
        for i, (g, w) in enumerate(zip(got, want)):
            assert_same(g, w, f"{where}[{i}]")
    else:
        assert got == want, (where, got, want)


def _strip(obj: dict) -> dict:
    obj = {k: v for k, v in obj.items() if k not in ("id", "created")}
    if isinstance(obj.get("usage"), dict):
        obj["usage"] = {k: v for k, v in obj["usage"].items() if k != "metrics"}
    return obj


def count_lean(monkeypatch) -> list:
    """The requests the lean path validated (it served them) are appended to the returned list."""
    served, validated = [], hot_routes._validated

    def counting(model, body, headers):
        request = validated(model, body, headers)
        if request is not None:
            served.append(request)
        return request

    monkeypatch.setattr(hot_routes, "_validated", counting)
    return served


@pytest.mark.parametrize("path,body", VALID, ids=[f"{p}-{i}" for i, (p, _) in enumerate(VALID)])
def test_valid_requests_answer_the_same(servers, monkeypatch, path, body):
    lean, old = servers
    served = count_lean(monkeypatch)
    raw = json.dumps(body).encode()
    got = post(lean, path, raw, "application/json")
    assert len(served) == 1  # the lean path answered
    want = post(old, path, raw, "application/json")
    assert len(served) == 1  # the old server has no lean path
    assert got[:2] == want[:2] and got[0] == 200
    assert_same(comparable(got[1], got[2]), comparable(want[1], want[2]))


@pytest.mark.parametrize("path,body,content_type", INVALID, ids=[f"{p}-{i}" for i, (p, _, _) in enumerate(INVALID)])
def test_invalid_requests_get_the_same_errors(servers, monkeypatch, path, body, content_type):
    lean, old = servers
    served = count_lean(monkeypatch)
    got, want = post(lean, path, body, content_type), post(old, path, body, content_type)
    assert got[0] == want[0] and got[0] in (200, 400, 404), (got, want)
    if got[0] == 200:  # only application/*+json: read as JSON by FastAPI's route
        assert content_type != "application/json" and not served
        assert_same(comparable(got[1], got[2]), comparable(want[1], want[2]))
    else:
        assert got[1:] == want[1:]  # byte for byte: the same error body
        assert json.loads(got[2])["error"]["message"]
