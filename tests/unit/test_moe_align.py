"""Routing align: the C++ op (csrc/moe_align.cpp), the Triton op and the reference against the contract."""
import os

import pytest
import torch
from test_moe_triton import DEVICE, triton_here

from livemoe.kernels import _ext
from livemoe.kernels.moe import moe_align, moe_align_reference, num_align_blocks


def check_invariants(topk_ids, num_experts, block, out):
    sorted_ids, expert_ids, counts, total = out
    n = topk_ids.numel()
    flat = topk_ids.reshape(-1).long()
    assert sorted_ids.numel() == num_align_blocks(n, num_experts, block) * block
    assert counts.sum().item() == n
    assert torch.equal(counts.long(), torch.bincount(flat, minlength=num_experts))
    real = sorted_ids[sorted_ids < n].long()
    assert torch.equal(real.sort().values, torch.arange(n))  # every (token, slot) exactly once
    total = total.item()
    assert total % block == 0 and (sorted_ids[total:] == n).all()
    used = expert_ids[: total // block].long()
    assert ((used >= 0) & (used < num_experts)).all() and (expert_ids[total // block:] == -1).all()
    assert (used[1:] >= used[:-1]).all()
    for b, e in enumerate(used.tolist()):  # each block holds only its expert's pairs, in ascending order
        ids = sorted_ids[b * block:(b + 1) * block].long()
        ids = ids[ids < n]
        assert (flat[ids] == e).all() and (ids[1:] > ids[:-1]).all()


CASES = [(1, 1, 4, 16), (7, 2, 5, 4), (33, 4, 13, 16), (64, 8, 8, 8), (5, 3, 3, 64)]


@pytest.mark.parametrize("T,k,E,block", CASES)
def test_reference_invariants(T, k, E, block):
    g = torch.Generator().manual_seed(T * 100 + E)
    topk_ids = torch.stack([torch.randperm(E, generator=g)[:k] for _ in range(T)])
    check_invariants(topk_ids, E, block, moe_align_reference(topk_ids, E, block))


def test_all_tokens_one_expert_leaves_empty_experts():
    topk_ids = torch.full((9, 1), 3)
    out = moe_align_reference(topk_ids, 7, 4)
    check_invariants(topk_ids, 7, 4, out)
    assert out[2].tolist() == [0, 0, 0, 9, 0, 0, 0] and out[3].item() == 12


@pytest.mark.skipif(not _ext.has_op("moe_align"), reason="livemoe._C not built (run `pip install -e .`)")
@pytest.mark.parametrize("T,k,E,block", CASES)
def test_cpp_op_equals_reference(T, k, E, block):
    g = torch.Generator().manual_seed(T + E)
    topk_ids = torch.stack([torch.randperm(E, generator=g)[:k] for _ in range(T)])
    got = _ext.op("moe_align")(topk_ids, E, block)
    want = moe_align_reference(topk_ids, E, block)
    for a, b in zip(got, want):
        assert torch.equal(a, b)
    check_invariants(topk_ids, E, block, moe_align(topk_ids, E, block))


@pytest.mark.skipif(not _ext.has_op("moe_align"), reason="livemoe._C not built (run `pip install -e .`)")
def test_cpp_op_rejects_out_of_range_expert():
    with pytest.raises(RuntimeError, match="outside"):
        _ext.op("moe_align")(torch.tensor([[0, 9]]), 4, 8)


def test_extension_is_built_in_a_normal_install():
    # The normal install (`make setup`) builds csrc/; a silent fallback would hide a broken build.
    if os.environ.get("LIVEMOE_NO_EXT") == "1":
        pytest.skip("LIVEMOE_NO_EXT=1: installed without the extension on purpose")
    assert _ext.available(), f"livemoe._C failed to import: {_ext.EXT_ERROR}"


def test_block_bound_uses_only_experts_that_can_be_hit():
    # T*k pairs touch at most min(E, T*k) experts, and an empty expert owns no block: decode grids stay small
    assert num_align_blocks(8, 128, 16) == 8
    assert num_align_blocks(100, 4, 16) == -(-(100 + 4 * 15) // 16)
    out = moe_align_reference(torch.tensor([[5, 77, 3]]), 128, 16)
    check_invariants(torch.tensor([[5, 77, 3]]), 128, 16, out)
    assert out[1].tolist() == [3, 5, 77]


# (T, k, E, block, chunk): one chunk (decode: one launch) and several chunks (counts scanned across them;
# 75 chunks take the scan's row loop round twice)
TRITON_CASES = [(1, 1, 4, 16, None), (7, 2, 5, 4, None), (33, 4, 13, 16, 16), (64, 8, 8, 8, 32),
                (5, 3, 3, 64, None), (100, 3, 17, 16, 64), (600, 2, 37, 16, 16), (1, 1, 1, 16, None)]


# the Triton op: compiled on a GPU, interpreted on the CPU (bench/gpu_check.sh selects these: -m "gpu or triton")


@triton_here
@pytest.mark.parametrize("T,k,E,block,chunk", TRITON_CASES)
def test_triton_op_equals_reference(T, k, E, block, chunk):
    from livemoe.kernels.moe.align_triton import moe_align_triton

    g = torch.Generator().manual_seed(T * 7 + E)
    topk_ids = torch.stack([torch.randperm(E, generator=g)[:k] for _ in range(T)])
    got = [t.cpu() for t in moe_align_triton(topk_ids.to(DEVICE), E, block, chunk=chunk)]
    for a, b in zip(got, moe_align_reference(topk_ids, E, block)):
        assert torch.equal(a, b)
    check_invariants(topk_ids, E, block, got)


@triton_here
def test_triton_op_all_tokens_one_expert():
    from livemoe.kernels.moe.align_triton import moe_align_triton

    topk_ids = torch.full((40, 1), 2)
    got = [t.cpu() for t in moe_align_triton(topk_ids.to(DEVICE), 7, 16, chunk=16)]
    check_invariants(topk_ids, 7, 16, got)
    assert got[2].tolist() == [0, 0, 40, 0, 0, 0, 0] and got[3].item() == 48


@pytest.mark.gpu
@pytest.mark.parametrize("T,block", [(1, 16), (16, 16), (4096, 64), (16384, 128)])
def test_triton_op_on_gpu_at_qwen3_30b_routing(T, block):
    # E=128, k=8: the dispatch picks the Triton op on CUDA; several chunks from T=4096 on
    g = torch.Generator(device="cuda").manual_seed(T)
    topk_ids = torch.topk(torch.rand(T, 128, device="cuda", generator=g), 8, dim=-1).indices
    got = moe_align(topk_ids, 128, block)
    for a, b in zip(got, moe_align_reference(topk_ids, 128, block)):
        assert torch.equal(a, b)
    check_invariants(topk_ids.cpu(), 128, block, [t.cpu() for t in got])
