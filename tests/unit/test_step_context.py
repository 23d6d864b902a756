"""The decoder's per-step state is explicit (livemoe.engine.model.context.StepContext, passed down the forward by the model
runner): one module serves a trainer and several engines at once, a forward on another thread during a step
takes the plain path, and no module attribute holds a KV cache."""
import threading

import pytest
import torch

from livemoe.engine.llm import LLM
from livemoe.engine.model.loader import load_model
from livemoe.engine.sampling.params import SamplingParams
from tiny_models import make_checkpoint

GREEDY = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)

pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    path, _ = make_checkpoint(tmp_path_factory.mktemp("moe") / "ckpt", moe=True)
    return load_model(path, dtype=torch.float32, device="cpu")


def module_tensors(model: torch.nn.Module):
    """(name, tensor) of every tensor a module holds: parameters, buffers and plain attributes (also inside
    lists, tuples and dicts)."""
    for mod_name, mod in model.named_modules():
        for attr, value in vars(mod).items():
            if attr in ("_parameters", "_buffers"):
                values = value.items()
            elif isinstance(value, dict):
                values = value.items()
            elif isinstance(value, (list, tuple)):
                values = enumerate(value)
            else:
                values = [("", value)]
            for key, v in values:
                for t in (v if isinstance(v, (list, tuple)) else [v]):
                    if isinstance(t, torch.Tensor):
                        yield f"{mod_name}.{attr}" + (f"[{key}]" if key != "" else ""), t


def assert_no_module_holds_a_kv_cache(model, *engines):
    caches = [e.core.runner.kv_cache.untyped_storage().data_ptr() for e in engines]
    held = [name for name, t in module_tensors(model) if t.untyped_storage().data_ptr() in caches]
    assert not held, f"module attributes hold an engine's KV cache: {held}"


def test_no_module_attribute_holds_a_kv_cache_after_a_step(model):
    llm = LLM.from_model(model, None, num_kv_blocks=32)
    assert len(list(module_tensors(model))) >= len(list(model.parameters()))  # the walk sees the module
    assert llm.generate([[3, 4, 5, 6]], GREEDY)[0].token_ids
    assert_no_module_holds_a_kv_cache(model, llm)
    assert not any("cache" in attr for m in model.modules() for attr in vars(m))


def test_plain_forward_on_another_thread_during_a_step(model):
    """A trainer's forward on another thread while an engine step is halfway through the layers: it takes
    the plain causal path (the reference result), and the engine's tokens are those it gives alone."""
    ids = torch.tensor([[7, 8, 9, 10, 11, 12, 13, 14, 15]])
    with torch.no_grad():
        want_hidden = model.forward_hidden(ids)
    prompts = [[3, 4, 5, 6, 7], [20, 21, 22]]
    want_tokens = [o.token_ids for o in LLM.from_model(model, None, num_kv_blocks=32).generate(prompts, GREEDY)]

    engine_thread = threading.get_ident()
    seen: list = []

    def other_thread_forward():
        try:
            with torch.no_grad():
                seen.append(model.forward_hidden(ids))
        except Exception as e:  # noqa: BLE001  (reported by the assert below)
            seen.append(e)

    def mid_step(module, args):
        if threading.get_ident() == engine_thread:  # the engine's step, inside the model's layers
            t = threading.Thread(target=other_thread_forward)
            t.start()
            t.join(timeout=60)
            assert not t.is_alive(), "the other thread's forward hung"

    llm = LLM.from_model(model, None, num_kv_blocks=32)
    handle = model.model.layers[1].register_forward_pre_hook(mid_step)
    try:
        got_tokens = [o.token_ids for o in llm.generate(prompts, GREEDY)]
    finally:
        handle.remove()
    assert len(seen) >= GREEDY.max_tokens  # one per step: prefill and every decode step
    for out in seen:
        assert isinstance(out, torch.Tensor), f"the plain forward failed during an engine step: {out!r}"
        torch.testing.assert_close(out, want_hidden, rtol=0, atol=0)
    assert got_tokens == want_tokens


def test_two_engines_over_one_module_interleaving_steps(model):
    """A trainer's rollout and eval engines over the same module, with caches of different shapes, stepped in
    turn: each gives the tokens it gives alone, and releasing one leaves the other working."""
    a = LLM.from_model(model, None, num_kv_blocks=32, block_size=8)
    b = LLM.from_model(model, None, num_kv_blocks=48, block_size=4)
    prompts_a = [[5, 6, 7, 8, 9, 10], [11, 12, 13]]
    prompts_b = [[40, 41, 42, 43, 44, 45, 46, 47, 48, 49], [60, 61], [70, 71, 72, 73]]
    want_a = [o.token_ids for o in LLM.from_model(model, None, num_kv_blocks=32).generate(prompts_a, GREEDY)]
    want_b = [o.token_ids for o in LLM.from_model(model, None, num_kv_blocks=32).generate(prompts_b, GREEDY)]
    assert want_a[0] != want_b[0]

    ids_a = [a.add_request(p, GREEDY) for p in prompts_a]
    ids_b = [b.add_request(p, GREEDY) for p in prompts_b]
    done = {"a": {}, "b": {}}
    for _ in range(100):
        for name, engine in (("a", a), ("b", b)):
            if engine.has_unfinished_requests():
                done[name].update((o.request_id, o.token_ids) for o in engine.step() if o.finished)
        if not (a.has_unfinished_requests() or b.has_unfinished_requests()):
            break
    assert [done["a"].get(r) for r in ids_a] == want_a
    assert [done["b"].get(r) for r in ids_b] == want_b
    assert_no_module_holds_a_kv_cache(model, a, b)

    b.release_kv_cache()
    assert b.core.runner.kv_cache is None
    assert [o.token_ids for o in a.generate(prompts_a, GREEDY)] == want_a
