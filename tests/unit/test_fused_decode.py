"""The CPU step's one-C++-call-per-layer path (livemoe.engine.model.fused_decode) against the module path it stands
in for: the same kernels in the same order, so greedy tokens and logprobs are equal (asserted equal, not close), on
the committed student and two random MoEs and a dense model, in fp32, fp16 and bf16, over prefill chunks and batched
decode steps."""
import os

import pytest
import torch

from livemoe.engine.llm import LLM
from livemoe.engine.model import fused_decode
from livemoe.engine.model.context import PlanCache, StepContext
from livemoe.engine.model.qwen3 import FUSABLE_MODULES
from livemoe.engine.sampling.params import SamplingParams
from tiny_models import make_checkpoint

pytestmark = [pytest.mark.usefixtures("one_thread"),
              pytest.mark.skipif(not fused_decode.BUILT, reason="the C++ extension (livemoe._C) is not built")]

STUDENT = os.path.join(os.path.dirname(__file__), "..", "..", "livemoe", "train", "assets", "student")
MODELS = {
    "student": None,
    "moe_a": dict(moe=True, seed=1),
    "moe_b": dict(moe=True, seed=2, hidden_size=96, num_experts=6, num_experts_per_tok=3, moe_intermediate_size=40,
                  num_attention_heads=6, num_key_value_heads=3, head_dim=16, vocab_size=211),
    "dense": dict(moe=False, seed=3),
}


@pytest.fixture(scope="module", params=list(MODELS))
def checkpoint(request, tmp_path_factory):
    spec = MODELS[request.param]
    if spec is None:
        return STUDENT
    path, _ = make_checkpoint(tmp_path_factory.mktemp(request.param) / "m", **spec)
    return path


def run(llm, prompts, params):
    outs = llm.generate(prompts, params)
    return [(o.outputs[0].token_ids, o.outputs[0].logprobs) for o in outs]


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_fused_layers_equal_the_modules(checkpoint, dtype, monkeypatch):
    # long enough prompts for chunked prefill (max_num_batched_tokens 32) mixed with decode steps; 16-bit too: the
    # step's own loops (embedding rows, rotary halves, residual adds, conversions) give the modules' ATen bits
    llm = LLM(checkpoint, dtype=dtype, device="cpu", max_num_batched_tokens=32, block_size=4, use_tqdm=False)
    vocab = llm.model.config.vocab_size
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(3, vocab, (n,), generator=g).tolist() for n in (1, 7, 19, 40)]
    greedy = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True, logprobs=3)
    calls = []
    real = fused_decode.run_step
    monkeypatch.setattr(fused_decode, "run_step", lambda *a: calls.append(1) or real(*a))
    fused = run(llm, prompts, greedy)
    assert calls, "the fused path did not run"
    monkeypatch.setattr(fused_decode, "ENABLED", False)
    calls.clear()
    llm.reset_prefix_cache()
    modules = run(llm, prompts, greedy)
    assert not calls
    assert [t for t, _ in fused] == [t for t, _ in modules]
    assert [lp for _, lp in fused] == [lp for _, lp in modules]  # bitwise: the same kernels in the same order


def test_fused_layers_not_taken_with_grad(checkpoint):
    from livemoe.engine.model.loader import load_model

    model = load_model(checkpoint, dtype=torch.float32, device="cpu")
    ids = torch.zeros(1, 2, dtype=torch.long)
    step = StepContext(kv_caches=[], slot_mapping=torch.zeros(0), context_lens=torch.zeros(0),
                       block_tables=torch.zeros(0))
    with torch.enable_grad():
        assert fused_decode.plan(model, ids, step, FUSABLE_MODULES) is None  # the trainers' forward keeps its autograd
    with torch.inference_mode():
        assert fused_decode.plan(model, ids, step, FUSABLE_MODULES) is not None
        handle = model.model.layers[-1].mlp.register_forward_hook(lambda *a: None)  # a caller watching a layer
        assert fused_decode.plan(model, ids, step, FUSABLE_MODULES) is None
        handle.remove()
        model.model.layers[0].self_attn.q_proj = Wrapped(model.model.layers[0].self_attn.q_proj)  # a LoRA-like wrapper
        assert fused_decode.plan(model, ids, step, FUSABLE_MODULES) is None
        step.backend = "reference"
        assert fused_decode.plan(model, ids, step, FUSABLE_MODULES) is None


def test_plan_cache_follows_the_model(checkpoint):
    """A runner's kept plan is dropped by whatever would change it: a hook registered anywhere, a module or weight
    replaced, a layer appended; in place weight updates keep it (the plan holds the same tensors)."""
    from livemoe.engine.model.loader import load_model

    model = load_model(checkpoint, dtype=torch.float32, device="cpu")
    ids = torch.zeros(1, 2, dtype=torch.long)
    step = StepContext(kv_caches=[], slot_mapping=torch.zeros(0), context_lens=torch.zeros(0),
                       block_tables=torch.zeros(0), plan_cache=PlanCache())

    def plan():
        return fused_decode.plan(model, ids, step, FUSABLE_MODULES)

    with torch.inference_mode():
        first = plan()
        assert first is not None and plan() is first  # kept
        layer = model.model.layers[1]
        with torch.no_grad():
            layer.self_attn.o_proj.weight.mul_(2.0)  # in place: the same tensor
        assert plan() is first
        handle = layer.input_layernorm.register_forward_pre_hook(lambda *a: None)
        assert plan() is None
        handle.remove()
        again = plan()
        assert again is not None and again is not first
        new_weight = torch.nn.Parameter(layer.self_attn.k_proj.weight.detach().clone())
        layer.self_attn.k_proj.weight = new_weight
        replaced = plan()
        assert replaced is not again and any(w is new_weight for w in replaced.weights)
        layer.post_attention_layernorm = Wrapped(layer.post_attention_layernorm)
        assert plan() is None
        layer.post_attention_layernorm = layer.post_attention_layernorm.inner
        kept = plan()
        assert kept is not None
        model.model.layers.append(model.model.layers[0])
        assert plan() is not kept
        del model.model.layers[-1]
        global_hook = torch.nn.modules.module.register_module_forward_hook(lambda *a: None)
        try:
            assert plan() is None
        finally:
            global_hook.remove()


class Wrapped(torch.nn.Module):
    def __init__(self, inner):
        super().__init__()
        self.inner = inner

    def forward(self, x):
        return self.inner(x)


def test_decode_step_refuses_mismatched_inputs():
    ids = torch.zeros(1, 2, dtype=torch.long)
    t = torch.zeros(4)
    args = dict(slot_mapping=t, cu_seqlens_q=None, context_lens=t, block_tables=t, num_heads=1, num_kv_heads=1,
                eps=1e-6, scale=1.0, renormalize=False)
    with pytest.raises(RuntimeError, match="expected 11 weights and 2 caches for 1 layers, got 3 and 2"):
        torch.ops.livemoe.decode_step(ids, ids, t, t, t, [t] * 3, [t, t], top_k=[0], **args)
    with pytest.raises(RuntimeError, match=r"one flattened row \[1, N\]"):
        torch.ops.livemoe.decode_step(ids[0], ids[0], t, t, t, [], [], top_k=[], **args)
