"""The expert-parallel MoE layer (livemoe.train.parallel.ep_fused_moe) on 2 and 4 gloo ranks against fused_moe on one
device: the output and the four gradients (tokens, router weight, w_gate_up, w_down), including experts and
whole ranks that receive no tokens and a rank with no tokens of its own; and the mesh's bad-input errors.

Tolerance (fp32): rtol 1e-5, atol 1e-6. The EP path moves rows without arithmetic; it sums the k weighted
expert outputs of a token in another order than fused_moe's index_add, and the router weight's gradient is
a sum over ranks of partial sums, so results differ by a few fp32 roundings of O(1) values, not more.
"""
import time

import pytest
import torch
import torch.nn.functional as F

from spawn_ranks import spawn_ranks

from livemoe.train.parallel import ExpertParallel, ParallelDims, ep_fused_moe, init_distributed
from livemoe.train.parallel.mesh import build_mesh
from livemoe.kernels.moe import fused_moe

H, I, TOP_K = 16, 8, 2
TOL = dict(rtol=1e-5, atol=1e-6)

# name: (num_experts, tokens per rank (one entry per rank of the EP group), experts no token may pick)
CASES = {
    "all_used": (8, [12, 12], []),
    "some_experts_empty": (8, [10, 7], [3, 6]),
    "a_rank_receives_nothing": (4, [9, 9], [2, 3]),  # rank 1 owns experts 2 and 3
    "a_rank_sends_nothing": (4, [11, 0], []),
    "four_ranks": (8, [5, 9, 3, 6], [0, 5]),
}


def make_case(num_experts: int, tokens: list[int], unused: list[int], seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    n = sum(tokens)
    x = torch.randn(n, H, generator=g)
    gate = torch.randn(num_experts, H, generator=g)
    w_gate_up = torch.randn(num_experts, 2 * I, H, generator=g) * 0.3
    w_down = torch.randn(num_experts, H, I, generator=g) * 0.3
    grad_out = torch.randn(n, H, generator=g)
    offset = torch.zeros(num_experts)
    offset[unused] = -1e4  # these experts are never in a token's top-k
    return x, gate, w_gate_up, w_down, grad_out, offset


def reference(case):
    """fused_moe on one device over every rank's tokens: output and the four gradients."""
    x, gate, w_gate_up, w_down, grad_out, offset = (t.clone().requires_grad_(i in (0, 1, 2, 3))
                                                     for i, t in enumerate(make_case(*case)))
    out = fused_moe(x, w_gate_up, w_down, F.linear(x, gate) + offset, TOP_K, True)
    (out * grad_out).sum().backward()
    return out.detach(), x.grad, gate.grad, w_gate_up.grad, w_down.grad


def run_ep(case, ep: ExpertParallel):
    """This rank's share of the case through ep_fused_moe: (out, dx, d_gate (partial), d_w_gate_up, d_w_down)."""
    num_experts, tokens, unused = case
    x, gate, w_gate_up, w_down, grad_out, offset = make_case(*case)
    start = sum(tokens[:ep.rank])
    rows = slice(start, start + tokens[ep.rank])
    x = x[rows].clone().requires_grad_()
    gate = gate.clone().requires_grad_()
    w_gate_up = w_gate_up[ep.local_experts].clone().requires_grad_()
    w_down = w_down[ep.local_experts].clone().requires_grad_()
    out = ep_fused_moe(x, w_gate_up, w_down, F.linear(x, gate) + offset, TOP_K, True, ep)
    (out * grad_out[rows]).sum().backward()
    return out.detach(), x.grad, gate.grad, w_gate_up.grad, w_down.grad


def check(case, per_rank: list):
    """Gathers the ranks' pieces as one device would hold them and compares with fused_moe."""
    out, dx, d_gate, d_wgu, d_wd = reference(case)
    assert len(per_rank) == len(case[1]) > 1
    torch.testing.assert_close(torch.cat([r[0] for r in per_rank]), out, **TOL)
    torch.testing.assert_close(torch.cat([r[1] for r in per_rank]), dx, **TOL)
    torch.testing.assert_close(torch.stack([r[2] for r in per_rank]).sum(0), d_gate, **TOL)
    torch.testing.assert_close(torch.cat([r[3] for r in per_rank]), d_wgu, **TOL)
    torch.testing.assert_close(torch.cat([r[4] for r in per_rank]), d_wd, **TOL)
    assert d_gate.abs().sum() > 0 and dx.abs().sum() > 0  # not a vacuous match
    routed = d_wgu.abs().amax(dim=(1, 2)) > 0  # experts that received tokens have gradients, the others none
    assert routed.any() and not routed[case[2]].any()
    assert (d_wd.abs().amax(dim=(1, 2)) > 0).equal(routed)
    ep_wgu = torch.cat([r[3] for r in per_rank])
    assert (ep_wgu[~routed] == 0).all()


def bad_mesh_errors() -> list[str | None]:
    """init_distributed's error for each bad mesh; raised before any collective, so no rank waits."""
    errors = []
    for kw in (dict(expert_parallel=2, num_experts=3), dict(expert_parallel=4), dict(expert_parallel=0)):
        try:
            init_distributed(timeout_s=10, **kw)
            errors.append(None)
        except ValueError as e:
            errors.append(str(e))
    return errors


def two_rank_worker(case_names: list[str]):
    errors = bad_mesh_errors()
    mesh = init_distributed(expert_parallel=2, timeout_s=60)
    results = {name: run_ep(CASES[name], ExpertParallel(mesh.ep.get_group(), 2, mesh.rank, CASES[name][0]))
               for name in case_names}
    return mesh.rank, errors, results


def test_ep_two_ranks_matches_fused_moe_and_bad_meshes_fail_on_every_rank():
    names = [n for n in CASES if len(CASES[n][1]) == 2]
    results = spawn_ranks(two_rank_worker, 2, names, timeout=120)
    assert [rank for rank, _, _ in results] == [0, 1]
    for name in names:
        check(CASES[name], [res[name] for _, _, res in results])
    assert results[0][1] == results[1][1]
    ep_experts, ep_world, ep_zero = results[0][1]
    assert "expert_parallel=2 does not divide the model's num_experts=3" in ep_experts
    assert "expert_parallel=4 does not divide world_size=2" in ep_world
    assert "expert_parallel must be >= 1, got 0" in ep_zero


def four_rank_worker():
    """expert_parallel 4 (one group), then 2 (two groups, each exchanging tokens only inside itself)."""
    mesh = init_distributed(expert_parallel=4, timeout_s=60)
    whole = run_ep(CASES["four_ranks"], ExpertParallel(mesh.ep.get_group(), 4, mesh.rank, 8))
    _, ep_mesh, dp_mod_ep = build_mesh(ParallelDims(world_size=4, expert_parallel=2), "cpu")
    ep = ExpertParallel(ep_mesh.get_group(), 2, ep_mesh.get_local_rank(), 8)
    # group g = rank // 2 runs its own case, so a token leaking across groups shows
    case = (8, [6, 4], [1]) if mesh.rank // 2 == 0 else (8, [3, 7], [])
    return mesh.rank, whole, (ep_mesh.get_local_rank(), dp_mod_ep.get_local_rank(), case, run_ep(case, ep))


@pytest.mark.slow
def test_ep_four_ranks_matches_fused_moe_in_one_group_and_in_two():
    results = spawn_ranks(four_rank_worker, 4, timeout=180)
    assert [r[0] for r in results] == [0, 1, 2, 3]
    check(CASES["four_ranks"], [r[1] for r in results])
    groups = [r[2] for r in results]
    assert [(g[0], g[1]) for g in groups] == [(0, 0), (1, 0), (0, 1), (1, 1)]
    assert groups[0][2] != groups[2][2]
    for group in (groups[:2], groups[2:]):
        check(group[0][2], [g[3] for g in group])


def test_expert_parallel_rejects_experts_it_cannot_split():
    with pytest.raises(ValueError, match="expert_parallel=3 does not divide num_experts=8"):
        ExpertParallel(None, 3, 0, 8)


def dead_rank_worker(mode: str):
    """Rank 1 leaves (exits, or sleeps past the timeout) instead of joining an all-reduce: rank 0 must raise."""
    import os

    import torch.distributed as dist

    mesh = init_distributed(timeout_s=2)
    dist.barrier()
    if mesh.rank == 1:
        if mode == "exit":
            os._exit(0)
        time.sleep(5)
        return None
    start = time.monotonic()
    try:
        dist.all_reduce(torch.ones(4))
    except Exception as e:  # noqa: BLE001  (gloo raises RuntimeError or DistBackendError)
        return time.monotonic() - start, type(e).__name__, str(e)[:300]
    return "no error"


@pytest.mark.parametrize("mode", ["exit", pytest.param("stall", marks=pytest.mark.slow)])
def test_a_dead_rank_makes_the_others_raise_not_hang(mode):
    if mode == "exit":
        with pytest.raises(RuntimeError, match="rank 1 exited with code 0 and no result"):
            spawn_ranks(dead_rank_worker, 2, mode, timeout=60)
        return
    results = spawn_ranks(dead_rank_worker, 2, mode, timeout=60)
    elapsed, kind, message = results[0]
    assert elapsed < 5, (elapsed, kind, message)  # the 2 s collective timeout, well before rank 1 wakes
    assert message
