"""LLM.update_weights / update_weights_from_disk / sleep / wake_up in one process: hub names (per-expert
and fused experts) and engine names all land; the answers become the new checkpoint's; a tensor of
another shape, an unknown name or a NaN is refused whole (the old weights stay); requests in flight
finish on the old weights or are aborted, as asked; the prefix cache is dropped."""
import os

import pytest
import torch

from livemoe.engine.errors import CheckpointError
from livemoe.engine.llm import LLM
from livemoe.engine.model.config import load_config
from livemoe.engine.model.loader import load_model
from livemoe.engine.model.saver import hub_state_dict
from livemoe.engine.sampling.params import SamplingParams
from tiny_tokenizer import make_text_checkpoint

OPTIONS = dict(dtype=torch.float32, device="cpu", block_size=4, num_kv_blocks=256, use_tqdm=False)
GREEDY = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
PROMPTS = ["viewer 1 asks 你好?", "a shared prefix that is long enough to be cached, then the question"]

pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module")
def ckpts(tmp_path_factory):
    root = tmp_path_factory.mktemp("weights")
    a = make_text_checkpoint(root / "a", moe=True, seed=0)[0]
    b = make_text_checkpoint(root / "b", moe=True, seed=1)[0]
    wide = make_text_checkpoint(root / "wide", moe=True, seed=2, hidden_size=96)[0]
    answers = {k: [o.token_ids for o in LLM(p, **OPTIONS).generate(PROMPTS, GREEDY)] for k, p in (("a", a), ("b", b))}
    assert answers["a"] != answers["b"]  # the checkpoints can be told apart by their answers
    return a, b, wide, answers


@pytest.mark.parametrize("names", ["hub_per_expert", "hub_fused", "engine"])
def test_update_weights_switches_answers(ckpts, names):
    a, b, _, answers = ckpts
    llm = LLM(a, **OPTIONS)
    assert [o.token_ids for o in llm.generate(PROMPTS, GREEDY)] == answers["a"]
    model_b = load_model(b, dtype=torch.float32, device="cpu")
    tensors = dict(model_b.named_parameters()) if names == "engine" else \
        hub_state_dict(model_b, "fused" if names == "hub_fused" else "per_expert")
    resets = llm.core.num_prefix_cache_resets
    assert llm.update_weights(tensors) == len(tensors)
    assert llm.core.num_prefix_cache_resets == resets + 1
    assert [o.token_ids for o in llm.generate(PROMPTS, GREEDY)] == answers["b"]
    assert llm.update_weights_from_disk(a) > 0
    assert [o.token_ids for o in llm.generate(PROMPTS, GREEDY)] == answers["a"]


def test_bad_updates_are_refused_whole(ckpts):
    a, b, wide, answers = ckpts
    llm = LLM(a, **OPTIONS)
    good = hub_state_dict(load_model(b, dtype=torch.float32, device="cpu"))
    key = "model.layers.0.self_attn.q_proj.weight"
    with pytest.raises(CheckpointError, match="shape"):
        llm.update_weights({**good, key: torch.zeros(3, 3)})
    with pytest.raises(CheckpointError, match="unexpected tensor 'model.nonsense'"):
        llm.update_weights({**good, "model.nonsense": torch.zeros(1)})
    with pytest.raises(CheckpointError, match="NaN"):
        llm.update_weights({**good, key: torch.full_like(good[key], float("nan"))})
    with pytest.raises(CheckpointError, match="shape"):
        llm.update_weights_from_disk(wide)
    # not a checkpoint directory: refused before anything is read (/dev/zero used to be json.load-ed without end)
    with pytest.raises(CheckpointError, match="/dev/zero: not a directory"):
        llm.update_weights_from_disk("/dev/zero")
    with pytest.raises(CheckpointError, match="config.json: not a directory"):
        llm.update_weights_from_disk(os.path.join(a, "config.json"))
    with pytest.raises(CheckpointError, match="/dev/zero: not a regular file"):
        load_config("/dev/zero")
    # nothing of the refused updates was copied (each had good tensors before the bad one)
    assert [o.token_ids for o in llm.generate(PROMPTS, GREEDY)] == answers["a"]


@pytest.mark.parametrize("in_flight", ["finish", "abort"])
def test_requests_in_flight(ckpts, in_flight):
    a, b, _, answers = ckpts
    llm = LLM(a, **OPTIONS)
    rid = llm.add_request(PROMPTS[0], GREEDY)
    llm.step()
    llm.update_weights_from_disk(b, in_flight=in_flight)
    if in_flight == "finish":  # it ended on A's weights; its output waits for the next step()
        (out,) = llm.step()
        assert out.request_id == rid and out.finished and out.token_ids == answers["a"][0]
    else:
        assert llm.take_failed() == {rid: "aborted: the weights were updated"} and not llm.core.requests
    assert [o.token_ids for o in llm.generate(PROMPTS, GREEDY)] == answers["b"]
    with pytest.raises(ValueError, match="in_flight"):
        llm.update_weights_from_disk(b, in_flight="later")


def test_sleep_and_wake_up(ckpts):
    a, _, _, answers = ckpts
    llm = LLM(a, **OPTIONS)
    for level in (1, 2):
        llm.sleep(level)
        assert llm.sleep_level == level and llm.core.runner.kv_cache is None
        with pytest.raises(RuntimeError, match="asleep already"):
            llm.sleep(1)
        with pytest.raises(RuntimeError, match="asleep .* wake it up first"):  # not kept for the wake-up
            llm.update_weights_from_disk(a)
        with pytest.raises(RuntimeError, match="asleep .* wake it up first"):
            llm.update_weights(list(llm.model.named_parameters())[:1])
        llm.wake_up()
        assert llm.sleep_level == 0
        assert [o.token_ids for o in llm.generate(PROMPTS, GREEDY)] == answers["a"]
    with pytest.raises(ValueError, match="level"):
        llm.sleep(3)


def test_async_llm_in_a_thread_finishes_in_flight_on_old_weights(ckpts):
    """AsyncLLM(engine_core="thread"): a request in flight when update_weights_from_disk arrives ends with
    A's tokens (in_flight="finish"), the next gets B's; sleep refuses requests until wake_up."""
    import asyncio

    from livemoe.engine.async_llm import AsyncLLM
    from livemoe.engine.errors import EngineSleepingError

    a, b, _, answers = ckpts
    engine = AsyncLLM(a, **OPTIONS)

    async def main():
        gen = engine.generate(PROMPTS[0], GREEDY)
        first = await gen.__anext__()
        update = asyncio.ensure_future(engine.update_weights_from_disk(b))
        rest = [t for d in [first] + [d async for d in gen] for t in d.token_ids]
        assert await update > 0
        after = [t async for d in engine.generate(PROMPTS[0], GREEDY) for t in d.token_ids]
        await engine.sleep()
        with pytest.raises(EngineSleepingError):
            await engine.add_request(PROMPTS[0], GREEDY)
        await engine.wake_up()
        again = [t async for d in engine.generate(PROMPTS[0], GREEDY) for t in d.token_ids]
        return rest, after, again

    try:
        rest, after, again = asyncio.run(main())
    finally:
        engine.shutdown()
    assert rest == answers["a"][0] and after == again == answers["b"][0]
