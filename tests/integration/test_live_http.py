"""The live-session endpoints over loopback: create, step (decisions from cached context), delete;
404 for unknown ids, 400 for bad events and fields; idle sessions expire and give their blocks back;
/metrics counts sessions and decisions."""
import re
import time
import urllib.request

import pytest
import torch

from fixtures import http_json, require_server_extras

require_server_extras()

import livemoe.engine.server.live as live_http  # noqa: E402
from livemoe.engine.async_llm import AsyncLLM  # noqa: E402
from livemoe.engine.live import KINDS  # noqa: E402
from livemoe.engine.server import BackgroundServer  # noqa: E402
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


def test_create_step_delete_with_cached_context(served):
    engine, server = served
    base = server.url + "/v1/live/sessions"
    status, s = http_json(base, {"system": SYSTEM, "max_message_chars": 24, "temperature": 1.0, "seed": 3})
    assert status == 200 and s["object"] == "live.session"
    decisions = []
    for events in ([{"type": "join", "user": "amy"}], "comment @amy: how much is link 3?", []):
        status, d = http_json(f"{base}/{s['id']}/step", {"events": events})
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
    assert http_json(f"{base}/{s['id']}", method="DELETE") == (200, {"id": s["id"], "deleted": True})
    status, err = http_json(f"{base}/{s['id']}/step", {"events": []})
    assert status == 404 and "no live session" in err["error"]["message"]


def test_bad_ids_events_and_fields(served):
    _, server = served
    base = server.url + "/v1/live/sessions"
    assert http_json(f"{base}/nope/step", {"events": []})[0] == 404
    assert http_json(f"{base}/nope", method="DELETE")[0] == 404
    status, s = http_json(base, {"system": SYSTEM, "max_message_chars": 24})
    for body, why in [({"events": [{"type": "shout", "text": "x"}]}, "events[0].type must be one of"),
                      ({"events": [{"type": "gift", "text": "rose"}]}, "needs a user"),
                      ({"events": 7}, "events"), ({"events": [], "colour": 1}, "colour"),
                      ({"events": [], "t": -1}, "t")]:
        status, err = http_json(f"{base}/{s['id']}/step", body)
        assert status == 400 and why in err["error"]["message"], (body, err)
    assert http_json(base, {"system": ""})[0] == 400
    assert http_json(base, {"system": SYSTEM, "temperature": "hot"})[0] == 400
    status, d = http_json(f"{base}/{s['id']}/step", {"events": []})  # still serves after the refusals
    assert status == 200 and d["kind"] in KINDS


def test_idle_sessions_expire_and_free_their_blocks(served):
    engine, server = served
    base = server.url + "/v1/live/sessions"
    bm = engine.llm.core.block_manager
    status, a = http_json(base, {"system": SYSTEM, "max_message_chars": 24})
    assert http_json(f"{base}/{a['id']}/step", {"events": []})[0] == 200
    pinned_with_a = bm.num_pinned_blocks
    assert pinned_with_a > 0
    time.sleep(2.0)  # past the idle timeout (1.5 s here)
    status, b = http_json(base, {"system": SYSTEM + " other", "max_message_chars": 24})  # sweeps the idle
    assert http_json(f"{base}/{a['id']}/step", {"events": []})[0] == 404
    status, d = http_json(f"{base}/{b['id']}/step", {"events": []})  # the engine's next step frees a's
    assert status == 200
    m = d["metrics"]  # only b's blocks stay pinned: its computed tokens (all but the end token)
    assert bm.num_pinned_blocks == -(-(m["prompt_tokens"] + m["completion_tokens"] - 1) // 16)
    http_json(f"{base}/{b['id']}", method="DELETE")
