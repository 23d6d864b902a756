"""The live-session endpoints over loopback: create, step (decisions from cached context), delete;
404 for unknown ids, 400 for bad events and fields; idle sessions expire and give their blocks back;
/metrics counts sessions and decisions."""
import json
import re
import time
import urllib.error
import urllib.request

import pytest
import torch

pytest.importorskip("fastapi", reason="needs the server extras fastapi and uvicorn (pip install -e .[test])")
pytest.importorskip("uvicorn", reason="needs the server extras fastapi and uvicorn (pip install -e .[test])")

import engine.server.live as live_http  # noqa: E402
from engine.async_llm import AsyncLLM  # noqa: E402
from engine.live import KINDS  # noqa: E402
from engine.server import BackgroundServer  # noqa: E402
from tiny_tokenizer import make_text_checkpoint  # noqa: E402

pytestmark = pytest.mark.usefixtures("one_thread")
SYSTEM = "live assistant. link 3: pork zongzi. price: 39 yuan."


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    path, _ = make_text_checkpoint(tmp_path_factory.mktemp("livesrv") / "ckpt", moe=True,
                                   max_position_embeddings=1024)
    engine = AsyncLLM(path, dtype=torch.float32, device="cpu", use_tqdm=False, block_size=16, num_kv_blocks=128)
    old, live_http.IDLE_TIMEOUT_S = live_http.IDLE_TIMEOUT_S, 1.5  # read when the app is built
    try:
        server = BackgroundServer(engine, "tiny").start()
    finally:
        live_http.IDLE_TIMEOUT_S = old
    yield engine, server
    server.stop()
    engine.shutdown()


def call(url: str, method: str = "POST", body=None) -> tuple:
    data = None if body is None else json.dumps(body).encode()
    req = urllib.request.Request(url, data=data, method=method, headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=60) as r:
            return r.status, json.loads(r.read())
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read())


def test_create_step_delete_with_cached_context(served):
    engine, server = served
    base = server.url + "/v1/live/sessions"
    status, s = call(base, body={"system": SYSTEM, "max_message_chars": 24, "temperature": 1.0, "seed": 3})
    assert status == 200 and s["object"] == "live.session"
    decisions = []
    for events in ([{"type": "join", "user": "amy"}], "comment @amy: how much is link 3?", []):
        status, d = call(f"{base}/{s['id']}/step", body={"events": events})
        assert status == 200, d
        assert d["kind"] in KINDS and set(d) == {"kind", "recipient", "task", "message", "metrics"}
        decisions.append(d)
    for d in decisions[1:]:  # all but the new events and the previous decision's end token came from the cache
        m = d["metrics"]
        assert m["cached_prompt_tokens"] > 0.6 * m["prompt_tokens"]
        assert m["latency_s"] > 0 and m["completion_tokens"] >= 2
    text = urllib.request.urlopen(server.url + "/metrics", timeout=10).read().decode()
    counted = sum(float(x) for x in re.findall(r'^livemoe_live_decisions_total\{kind="\w+"\} (\S+)$', text, re.M))
    assert counted >= 3 and "livemoe_live_decision_latency_seconds_count" in text
    assert re.search(r"^livemoe_live_sessions \d", text, re.M)
    assert call(f"{base}/{s['id']}", "DELETE") == (200, {"id": s["id"], "deleted": True})
    status, err = call(f"{base}/{s['id']}/step", body={"events": []})
    assert status == 404 and "no live session" in err["error"]["message"]


def test_bad_ids_events_and_fields(served):
    _, server = served
    base = server.url + "/v1/live/sessions"
    assert call(f"{base}/nope/step", body={"events": []})[0] == 404
    assert call(f"{base}/nope", "DELETE")[0] == 404
    status, s = call(base, body={"system": SYSTEM, "max_message_chars": 24})
    for body, why in [({"events": [{"type": "shout", "text": "x"}]}, "events[0].type must be one of"),
                      ({"events": [{"type": "gift", "text": "rose"}]}, "needs a user"),
                      ({"events": 7}, "events"), ({"events": [], "colour": 1}, "colour"),
                      ({"events": [], "t": -1}, "t")]:
        status, err = call(f"{base}/{s['id']}/step", body=body)
        assert status == 400 and why in err["error"]["message"], (body, err)
    assert call(base, body={"system": ""})[0] == 400
    assert call(base, body={"system": SYSTEM, "temperature": "hot"})[0] == 400
    status, d = call(f"{base}/{s['id']}/step", body={"events": []})  # still serves after the refusals
    assert status == 200 and d["kind"] in KINDS


def test_idle_sessions_expire_and_free_their_blocks(served):
    engine, server = served
    base = server.url + "/v1/live/sessions"
    bm = engine.llm.block_manager
    status, a = call(base, body={"system": SYSTEM, "max_message_chars": 24})
    assert call(f"{base}/{a['id']}/step", body={"events": []})[0] == 200
    pinned_with_a = bm.num_pinned_blocks
    assert pinned_with_a > 0
    time.sleep(2.0)  # past the idle timeout (1.5 s here)
    status, b = call(base, body={"system": SYSTEM + " other", "max_message_chars": 24})  # sweeps the idle
    assert call(f"{base}/{a['id']}/step", body={"events": []})[0] == 404
    status, d = call(f"{base}/{b['id']}/step", body={"events": []})  # the engine's next step frees a's
    assert status == 200
    m = d["metrics"]  # only b's blocks stay pinned: its computed tokens (all but the end token)
    assert bm.num_pinned_blocks == -(-(m["prompt_tokens"] + m["completion_tokens"] - 1) // 16)
    call(f"{base}/{b['id']}", "DELETE")
