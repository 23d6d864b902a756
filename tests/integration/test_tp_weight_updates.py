"""Weight updates into a tensor-parallel engine (TP 2 on the CPU over gloo; livemoe/engine/decoder/weight_update.py):
from a caller's tensors (rank 0 broadcasts them, each rank keeps its slices), from disk (each rank reads only its
slices) and from a trainer's broadcast (every rank joins the weight-update group), with and without expert parallel. After each, the greedy tokens
and their logprobs are EQUAL to a fresh TP 2 engine's loaded with the new weights (the same shards, the same
forward: bitwise). A refusal found by one worker alone (a NaN in its slice only) leaves every rank's weights whole.
A server of DP 2 x TP 2 joins a trainer's group as 4 ranks (join_servers, over HTTP) and learns the new weights on
both replicas."""
import asyncio
import threading

import pytest
import torch
from safetensors.torch import load_file, save_file

from livemoe.engine.async_llm import AsyncLLM
from livemoe.engine.core.weight_sync import WeightSender, weights_metadata
from livemoe.engine.errors import CheckpointError
from livemoe.engine.llm import LLM
from livemoe.engine.model.loader import load_model
from livemoe.engine.model.saver import hub_state_dict
from livemoe.engine.net import free_port
from livemoe.engine.sampling.params import SamplingParams
from fixtures import collect_deltas
from tiny_tokenizer import make_text_checkpoint

pytestmark = pytest.mark.usefixtures("one_thread")  # the groups have 60 s timeouts: a lost rank fails, never hangs

GREEDY = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True, logprobs=0)
OPTIONS = dict(dtype=torch.float32, device="cpu", block_size=4, num_kv_blocks=64, use_tqdm=False, threads=1)
PROMPTS = [[5, 17, 33, 8, 91, 4], [12, 40, 7], [3, 3, 60, 71, 22, 18, 9, 30, 11]]


def answers(llm):
    """Greedy tokens and their logprobs, compared with == (bitwise) against a fresh engine's, so from a cold prefix
    cache as the fresh engine's are (a prefix hit computes the prompt's last rows in a smaller step, whose fp32
    linears may sum in another order)."""
    llm.reset_prefix_cache()
    outs = llm.generate(PROMPTS, GREEDY)
    return [(o.outputs[0].token_ids, [next(iter(d.values())) for d in o.outputs[0].logprobs]) for o in outs]


@pytest.fixture(scope="module")
def ckpts(tmp_path_factory):
    """a and b: one MoE architecture, two seeds; the TP 2 answers of b from a fresh engine; nan1: b with a NaN in
    a row only rank 1 holds (the second half of layer 0's q_proj rows)."""
    root = tmp_path_factory.mktemp("tp_updates")
    a = make_text_checkpoint(root / "a", moe=True, seed=0)[0]
    b = make_text_checkpoint(root / "b", moe=True, seed=1)[0]
    nan1 = make_text_checkpoint(root / "nan1", moe=True, seed=1)[0]
    tensors = load_file(f"{nan1}/model.safetensors")
    q = tensors["model.layers.0.self_attn.q_proj.weight"]
    q[q.shape[0] - 1, 0] = float("nan")
    save_file(tensors, f"{nan1}/model.safetensors", metadata={"format": "pt"})
    paths, cache = {"a": a, "b": b}, {}

    def fresh(name, ep=False):
        """The answers of a fresh TP 2 engine (expert parallel or not) loaded with checkpoint `name`."""
        if (name, ep) not in cache:
            llm = LLM(paths[name], tensor_parallel_size=2, enable_expert_parallel=ep, **OPTIONS)
            try:
                cache[name, ep] = answers(llm)
            finally:
                llm.close()
        return cache[name, ep]

    assert fresh("a") != fresh("b")
    return a, b, nan1, fresh


@pytest.fixture
def tp2_on_a(ckpts):
    llm = LLM(ckpts[0], tensor_parallel_size=2, **OPTIONS)
    yield llm
    llm.close()


def test_tensors_and_disk_into_tp2_equal_a_fresh_tp2_engine(ckpts, tp2_on_a):
    a, b, nan1, fresh = ckpts
    fresh = {name: fresh(name) for name in ("a", "b")}
    llm = tp2_on_a
    assert answers(llm) == fresh["a"]
    tensors = hub_state_dict(load_model(b, dtype=torch.float32, device="cpu"))
    assert llm.update_weights(tensors) == len(tensors)
    assert answers(llm) == fresh["b"]
    assert llm.update_weights_from_disk(a) > 0
    assert answers(llm) == fresh["a"]
    # refused whole on rank 0 (its check runs before the workers hear of it) and on the worker alone
    with pytest.raises(CheckpointError, match="shape"):
        llm.update_weights({**tensors, "model.layers.0.self_attn.q_proj.weight": torch.zeros(3, 3)})
    with pytest.raises(CheckpointError, match="'model.layers.0.self_attn.q_proj.weight' holds NaN"):
        llm.update_weights_from_disk(nan1)
    assert answers(llm) == fresh["a"]  # no rank applied any part of either
    assert llm.update_weights_from_disk(b) > 0
    assert answers(llm) == fresh["b"]


def test_expert_parallel_updates_equal_a_fresh_tp2_ep_engine(ckpts):
    """TP 2 + EP: each rank keeps its whole experts of the update (the per-expert keys of the other rank's experts
    are not its to stage) and the shared attention slices."""
    a, b, _, fresh = ckpts
    fresh = {name: fresh(name, True) for name in ("a", "b")}  # (one TP engine per process at a time)
    llm = LLM(a, tensor_parallel_size=2, enable_expert_parallel=True, **OPTIONS)
    try:
        assert answers(llm) == fresh["a"]
        tensors = hub_state_dict(load_model(b, dtype=torch.float32, device="cpu"), "fused")
        assert llm.update_weights(tensors) == len(tensors)
        assert answers(llm) == fresh["b"]
        assert llm.update_weights_from_disk(a) > 0
        assert answers(llm) == fresh["a"]
    finally:
        llm.close()


def test_trainer_broadcast_into_tp2_equals_a_fresh_tp2_engine(ckpts, tp2_on_a):
    """The trainer (rank 0, here a thread) broadcasts; the engine's rank 0 is rank 1, its worker rank 2."""
    a, b, _, fresh = ckpts
    fresh = {name: fresh(name) for name in ("a", "b")}
    llm = tp2_on_a
    named = list(hub_state_dict(load_model(b, dtype=torch.float32, device="cpu")).items())
    port = free_port()
    sender: list = []
    joiner = threading.Thread(target=lambda: sender.append(WeightSender("127.0.0.1", port, 3, timeout_s=60)))
    joiner.start()
    llm.core.init_weights_update_group(master_address="127.0.0.1", master_port=port, rank=1, world_size=3,
                                       timeout_s=60)
    joiner.join(60)
    meta = weights_metadata(named)
    pusher = threading.Thread(target=lambda: sender[0].broadcast(named))
    pusher.start()
    assert llm.core.update_weights_from_distributed(meta["names"], meta["dtypes"], meta["shapes"]) == len(named)
    pusher.join(60)
    assert answers(llm) == fresh["b"]


@pytest.mark.slow
def test_data_parallel_x_tensor_parallel_server_learns_from_one_broadcast(ckpts):
    """A server of DP 2 x TP 2 (four processes hold weights): the trainer's join_servers reads its 4 ranks from
    /get_server_info, the group has 5, push_weights_to_servers broadcasts once, and both replicas answer as b."""
    from fixtures import require_server_extras

    require_server_extras()
    from livemoe.engine.core.weight_sync import join_servers, push_weights_to_servers
    from livemoe.engine.server import BackgroundServer, ServerConfig

    a, b, _, fresh = ckpts
    fresh = {name: fresh(name) for name in ("a", "b")}
    named = list(hub_state_dict(load_model(b, dtype=torch.float32, device="cpu")).items())
    engine = AsyncLLM(a, engine_core="process", data_parallel_size=2, tensor_parallel_size=2, **OPTIONS)
    srv = BackgroundServer(engine, "tiny", config=ServerConfig(enable_admin_routes=True)).start()
    try:
        assert engine.weight_update_ranks == 4
        sender = join_servers([srv.url], "127.0.0.1", free_port(), timeout_s=60)
        assert sender.group.size() == 5
        push_weights_to_servers([srv.url], sender, named, timeout_s=60)

        async def main():
            return await asyncio.gather(*(collect_deltas(engine.generate(p, GREEDY)) for p in PROMPTS * 3))

        outs = asyncio.run(main())
        assert [tokens for tokens, _, _ in outs] == [tokens for tokens, _ in fresh["b"]] * 3
        assert min(engine.served_per_replica()) > 0  # both replicas answered
    finally:
        srv.stop()
        engine.shutdown()
