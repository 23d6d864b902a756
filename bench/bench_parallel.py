"""Training steps of a small MoE model on 1, 2 (and at full size 4) gloo ranks, with and without expert
parallel: tokens per second per rank (ratio against one rank in the same run) and the share of the step
spent in the all-to-all (the EP layer's dispatch and combine), FSDP's all-gathers and its reduce-scatters.

The collectives are timed by wrapping them (the all-to-all in engine.parallel, FSDP2's
torch.distributed.all_gather_single / reduce_scatter_single, each waited on at once: on the CPU gloo gives
no overlap to lose). The global batch is the same for every world size, so a rank's share shrinks as ranks
are added: the per-rank rate says what the collectives cost, not how far a cluster scales.
"""
import importlib
import time

import pytest
import torch

from bench.common import record

# (hidden, layers, experts, top_k, moe_intermediate, vocab, global batch, seq_len, timed steps)
SIZES = {"quick": (64, 2, 8, 2, 32, 128, 8, 32, 2), "full": (256, 4, 16, 2, 128, 1024, 16, 128, 5)}
WORLDS = {"quick": (2,), "full": (2, 4)}


def _model(size):
    from engine.config import ModelConfig
    from engine.model import Qwen3ForCausalLM

    H, L, E, k, inter, V = size[:6]
    cfg = ModelConfig.from_dict(dict(model_type="qwen3_moe", vocab_size=V, hidden_size=H, num_hidden_layers=L,
                                     num_attention_heads=4, num_key_value_heads=2, head_dim=H // 4, num_experts=E,
                                     num_experts_per_tok=k, moe_intermediate_size=inter, norm_topk_prob=True))
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


def run_steps(size, expert_parallels, world_size: int):
    """Per expert_parallel degree: (seconds per step, tokens per rank per step, share of all-to-all, all-gather,
    reduce-scatter in the step). Runs on the ranks spawn_ranks starts, or in-process for one rank."""
    import torch.distributed as dist

    from engine.parallel import init_distributed

    a2a_module = importlib.import_module("engine.parallel.all_to_all")  # the module (the package exports the function)

    world = init_distributed(timeout_s=120)
    timers = {"all_to_all": _Timer(a2a_module, "_all_to_all"), "all_gather": _Timer(dist, "all_gather_single"),
              "reduce_scatter": _Timer(dist, "reduce_scatter_single")}
    try:
        return _timed_steps(size, expert_parallels, world_size, world, timers)
    finally:
        for t in timers.values():
            t.restore()


def _timed_steps(size, expert_parallels, world_size, world, timers):
    import torch.nn.functional as F

    from engine.parallel import ParallelDims, ParallelMesh, clip_grad_norm_, parallelize
    from engine.parallel.mesh import build_mesh

    rank = world.rank
    B, T, steps = size[6], size[7], size[8]
    share = B // world_size
    out = {}
    for ep in expert_parallels:
        model = _model(size)
        if world.distributed:
            dims = ParallelDims(world_size=world_size, expert_parallel=ep)
            dp, ep_mesh, dp_mod_ep = build_mesh(dims, "cpu")
            mesh = ParallelMesh(dims=dims, rank=rank, local_rank=rank, device=torch.device("cpu"), dp=dp,
                                ep=ep_mesh, dp_mod_ep=dp_mod_ep)
            model = parallelize(model, mesh, param_dtype=torch.float32)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
        g = torch.Generator().manual_seed(0)
        ids = torch.randint(0, size[5], (B, T + 1), generator=g)[rank * share:(rank + 1) * share]

        def step():
            hidden = model.forward_hidden(ids[:, :-1])
            logits = model.compute_logits(hidden)
            loss = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), ids[:, 1:].reshape(-1), reduction="sum")
            (loss / (B * T)).backward()
            clip_grad_norm_(list(model.parameters()), 1.0)
            opt.step()
            opt.zero_grad()

        step()  # warm-up
        for t in timers.values():
            t.seconds = 0.0
        t0 = time.perf_counter()
        for _ in range(steps):
            step()
        elapsed = (time.perf_counter() - t0) / steps
        out[ep] = (elapsed, share * T, *(timers[k].seconds / steps / elapsed
                                         for k in ("all_to_all", "all_gather", "reduce_scatter")))
    return out


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
        eps = [1, 2] if size[2] % 2 == 0 else [1]
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
