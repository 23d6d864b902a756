"""Hostile and careless requests against the server as users start it: `python -m livemoe.engine.server`, the
engine core in its own process (the default). Live sessions over the process core, a large live step that
must not stall /health, the cap on open sessions, JSON nested too deep, lone surrogates, a 500 that must
not break the connection it came on, the grammar-compile budget, admin routes off by default, two Host
headers."""
import http.client
import json
import re
import threading
import time
import urllib.error
import urllib.request

import pytest

from fixtures import http_json, require_server_extras
from tiny_tokenizer import make_text_checkpoint

require_server_extras()

SYSTEM = "live assistant. link 3: pork zongzi. price: 39 yuan."
OPTIONS = ["--num-kv-blocks", "128", "--block-size", "16", "--threads", "1", "--device", "cpu", "--dtype",
           "float32"]


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    return make_text_checkpoint(tmp_path_factory.mktemp("hardening") / "ckpt", moe=True,
                                max_position_embeddings=1024)[0]


@pytest.fixture(scope="module")
def server(ckpt):
    """The server as the CLI starts it (engine core in a process), its server options at their defaults."""
    from livemoe.engine.server import ServerProcess

    with ServerProcess(ckpt, "tiny", OPTIONS) as s:
        yield s


def metric(server, name: str) -> float:
    text = urllib.request.urlopen(server.url + "/metrics", timeout=10).read().decode()
    return sum(float(v) for v in re.findall(rf"^{name}(?:\{{[^}}]*\}})? (\S+)$", text, re.M))


def exited(pid: int) -> bool:
    """Whether process pid (another's child) has exited: gone, or a zombie its parent has not reaped yet."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] == "Z"
    except FileNotFoundError:
        return True


def wait_for(condition, within_s: float = 20.0) -> bool:
    deadline = time.monotonic() + within_s
    while time.monotonic() < deadline:
        if condition():
            return True
        time.sleep(0.05)
    return False


# -- live sessions on the engine-core process (issue 35, item 2) ---------------------------------------------------


def test_live_session_on_the_process_core(server):
    """Create, three steps (each but the first served from the pinned context), delete: the pins are given back."""
    base = server.url + "/v1/live/sessions"
    status, s = http_json(base, {"system": SYSTEM, "max_message_chars": 24, "temperature": 1.0, "seed": 3})
    assert status == 200 and s["object"] == "live.session", s
    decisions = []
    for events in ([{"type": "join", "user": "amy"}], "comment @amy: how much is link 3?", []):
        status, d = http_json(f"{base}/{s['id']}/step", {"events": events})
        assert status == 200, d
        decisions.append(d)
    for d in decisions[1:]:
        m = d["metrics"]
        assert m["cached_prompt_tokens"] > 0.6 * m["prompt_tokens"], m
    assert metric(server, "livemoe_kv_blocks_pinned") > 0
    assert http_json(f"{base}/{s['id']}", method="DELETE") == (200, {"id": s["id"], "deleted": True})
    assert wait_for(lambda: metric(server, "livemoe_kv_blocks_pinned") == 0)


def test_live_session_limits_at_create(server):
    """A max_context too small for one step is refused at create; past --max-live-sessions, a 429."""
    base = server.url + "/v1/live/sessions"
    status, err = http_json(base, {"system": SYSTEM, "max_context": 8})
    assert status == 400 and "max_context 8 is too small" in err["error"]["message"], err
    ids = []
    try:
        while len(ids) <= 256:
            status, s = http_json(base, {"system": SYSTEM, "max_message_chars": 24})
            if status != 200:
                break
            ids.append(s["id"])
        assert status == 429 and "--max-live-sessions 256" in s["error"]["message"], s
        assert len(ids) <= 256
    finally:
        for i in ids:
            http_json(f"{base}/{i}", method="DELETE")
    assert http_json(base, {"system": SYSTEM})[0] == 200  # room again


def test_health_answers_during_a_large_live_step(server):
    """A live step of ~2 MB of events is tokenized off the event loop: /health answers meanwhile."""
    base = server.url + "/v1/live/sessions"
    status, s = http_json(base, {"system": SYSTEM, "max_message_chars": 24})
    assert status == 200, s
    events = [{"type": "comment", "user": f"u{i}", "text": "how much is link 3 " * 20} for i in range(5000)]
    result = {}

    def big_step():
        result["answer"] = http_json(f"{base}/{s['id']}/step", {"events": events}, timeout=300)

    t = threading.Thread(target=big_step)
    t.start()
    try:
        time.sleep(0.3)
        worst = 0.0
        while t.is_alive():
            t0 = time.monotonic()
            assert http_json(server.url + "/health", timeout=30)[0] == 200
            worst = max(worst, time.monotonic() - t0)
            time.sleep(0.05)
    finally:
        t.join(300)
    status, err = result["answer"]
    assert status == 400, err  # it cannot fit the context
    assert worst < 2.0, f"/health took {worst:.2f} s during the large step"
    http_json(f"{base}/{s['id']}", method="DELETE")


# -- data parallel: a dead replica is skipped at once (item 3) ------------------------------------------------------


def test_requests_go_to_the_live_replica_when_one_core_dies(ckpt):
    """--data-parallel-size 2 as the CLI starts it: core 1 is killed; every request after that goes to core 0 at
    once (no 5xx, no wait), while core 1 is restarted (the default with several replicas)."""
    import os
    import signal

    from livemoe.engine.server import ServerProcess

    with ServerProcess(ckpt, "tiny", [*OPTIONS, "--data-parallel-size", "2"]) as s:
        keep, pid = http_json(s.url + "/get_server_info")[1]["core_pids"]
        os.kill(pid, signal.SIGKILL)
        assert wait_for(lambda: exited(pid), within_s=5)  # the kernel has ended it (the server has not looked yet)
        answers = [http_json(s.url + "/v1/completions", {"model": "tiny", "prompt": f"hi {i}", "max_tokens": 4})
                   for i in range(10)]
        assert [a[0] for a in answers] == [200] * 10, answers
        assert s.proc.poll() is None
        assert wait_for(lambda: http_json(s.url + "/get_server_info")[1]["core_pids"][1] != pid
                        and http_json(s.url + "/health")[0] == 200, within_s=120)  # restarted
        info = http_json(s.url + "/get_server_info")[1]
        assert info["core_pids"][0] == keep
        for core in info["core_pids"]:  # both: requests fail (503, at once) only now, until a core is back
            os.kill(core, signal.SIGKILL)
        assert wait_for(lambda: http_json(s.url + "/health")[0] == 503, within_s=10)
        t0 = time.monotonic()
        status, err = http_json(s.url + "/v1/completions", {"model": "tiny", "prompt": "hi", "max_tokens": 4})
        assert status == 503 and time.monotonic() - t0 < 5 and "stopped" in err["error"]["message"], err
        assert wait_for(lambda: http_json(s.url + "/health")[0] == 200, within_s=120)  # both restarted
        assert http_json(s.url + "/v1/completions", {"model": "tiny", "prompt": "hi", "max_tokens": 4})[0] == 200


# -- JSON nested too deep, lone surrogates, a 500 on a keep-alive connection (items 5 and 7) -----------------------


def raw_post(server, path: str, body: bytes, conn: http.client.HTTPConnection | None = None) -> tuple:
    """(status, content type, body) of one POST on `conn` (a fresh connection by default)."""
    conn = conn or http.client.HTTPConnection(server.host, server.port, timeout=60)
    conn.request("POST", path, body, {"Content-Type": "application/json"})
    r = conn.getresponse()
    return r.status, r.getheader("content-type"), r.read()


@pytest.mark.parametrize("path", ["/v1/chat/completions", "/v1/completions", "/v1/live/sessions"])
def test_json_nested_too_deep_is_a_400(server, path):
    deep = b'{"model": "tiny", "messages": ' + b"[" * 1000 + b"]" * 1000 + b"}"
    status, kind, body = raw_post(server, path, deep)
    assert status == 400 and kind == "application/json", (status, body[:200])
    assert "nested more than 128 levels" in json.loads(body)["error"]["message"]
    # 100 deep (within the limit) goes on to the route's own checks
    status, _, body = raw_post(server, path, b'{"model": "tiny", "prompt": ' + b"[" * 100 + b"]" * 100 + b"}")
    assert status == 400 and "nested" not in json.loads(body)["error"]["message"]


def test_lone_surrogates_are_a_400(server):
    base = server.url + "/v1/live/sessions"
    status, s = http_json(base, {"system": SYSTEM, "max_message_chars": 24})
    assert status == 200, s
    for path, body in [(f"/v1/live/sessions/{s['id']}/step",
                        {"events": [{"type": "comment", "user": "amy", "text": "hi \ud800"}]}),
                       ("/v1/live/sessions", {"system": "you \udfff"}),
                       ("/v1/chat/completions", {"model": "tiny", "messages": [{"role": "user", "content": "\ud83d"}]}),
                       ("/v1/completions", {"model": "tiny", "prompt": "a\udc00b"})]:
        status, kind, answer = raw_post(server, path, json.dumps(body).encode())
        assert status == 400 and "lone surrogate" in json.loads(answer)["error"]["message"], (path, answer)
    # a valid pair, escaped as Python's json.dumps writes it, is text like any other
    status, _, answer = raw_post(server, f"/v1/live/sessions/{s['id']}/step", json.dumps({"events": "hi 🙂"}).encode())
    assert status == 200, answer
    http_json(f"{base}/{s['id']}", method="DELETE")


@pytest.fixture(scope="module")
def in_process(ckpt):
    """The app over a process-core AsyncLLM, served on a thread of this process (so a test can reach into it)."""
    import torch

    from livemoe.engine.async_llm import AsyncLLM
    from livemoe.engine.server import BackgroundServer

    engine = AsyncLLM(ckpt, engine_core="process", dtype=torch.float32, device="cpu", threads=1, block_size=16,
                      num_kv_blocks=64, use_tqdm=False)
    try:
        with BackgroundServer(engine, "tiny") as server:
            yield server
    finally:
        engine.shutdown()


def test_a_500_leaves_the_keep_alive_connection_usable(in_process, monkeypatch):
    """A route that fails (an internal error, injected) answers a JSON 500, and the client's next request on the
    same connection is answered: on a FastAPI route (live sessions) and on a hot route."""
    server = in_process
    api = server.app.state.server

    def broken(*a, **k):
        raise RuntimeError("injected fault")

    conn = http.client.HTTPConnection(server.host, server.port, timeout=60)
    ok = json.dumps({"model": "tiny", "prompt": "hi", "max_tokens": 2}).encode()
    for path, name, body in [("/v1/live/sessions", "check_text_fits", json.dumps({"system": SYSTEM}).encode()),
                             ("/v1/completions", "check_available", ok)]:
        with monkeypatch.context() as m:
            m.setattr(api, name, broken)
            status, kind, answer = raw_post(server, path, body, conn)
        assert status == 500 and "injected fault" in json.loads(answer)["error"]["message"], answer
        status, _, answer = raw_post(server, "/v1/completions", ok, conn)  # the same connection
        assert status == 200, answer


def test_live_events_are_tokenized_off_the_event_loop(in_process, monkeypatch):
    """A live step whose tokenizing takes 2 s (a large interval; slowed here) leaves /health answering at once."""
    server = in_process
    base = server.url + "/v1/live/sessions"
    status, s = http_json(base, {"system": SYSTEM, "max_message_chars": 24})
    assert status == 200, s
    tok = server.app.state.server.tokenizer
    real = tok.encode

    def slow_encode(*a, **kw):
        time.sleep(2.0)
        return real(*a, **kw)

    monkeypatch.setattr(tok, "encode", slow_encode)
    result = {}
    step = threading.Thread(target=lambda: result.update(r=http_json(f"{base}/{s['id']}/step", {"events": "hi"})))
    step.start()
    time.sleep(0.3)
    t0 = time.monotonic()
    assert http_json(server.url + "/health", timeout=10)[0] == 200
    took = time.monotonic() - t0
    step.join(60)
    monkeypatch.undo()
    assert result["r"][0] == 200, result
    assert took < 1.0, f"/health took {took:.2f} s during the step's tokenizing"
    http_json(f"{base}/{s['id']}", method="DELETE")


# -- the grammar-compile budget (item 6) -----------------------------------------------------------------------------


def test_grammar_compile_over_the_budget_is_a_400(ckpt):
    """--max-grammar-compile-s 0.2: a pattern whose compile takes seconds is a 400 naming the flag, at once again
    while that compile runs on; a small schema still compiles and serves meanwhile."""
    from livemoe.engine.server import ServerProcess

    slow = {"type": "json_schema", "json_schema": {"name": "x", "schema": {
        "type": "object", "properties": {"a": {"type": "string", "pattern": "^(a|b|c){1,3000}$"}}}}}
    fast = {"type": "json_schema", "json_schema": {"name": "y", "schema": {
        "type": "object", "properties": {"b": {"type": "integer"}}, "required": ["b"]}}}
    body = {"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 8}
    with ServerProcess(ckpt, "tiny", [*OPTIONS, "--max-grammar-compile-s", "0.2"]) as s:
        t0 = time.monotonic()
        status, err = http_json(s.url + "/v1/chat/completions", {**body, "response_format": slow})
        assert status == 400 and "--max-grammar-compile-s 0.2" in err["error"]["message"], err
        assert time.monotonic() - t0 < 5.0
        # again at once: refused without waiting while that compile runs on (or served from the cache once done)
        status, err = http_json(s.url + "/v1/chat/completions", {**body, "response_format": slow, "max_tokens": 1})
        assert status == 200 or "still running" in err["error"]["message"], err
        status, out = http_json(s.url + "/v1/chat/completions", {**body, "response_format": fast})
        assert status == 200, out


# -- admin routes off by default; two Host headers (item 8, item 11) ------------------------------------------------


def test_admin_routes_are_off_by_default(server, ckpt):
    for path, body in [("/update_weights_from_disk", {"model_path": ckpt}), ("/sleep", {"level": 1}),
                       ("/wake_up", {}), ("/update_weights_from_distributed", {"names": ["a"], "dtypes": ["float32"],
                                                                              "shapes": [[1]]}),
                       ("/init_weights_update_group", {"master_address": "127.0.0.1", "master_port": 1,
                                                       "rank_offset": 1, "world_size": 2})]:
        status, err = http_json(server.url + path, body)
        assert status == 403 and "--enable-admin-routes" in err["error"]["message"], (path, err)
    assert http_json(server.url + "/is_sleeping") == (200, {"is_sleeping": False, "level": 0})  # read-only: open
    assert http_json(server.url + "/health")[0] == 200


def test_admin_routes_with_the_flag_or_a_key(ckpt):
    """--enable-admin-routes opens them; --api-key opens them behind the key."""
    from livemoe.engine.server import ServerProcess

    with ServerProcess(ckpt, "tiny", [*OPTIONS, "--enable-admin-routes"]) as s:
        assert http_json(s.url + "/sleep", {"level": 1})[0] == 200
        # an update while asleep is refused, not applied silently on wake (item 11)
        status, err = http_json(s.url + "/update_weights_from_disk", {"model_path": ckpt})
        assert status == 409 and "asleep" in err["error"]["message"] and "wake" in err["error"]["message"], err
        assert http_json(s.url + "/wake_up", {})[0] == 200
        assert http_json(s.url + "/update_weights_from_disk", {"model_path": ckpt})[0] == 200
    with ServerProcess(ckpt, "tiny", OPTIONS, env={"LIVEMOE_API_KEY": "k3y"}) as s:
        assert http_json(s.url + "/sleep", {"level": 1})[0] == 401
        key = {"Authorization": "Bearer k3y"}
        assert http_json(s.url + "/sleep", {"level": 1}, headers=key)[0] == 200
        assert http_json(s.url + "/wake_up", {}, headers=key)[0] == 200


def test_two_host_headers_are_a_400(server):
    conn = http.client.HTTPConnection(server.host, server.port, timeout=30)
    conn.putrequest("GET", "/health", skip_host=True)
    conn.putheader("Host", "localhost")
    conn.putheader("Host", "evil.example")
    conn.endheaders()
    r = conn.getresponse()
    assert r.status == 400 and "2 Host headers" in json.loads(r.read())["error"]["message"]


# -- idle and slow-header sockets (item 11) --------------------------------------------------------------------------


def test_idle_and_slow_header_sockets_are_dropped_and_service_goes_on(ckpt):
    """200 sockets (the issue measured 1,000; this shared 2-core machine runs fewer) that connect and send nothing
    or half their headers: /health and a completion answer meanwhile, and the server closes every one of them
    after --header-timeout-s (1 s here)."""
    import socket

    from livemoe.engine.server import ServerProcess

    with ServerProcess(ckpt, "tiny", [*OPTIONS, "--header-timeout-s", "1"]) as s:
        socks = []
        try:
            for i in range(200):
                sock = socket.create_connection((s.host, s.port), timeout=30)
                if i % 2:
                    sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: localhost\r\nContent-Type: app")
                socks.append(sock)
            t0 = time.monotonic()
            assert http_json(s.url + "/health", timeout=10)[0] == 200
            status, out = http_json(s.url + "/v1/completions", {"model": "tiny", "prompt": "hi", "max_tokens": 2},
                                    timeout=30)
            assert status == 200 and time.monotonic() - t0 < 10, out
            deadline = time.monotonic() + 15
            for sock in socks:  # each is closed by the server: recv sees the end of the stream
                sock.settimeout(max(0.1, deadline - time.monotonic()))
                assert sock.recv(1024) == b""
        finally:
            for sock in socks:
                sock.close()
        # a keep-alive client that sends its next request in time is not affected
        conn = http.client.HTTPConnection(s.host, s.port, timeout=30)
        for _ in range(2):
            conn.request("GET", "/health")
            r = conn.getresponse()
            assert r.status == 200 and r.read()
            time.sleep(0.5)


# -- an early 413 that the client reads (item 10) --------------------------------------------------------------------


def test_a_client_that_sends_its_whole_body_first_reads_the_413(server):
    """urllib (as httpx and the openai package) sends a whole body before reading, without `Expect: 100-continue`:
    8 MB over the 4 MiB default gets the 413 (the rest is read and dropped first), not a broken pipe; the
    connection stays usable."""
    body = json.dumps({"model": "tiny", "prompt": "x" * 8_000_000}).encode()
    req = urllib.request.Request(server.url + "/v1/completions", data=body,
                                 headers={"Content-Type": "application/json"})
    with pytest.raises(urllib.error.HTTPError) as err:
        urllib.request.urlopen(req, timeout=60)
    assert err.value.code == 413 and "--max-body-bytes" in json.loads(err.value.read())["error"]["message"]
    conn = http.client.HTTPConnection(server.host, server.port, timeout=60)
    status, _, _ = raw_post(server, "/v1/completions", body, conn)
    assert status == 413
    status, _, answer = raw_post(server, "/v1/completions", json.dumps({"model": "tiny", "prompt": "hi",
                                                                       "max_tokens": 2}).encode(), conn)
    assert status == 200, answer
