"""Training steps of a small MoE model on 1, 2 (and at full size 4) gloo ranks, with and without expert
parallel: tokens per second per rank (ratio against one rank in the same run) and the share of the step
spent in the all-to-all (the EP layer's dispatch and combine), FSDP's all-gathers and its reduce-scatters.
On GPUs (test_bench_parallel_gpu, run by bench/gpu_check.sh): the step time of a Qwen3-30B-A3B-shaped layer
stack with expert parallel over every GPU (one NCCL rank each) against the same layers with FSDP alone, and
one GPU's step; with a single GPU only that row is measured and the EP case is skipped, saying why.

The collectives are timed by wrapping them (the all-to-all in livemoe.train.parallel, FSDP2's
torch.distributed.all_gather_single / reduce_scatter_single, each waited on at once: on the CPU gloo gives
no overlap to lose). The global batch is the same for every world size, so a rank's share shrinks as ranks
are added: the per-rank rate says what the collectives cost, not how far a cluster scales.
"""
import importlib
import time
from typing import NamedTuple

import pytest
import torch

from bench.common import record

class Size(NamedTuple):
    hidden: int
    layers: int
    experts: int
    top_k: int
    moe_intermediate: int
    vocab: int
    batch: int  # global: sequences per step over all ranks
    seq_len: int
    steps: int  # timed (after one warm-up step)
    heads: int = 4
    kv_heads: int = 2
    head_dim: int | None = None  # None: hidden / heads


SIZES = {"quick": Size(64, 2, 8, 2, 32, 128, 8, 32, 2), "full": Size(256, 4, 16, 2, 128, 1024, 16, 128, 5)}
WORLDS = {"quick": (2,), "full": (2, 4)}
# Qwen3-30B-A3B's decoder layers (hidden 2048, 32 query and 4 KV heads of 128, 128 experts, top-8, moe_intermediate
# 768), two of them, with a small vocabulary: the layer stack is what is timed, not the 151,936-row head
GPU_SIZES = {"quick": Size(256, 2, 16, 4, 128, 1024, 8, 128, 2, 8, 2, 32),
             "full": Size(2048, 2, 128, 8, 768, 1024, 8, 1024, 5, 32, 4, 128)}


def _model(size: Size):
    from livemoe.engine.model.config import ModelConfig
    from livemoe.engine.model.qwen3 import Qwen3ForCausalLM

    cfg = ModelConfig.from_dict(dict(model_type="qwen3_moe", vocab_size=size.vocab, hidden_size=size.hidden,
                                     num_hidden_layers=size.layers, num_attention_heads=size.heads,
                                     num_key_value_heads=size.kv_heads, head_dim=size.head_dim or size.hidden // size.heads,
                                     num_experts=size.experts, num_experts_per_tok=size.top_k,
                                     moe_intermediate_size=size.moe_intermediate, norm_topk_prob=True))
    torch.manual_seed(0)
    model = Qwen3ForCausalLM(cfg)
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0, 0.05)
    return model


class _Timer:
    """Wraps a function so every call is timed (and an async one waited on before the clock stops)."""

    def __init__(self, owner, name: str):
        self.owner, self.name, self.fn, self.seconds = owner, name, getattr(owner, name), 0.0
        setattr(owner, name, self)

    def __call__(self, *args, **kwargs):
        t0 = time.perf_counter()
        out = self.fn(*args, **kwargs)
        if out is not None and hasattr(out, "wait"):
            out.wait()
        self.seconds += time.perf_counter() - t0
        return out

    def restore(self):
        setattr(self.owner, self.name, self.fn)


def run_steps(size: Size, expert_parallels, world_size: int, device_type: str = "cpu"):
    """Per expert_parallel degree: (seconds per step, tokens per rank per step, share of all-to-all, all-gather,
    reduce-scatter in the step). Runs on the ranks spawn_ranks starts, or in-process for one rank.
    device_type "cpu": gloo ranks (also on a machine with GPUs); "cuda": one NCCL rank per GPU, bf16 compute, and
    no shares (a collective returns once queued on the GPU: timing its call says nothing), so they are 0."""
    import torch.distributed as dist

    from livemoe.train.parallel import init_distributed

    a2a_module = importlib.import_module("livemoe.train.parallel.all_to_all")  # the module (the package exports the function)

    world = init_distributed(timeout_s=300, backend="gloo" if device_type == "cpu" else None)
    assert world.device.type == device_type, (world.device, device_type)
    timers = {}
    if device_type == "cpu":
        # torch >= 2.13 names FSDP2's collectives *_single; older releases (the GPU image's 2.11) *_tensor
        def named(new: str, old: str) -> str:
            return new if hasattr(dist, new) else old

        timers = {"all_to_all": _Timer(a2a_module, "_all_to_all"),
                  "all_gather": _Timer(dist, named("all_gather_single", "all_gather_into_tensor")),
                  "reduce_scatter": _Timer(dist, named("reduce_scatter_single", "reduce_scatter_tensor"))}
    try:
        return _timed_steps(size, expert_parallels, world_size, world, timers)
    finally:
        for t in timers.values():
            t.restore()


def _timed_steps(size: Size, expert_parallels, world_size, world, timers):
    return {ep: _time_degree(size, ep, world_size, world, timers) for ep in expert_parallels}


def _time_degree(size: Size, ep: int, world_size, world, timers) -> tuple:
    """One expert_parallel degree's timed steps (its own function: its model and optimizer are freed on return,
    before the next degree's are built)."""
    import torch.nn.functional as F

    from bench.common import sync
    from livemoe.train.parallel import ParallelDims, ParallelMesh, clip_grad_norm_, parallelize
    from livemoe.train.parallel.mesh import build_mesh

    rank, device = world.rank, world.device
    # the GPU computes in bf16: FSDP keeps fp32 parameters and casts (param_dtype); one GPU holds bf16 ones
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    B, T, steps = size.batch, size.seq_len, size.steps
    share = B // world_size
    model = _model(size).to(device)
    if world.distributed:
        dims = ParallelDims(world_size=world_size, expert_parallel=ep)
        dp, ep_mesh, dp_mod_ep = build_mesh(dims, device.type)
        mesh = ParallelMesh(dims=dims, rank=rank, local_rank=world.local_rank, device=device, dp=dp,
                            ep=ep_mesh, dp_mod_ep=dp_mod_ep)
        model = parallelize(model, mesh, param_dtype=dtype)
    else:
        model = model.to(dtype)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, size.vocab, (B, T + 1), generator=g)[rank * share:(rank + 1) * share].to(device)

    def step():
        hidden = model.forward_hidden(ids[:, :-1])
        logits = model.compute_logits(hidden)
        loss = F.cross_entropy(logits.reshape(-1, logits.shape[-1]).float(), ids[:, 1:].reshape(-1), reduction="sum")
        (loss / (B * T)).backward()
        clip_grad_norm_(list(model.parameters()), 1.0)
        opt.step()
        opt.zero_grad()

    step()  # warm-up (on a GPU: the Triton kernels compile here)
    for t in timers.values():
        t.seconds = 0.0
    sync(device)
    t0 = time.perf_counter()
    for _ in range(steps):
        step()
    sync(device)
    elapsed = (time.perf_counter() - t0) / steps
    return (elapsed, share * T, *(timers[k].seconds / steps / elapsed if timers else 0.0
                                  for k in ("all_to_all", "all_gather", "reduce_scatter")))


def gpu_world(num_gpus: int, num_experts: int) -> int:
    """The ranks of the GPU case: the most GPUs, up to 8, over which the experts split evenly (EP over all of
    them); 1 when fewer than 2 GPUs can (expert parallel needs two ranks, and NCCL one GPU per rank)."""
    return max([w for w in range(2, min(num_gpus, 8) + 1) if num_experts % w == 0], default=1)


@pytest.mark.gpu  # the CPU ranks are test_bench_parallel's
def test_bench_parallel_gpu(bench_mode):
    """Step time of the Qwen3-30B-A3B-shaped layers on one GPU, then on N GPUs with expert parallel N against
    FSDP alone (the same global batch)."""
    from spawn_ranks import spawn_ranks  # tests/ is on the path (bench/conftest.py)

    size = GPU_SIZES[bench_mode]
    one_s, tokens, *_ = run_steps(size, [1], 1, "cuda")[1]
    torch.cuda.empty_cache()  # the ranks below start processes of their own on this GPU too
    record(suite="parallel_gpu", case=f"1 GPU, {size.layers} layers, {size.batch}x{size.seq_len} tokens",
           metric="ms per step", ours=one_s * 1e3, extra={"tok/s": round(tokens / one_s)})
    n = torch.cuda.device_count()
    world = gpu_world(n, size.experts)
    if world == 1:
        pytest.skip(f"expert parallel needs 2 or more GPUs (one NCCL rank each) whose number divides the "
                    f"{size.experts} experts; this machine has {n}: only the 1-GPU step was measured")
    results = spawn_ranks(run_steps, world, size, [1, world], world, "cuda", timeout=900)
    assert len(results) == world
    fsdp_s, ep_s = (max(r[ep][0] for r in results) for ep in (1, world))  # a step ends with its slowest rank's
    record(suite="parallel_gpu", case=f"{world} GPUs, expert_parallel {world}", metric="ms per step",
           ours=ep_s * 1e3, baseline=fsdp_s * 1e3, baseline_name=f"{world} GPUs, FSDP alone",
           extra={"1 GPU ms": round(one_s * 1e3, 2), "tok/s per GPU": round(results[0][world][1] / ep_s)})


def test_bench_parallel(bench_mode):
    from spawn_ranks import spawn_ranks  # tests/ is on the path (bench/conftest.py)

    size = SIZES[bench_mode]
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # every rank runs one thread: the 1-rank baseline too
    try:
        base_s, base_tokens, *_ = run_steps(size, [1], 1)[1]
    finally:
        torch.set_num_threads(threads)
    base_rate = base_tokens / base_s
    record(suite="parallel", case="1 rank", metric="tok/s per rank", ours=base_rate, higher_is_better=True)
    for world in WORLDS[bench_mode]:
        eps = [1, 2] if size.experts % 2 == 0 else [1]
        results = spawn_ranks(run_steps, world, size, eps, world, timeout=300 if bench_mode == "quick" else 1200)
        assert len(results) == world
        for ep in eps:
            rows = [r[ep] for r in results]
            seconds = max(r[0] for r in rows)  # the step ends when the slowest rank's does
            rate = rows[0][1] / seconds
            a2a, gather, scatter = (sum(r[i] for r in rows) / world for i in (2, 3, 4))
            assert rate > 0 and all(0 <= s <= 1 for s in (a2a, gather, scatter))
            assert (a2a > 0) == (ep > 1)  # the all-to-all runs exactly when experts are split
            record(suite="parallel", case=f"{world} ranks, expert_parallel {ep}", metric="tok/s per rank",
                   ours=rate, baseline=base_rate, baseline_name="1 rank", higher_is_better=True,
                   extra={"all_to_all_share": round(a2a, 3), "all_gather_share": round(gather, 3),
                          "reduce_scatter_share": round(scatter, 3)})


if __name__ == "__main__":
    pytest.main([__file__, "-q"])
