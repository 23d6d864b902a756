"""A rollout server for RL: two data-parallel engine cores (processes) behind one HTTP server.

- 64 greedy requests give one replica's (LLM's) answers, and both replicas served some;
- checkpoint A's answers (checked against transformers), then after POST /update_weights_from_disk of
  B, B's on every replica; a checkpoint of another shape gets a 400 and B's answers go on;
- AsyncLLM.update_weights(tensors) brings A's weights back on both cores; POST
  /init_weights_update_group + /update_weights_from_distributed from this process as rank 0 of a gloo
  group (world size 3: the trainer and the two cores) B's again, with no file;
- POST /sleep -> 503 -> POST /wake_up -> the same answers;
- a replica killed mid-run fails its own requests cleanly, /health says which, the other serves on.
"""
import asyncio
import concurrent.futures
import os
import signal
import urllib.error
import urllib.request

import pytest
import torch

from livemoe.engine.net import free_port
from fixtures import gone, http_json, require_server_extras

openai = require_server_extras()

from tiny_tokenizer import make_text_checkpoint  # noqa: E402

from livemoe.engine.async_llm import AsyncLLM  # noqa: E402
from livemoe.engine.core.router import Router  # noqa: E402
from livemoe.engine.core.weight_sync import join_servers, push_weights_to_servers  # noqa: E402
from livemoe.engine.llm import LLM  # noqa: E402
from livemoe.engine.model.loader import load_model  # noqa: E402
from livemoe.engine.sampling.params import SamplingParams  # noqa: E402
from livemoe.engine.server import BackgroundServer, ServerConfig  # noqa: E402

MODEL = "tiny"
OPTIONS = dict(dtype=torch.float32, device="cpu", block_size=16, num_kv_blocks=128, max_model_len=256,
               use_tqdm=False, threads=1)
PROMPTS = [f"rollout {i}: 直播 what happens next? {i * 7}" for i in range(64)]
MAX_TOKENS = 6

pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module")
def ckpts(tmp_path_factory):
    root = tmp_path_factory.mktemp("rollout")
    return tuple(make_text_checkpoint(root / name, moe=True, seed=seed, **shape)[0]
                 for name, seed, shape in (("a", 0, {}), ("b", 1, {}), ("wide", 2, {"hidden_size": 96})))


@pytest.fixture(scope="module")
def answers(ckpts):
    """Each checkpoint's greedy tokens for PROMPTS, from one in-process LLM."""
    params = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True)
    out = {}
    for name, path in zip("ab", ckpts[:2]):
        out[name] = [o.token_ids for o in LLM(path, **{**OPTIONS, "threads": None}).generate(PROMPTS, params)]
    assert out["a"] != out["b"]
    return out


@pytest.fixture(scope="module")
def served(ckpts):
    engine = AsyncLLM(ckpts[0], engine_core="process", data_parallel_size=2, **OPTIONS)
    server = BackgroundServer(engine, MODEL, config=ServerConfig(enable_admin_routes=True)).start()
    yield engine, server
    server.stop()
    pids = engine.core_pids()
    engine.shutdown()
    for pid in pids:
        assert gone(pid), f"engine core {pid} left running"


def greedy(server, prompts=PROMPTS) -> list[list[int]]:
    """One completions request with every prompt: one engine request each, routed one by one."""
    client = openai.OpenAI(base_url=server.url + "/v1", api_key="none", max_retries=0, timeout=120)
    out = client.completions.create(model=MODEL, prompt=prompts, max_tokens=MAX_TOKENS, temperature=0,
                                    extra_body={"ignore_eos": True, "return_token_ids": True})
    return [c.model_extra["token_ids"] for c in sorted(out.choices, key=lambda c: c.index)]


def served_counts(server) -> list[int]:
    return http_json(server.url + "/get_server_info")[1]["served_per_replica"]


def test_64_requests_over_two_replicas_equal_one(served, answers):
    engine, server = served
    got = greedy(server)
    assert len(got) == len(answers["a"]) == 64 and got == answers["a"]
    counts = served_counts(server)
    assert len(counts) == 2 and min(counts) > 0 and sum(counts) == 64
    text = urllib.request.urlopen(server.url + "/metrics", timeout=10).read().decode()
    assert 'livemoe_engine_steps_total{replica="0"}' in text and 'livemoe_engine_steps_total{replica="1"}' in text


def test_answers_of_a_match_transformers(ckpts, answers):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(ckpts[0])
    hf = AutoModelForCausalLM.from_pretrained(ckpts[0], torch_dtype=torch.float32, attn_implementation="eager").eval()
    for i in (0, 33):
        ids = tok(PROMPTS[i], return_tensors="pt").input_ids
        out = hf.generate(ids, max_new_tokens=MAX_TOKENS, do_sample=False, min_new_tokens=MAX_TOKENS)
        assert out[0, ids.shape[1]:].tolist() == answers["a"][i]


def test_router_least_outstanding_tokens_and_prefix_affinity():
    r = Router(2, block_size=4)
    shared = list(range(40))
    assert r.pick(shared + [1], [True, True]) == 0
    r.add("x", 0, shared + [1], 100)
    assert r.pick([7, 7, 7], [True, True]) == 1  # replica 0 is busier
    r.add("y", 1, [7, 7, 7], 60)
    assert r.pick(shared + [2], [True, True]) == 0  # 40 cached tokens outweigh 40 more outstanding
    r.progress("x", 90)
    r.remove("y")
    assert r.load == [10, 0]
    assert r.pick([9] * 3, [False, True]) == 1 and r.pick(shared, [True, False]) == 0


def test_update_weights_from_disk_on_every_replica(served, ckpts, answers):
    _, server = served
    before = served_counts(server)
    status, body = http_json(server.url + "/update_weights_from_disk", {"model_path": ckpts[1]}, timeout=120)
    assert status == 200 and body["success"] and body["num_tensors"] > 0
    assert greedy(server) == answers["b"]
    after = served_counts(server)
    assert all(a > b for a, b in zip(after, before))  # both replicas answered with B's weights
    status, body = http_json(server.url + "/update_weights_from_disk", {"model_path": ckpts[2]}, timeout=120)
    assert status == 400 and "shape" in body["error"]["message"]
    status, body = http_json(server.url + "/update_weights_from_disk", {"model_path": ckpts[1], "oops": 1}, timeout=120)
    assert status == 400 and "oops" in body["error"]["message"]
    # a device file, through the engine-core processes: a 400 at once (it used to be read without end)
    status, body = http_json(server.url + "/update_weights_from_disk", {"model_path": "/dev/zero"}, timeout=30)
    assert status == 400 and "/dev/zero: not a directory" in body["error"]["message"]
    assert greedy(server) == answers["b"]  # the refused checkpoint changed nothing


def test_token_ids_msgpack_cannot_carry_are_a_400(served):
    """A prompt token id past what msgpack encodes (2**64 and up) never reaches a core: a 400 naming it, and the
    server goes on (it used to be a 500 from the encoder)."""
    _, server = served
    for prompt in ([2**70], [5, 2**64], [-(2**63) - 1]):
        status, body = http_json(server.url + "/v1/completions", {"model": MODEL, "prompt": prompt, "max_tokens": 1})
        assert status == 400 and "token id" in body["error"]["message"], (prompt, status, body)
    assert len(greedy(server, PROMPTS[:2])) == 2


def test_async_llm_update_weights_sends_tensors_to_every_core(served, ckpts, answers):
    engine, server = served
    assert greedy(server)[:4] == answers["b"][:4]  # B's, from the test before
    model_a = load_model(ckpts[0], dtype=torch.float32, device="cpu")
    assert asyncio.run(engine.update_weights(model_a.named_parameters())) == len(list(model_a.parameters()))
    assert greedy(server) == answers["a"]


def test_update_weights_from_distributed(served, ckpts, answers):
    _, server = served
    sender = join_servers([server.url], "127.0.0.1", free_port(), backend="gloo", timeout_s=60)
    model_b = load_model(ckpts[1], dtype=torch.float32, device="cpu")
    before = served_counts(server)
    push_weights_to_servers([server.url], sender, list(model_b.named_parameters()), timeout_s=60)
    assert greedy(server) == answers["b"]
    assert all(a > b for a, b in zip(served_counts(server), before))  # on both replicas


def test_abort_in_flight_fails_only_the_requests_in_flight(served, ckpts, answers):
    """in_flight="abort": the stream running when the update arrives ends with an error naming why (at its
    own client), and the engine serves on, with the new weights."""
    engine, server = served
    client = openai.OpenAI(base_url=server.url + "/v1", api_key="none", max_retries=0, timeout=60)
    stream = client.completions.create(model=MODEL, prompt=PROMPTS[5], max_tokens=200, stream=True,
                                       extra_body={"ignore_eos": True})
    next(iter(stream))
    status, _ = http_json(server.url + "/update_weights_from_disk", {"model_path": ckpts[1], "in_flight": "abort"}, timeout=120)
    assert status == 200
    with pytest.raises(openai.APIError, match="aborted: the weights were updated"):
        for _ in stream:
            pass
    assert greedy(server, PROMPTS[:4]) == answers["b"][:4]


def test_interrupt_in_flight_resumes_the_requests_on_the_new_weights(served, ckpts, answers):
    """in_flight="interrupt": the stream running when the update arrives is preempted and finishes on the new
    weights, no error; then every answer is the new checkpoint's. With weight_version labels on the updates and
    return_weight_versions on the request, every streamed token says which weights drew it: the old label up to
    the interruption, the new one after. (Back to B, unlabelled, at the end, for the tests after.)"""
    engine, server = served
    assert http_json(server.url + "/update_weights_from_disk", {"model_path": ckpts[1], "weight_version": 6},
                     timeout=120)[0] == 200  # B's weights still, labelled 6
    client = openai.OpenAI(base_url=server.url + "/v1", api_key="none", max_retries=0, timeout=60)
    stream = client.completions.create(model=MODEL, prompt=PROMPTS[5], max_tokens=60, stream=True,
                                       extra_body={"ignore_eos": True, "return_token_ids": True,
                                                   "return_weight_versions": True})
    chunks = [next(iter(stream))]
    before = sum(s["num_preemptions"] for s in engine.replica_stats())
    status, _ = http_json(server.url + "/update_weights_from_disk", {"model_path": ckpts[0], "in_flight": "interrupt",
                                                                     "weight_version": 7}, timeout=120)
    assert status == 200
    chunks += list(stream)
    assert chunks[-1].choices[0].finish_reason == "length"
    assert sum(s["num_preemptions"] for s in engine.replica_stats()) > before  # it was running, and preempted
    versions = [v for c in chunks for v in c.choices[0].model_extra["weight_versions"]]
    assert len(versions) == sum(len(c.choices[0].model_extra["token_ids"]) for c in chunks) == 60
    k = versions.count(6)
    assert k >= 1 and versions == [6] * k + [7] * (60 - k)
    assert greedy(server, PROMPTS[:4]) == answers["a"][:4]
    assert http_json(server.url + "/update_weights_from_disk", {"model_path": ckpts[1]}, timeout=120)[0] == 200
    assert greedy(server, PROMPTS[:4]) == answers["b"][:4]
    out = openai.OpenAI(base_url=server.url + "/v1", api_key="none", max_retries=0, timeout=60).completions.create(
        model=MODEL, prompt=PROMPTS[0], max_tokens=3, temperature=0, extra_body={"return_weight_versions": True})
    assert out.choices[0].model_extra["weight_versions"] == [None] * 3  # an update without a label: unlabelled


def test_sleep_wake_up(served, answers):
    engine, server = served
    assert http_json(server.url + "/sleep", {"level": 2})[0] == 200
    assert http_json(server.url + "/is_sleeping")[1] == {"is_sleeping": True, "level": 2}
    assert http_json(server.url + "/health")[0] == 503
    client = openai.OpenAI(base_url=server.url + "/v1", api_key="none", max_retries=0, timeout=60)
    with pytest.raises(openai.APIStatusError) as e:
        client.completions.create(model=MODEL, prompt="asleep?", max_tokens=2)
    assert e.value.status_code == 503
    assert all(s["kv_blocks_total"] == 0 for s in engine.replica_stats())  # the KV cache is freed
    assert http_json(server.url + "/wake_up", {})[0] == 200
    assert http_json(server.url + "/health")[0] == 200
    assert greedy(server) == answers["b"]


def test_killed_replica_fails_its_requests_and_health_says_which(served, answers):
    """(last: it kills one of the module's replicas)"""
    engine, server = served
    client = openai.OpenAI(base_url=server.url + "/v1", api_key="none", max_retries=0, timeout=60)
    victim = engine.core_pids()[1]

    def stream(i):
        try:
            n = 0
            for _chunk in client.completions.create(model=MODEL, prompt=PROMPTS[i], max_tokens=200, stream=True,
                                                   temperature=0, extra_body={"ignore_eos": True}):
                n += 1
                if n == 3 and i == 0:
                    os.kill(victim, signal.SIGKILL)
            return "ok"
        except openai.APIError as e:
            return str(e)

    with concurrent.futures.ThreadPoolExecutor(6) as pool:
        results = list(pool.map(stream, range(6)))
    failed = [r for r in results if r != "ok"]
    assert failed and all("died" in r for r in failed), results
    status, body = http_json(server.url + "/health")
    assert status == 503 and list(body["dead_replicas"]) == ["1"]
    # the live replica serves on
    assert greedy(server, PROMPTS[:4]) == answers["b"][:4]
