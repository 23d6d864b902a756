"""Routed experts through the server (issue 32): a process-core engine behind the OpenAI server returns, for
`return_routed_experts: true`, each choice's routed_experts (base64 + shape + dtype) equal to the Python API's
(in-thread engine, same checkpoint, same seeds), streamed or not; and `--rollout_url` rollouts
(livemoe.train.remote_rollout) carry them decoded."""
import json
import urllib.request

import numpy as np
import pytest
import torch

from fixtures import require_server_extras

openai = require_server_extras()

from livemoe import LLM, SamplingParams  # noqa: E402
from livemoe.engine import routed_experts  # noqa: E402
from livemoe.engine.async_llm import AsyncLLM  # noqa: E402
from livemoe.engine.model.loader import load_model, load_tokenizer  # noqa: E402
from livemoe.engine.server import BackgroundServer  # noqa: E402
from livemoe.engine.server.config import ServerConfig  # noqa: E402
from tiny_tokenizer import make_text_checkpoint  # noqa: E402

pytestmark = pytest.mark.usefixtures("one_thread")
PROMPTS = [[5, 6, 7, 8, 9], [10, 11, 12]]


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    path, _ = make_text_checkpoint(tmp_path_factory.mktemp("srv") / "ckpt", moe=True)
    engine = AsyncLLM(path, dtype=torch.float32, device="cpu", use_tqdm=False, engine_core="process", threads=1,
                      block_size=16, num_kv_blocks=64, max_model_len=128)
    server = BackgroundServer(engine, "tiny", config=ServerConfig(enable_admin_routes=True)).start()  # weight pushes
    yield path, server
    server.stop()
    engine.shutdown()


def python_api(path):
    llm = LLM.from_model(load_model(path, dtype=torch.float32), load_tokenizer(path), num_kv_blocks=64,
                         use_tqdm=False)
    params = [SamplingParams(max_tokens=8, temperature=1.0, seed=7 + i, n=2, ignore_eos=True,
                             return_routed_experts=True) for i in range(len(PROMPTS))]
    return [[c.routed_experts for c in o.outputs] for o in llm.generate(PROMPTS, params)]


def post(url, body):
    req = urllib.request.Request(url, data=json.dumps(body).encode(), headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=60) as r:
        return r.read().decode()


def test_expert_ids_through_the_server_equal_the_python_apis(served):
    path, server = served
    want = python_api(path)
    for i, prompt in enumerate(PROMPTS):
        body = {"model": "tiny", "prompt": prompt, "max_tokens": 8, "temperature": 1.0, "seed": 7 + i, "n": 2,
                "ignore_eos": True, "return_routed_experts": True}
        choices = sorted(json.loads(post(server.url + "/v1/completions", body))["choices"], key=lambda c: c["index"])
        got = [routed_experts.decode(c["routed_experts"]) for c in choices]
        assert all(g.dtype == np.uint8 and np.array_equal(g, w) for g, w in zip(got, want[i]))
        events = [json.loads(line[6:]) for line in post(server.url + "/v1/completions", {**body, "stream": True})
                  .splitlines() if line.startswith("data: {")]
        streamed = {c["index"]: routed_experts.decode(c["routed_experts"]) for e in events for c in e["choices"]
                    if "routed_experts" in c}
        assert set(streamed) == {0, 1} and all(np.array_equal(streamed[j], want[i][j]) for j in (0, 1))
    plain = json.loads(post(server.url + "/v1/completions", {"model": "tiny", "prompt": PROMPTS[0], "max_tokens": 2}))
    assert "routed_experts" not in plain["choices"][0]


def test_rollout_url_rollouts_carry_the_routed_experts(served):
    from livemoe.train.remote_rollout import RemoteRollouts
    from livemoe.train.rollout import Rollouts

    path, server = served
    model, tok = load_model(path, dtype=torch.float32), load_tokenizer(path)
    remote = RemoteRollouts([server.url], tok, model, num_generations=2, max_new_tokens=6, temperature=1.0, seed=1,
                            weight_sync="disk", return_routed_experts=True)
    try:
        got = remote.generate(PROMPTS, step=0)
    finally:
        remote.close()
    local = Rollouts(model, tok, num_generations=2, max_new_tokens=6, temperature=1.0, seed=1,
                     return_routed_experts=True, num_kv_blocks=64).generate(PROMPTS, step=0)
    for g, w in zip(got, local):
        for a, b in zip(g, w):
            assert a.token_ids == b.token_ids and a.routed_experts.shape == (len(a.prompt_ids) + len(a.token_ids) - 1,
                                                                             3, 2)
            assert np.array_equal(a.routed_experts, b.routed_experts)
