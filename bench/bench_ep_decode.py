"""The decoder's expert-parallel MoE layer at decode batch sizes on 2 gloo ranks: how to combine the experts'
outputs when every rank holds every token (tensor-parallel attention leaves the hidden states replicated).

  ours      all-reduce: each rank runs its E/N experts on the pairs routed to them, one all-reduce of [T, H]
            partial sums (livemoe.engine.model.tensor_parallel.ReplicatedExpertParallel, what the decoder uses);
            two rows: the eager form (only this rank's pairs gathered) and the fixed-shape form a CUDA graph
            captures (every pair computed, those routed elsewhere with weight 0)
  baseline  all-to-all: each rank takes 1/N of the tokens through the training EP layer (ep_fused_moe: counts
            exchange, dispatch and combine all-to-alls, with host syncs for the splits), then an all-gather
            replicates the outputs

Both give the same output (asserted); a row is the slower rank's median ms per MoE layer call.
"""
import datetime

import pytest
import torch

from bench.common import median_pair, record

# (hidden, experts, top_k, moe_intermediate, decode batch sizes, reps)
SIZES = {"quick": (64, 8, 2, 32, (1, 8), 3), "full": (512, 32, 4, 256, (1, 8, 32, 64), 30)}


def run_rank(size):
    import time

    import torch.distributed as dist

    from livemoe.engine.model.tensor_parallel import TensorParallel
    from livemoe.train.parallel import ExpertParallel, ep_fused_moe
    from livemoe.engine.model.tensor_parallel import ReplicatedExpertParallel

    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=120))
    rank, n = dist.get_rank(), dist.get_world_size()
    H, E, k, inter, batches, reps = size
    g = torch.Generator().manual_seed(0)
    gate = torch.randn(E, H, generator=g)
    w_gate_up = torch.randn(E, 2 * inter, H, generator=g) * H ** -0.5
    w_down = torch.randn(E, H, inter, generator=g) * inter ** -0.5
    replicated = ReplicatedExpertParallel(TensorParallel(rank, n, None, expert_parallel=True), E, inter)
    mine = slice(replicated.first, replicated.first + replicated.num_local)
    w_gate_up, w_down = w_gate_up[mine].contiguous(), w_down[mine].contiguous()
    ep = ExpertParallel(dist.group.WORLD, n, rank, E)
    out = {}
    for T in batches:
        x = torch.randn(T, H, generator=g)
        logits = x @ gate.T
        per = -(-T // n)

        def timed(fn):
            def run():
                dist.barrier()
                t0 = time.perf_counter()
                y = fn()
                return time.perf_counter() - t0, y
            return run

        def all_reduce(fixed_shapes=False):
            return replicated.fused_moe(x, w_gate_up, w_down, logits, k, True, fixed_shapes=fixed_shapes)

        def all_to_all():
            rows = slice(rank * per, min(T, (rank + 1) * per))
            y = torch.zeros(per, H)
            y[: max(0, rows.stop - rows.start)] = ep_fused_moe(x[rows], w_gate_up, w_down, logits[rows], k, True, ep)
            gathered = torch.empty(n * per, H)
            dist.all_gather_into_tensor(gathered, y)
            return gathered[:T]

        with torch.inference_mode():
            t_ours, y_ours, t_base, y_base = median_pair(timed(all_reduce), timed(all_to_all), reps)
            t_fixed, y_fixed, t_base2, _ = median_pair(timed(lambda: all_reduce(True)), timed(all_to_all), reps)
        torch.testing.assert_close(y_ours, y_base, rtol=1e-5, atol=1e-6)
        torch.testing.assert_close(y_fixed, y_base, rtol=1e-5, atol=1e-6)
        out[T] = (t_ours, t_base, t_fixed, t_base2)
    return out


def test_bench_ep_decode(bench_mode):
    from spawn_ranks import spawn_ranks  # tests/ is on the path (bench/conftest.py)

    size = SIZES[bench_mode]
    results = spawn_ranks(run_rank, 2, size, timeout=300 if bench_mode == "quick" else 900)
    assert len(results) == 2
    H, E, k, inter = size[:4]
    for T in size[4]:
        ours, base, fixed, base2 = (max(r[T][i] for r in results) * 1e3 for i in range(4))
        assert min(ours, base, fixed, base2) > 0
        for form, t, b in (("eager", ours, base), ("fixed shapes", fixed, base2)):
            record(suite="ep_decode", case=f"2 ranks, batch {T}, all-reduce {form} (H={H}, E={E}, k={k}, I={inter})",
                   metric="ms", ours=t, baseline=b, baseline_name="all-to-all + all-gather")


if __name__ == "__main__":
    pytest.main([__file__, "-q"])
