"""Routing align: the C++ op (csrc/moe_align.cpp) and the reference against the contract."""
import pytest
import os

import torch

from kernels import _ext
from kernels.moe import moe_align, moe_align_reference, num_align_blocks


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


@pytest.mark.skipif(not _ext.has_op("moe_align"), reason="kernels._C not built (run `pip install -e .`)")
@pytest.mark.parametrize("T,k,E,block", CASES)
def test_cpp_op_equals_reference(T, k, E, block):
    g = torch.Generator().manual_seed(T + E)
    topk_ids = torch.stack([torch.randperm(E, generator=g)[:k] for _ in range(T)])
    got = _ext.op("moe_align")(topk_ids, E, block)
    want = moe_align_reference(topk_ids, E, block)
    for a, b in zip(got, want):
        assert torch.equal(a, b)
    check_invariants(topk_ids, E, block, moe_align(topk_ids, E, block))


@pytest.mark.skipif(not _ext.has_op("moe_align"), reason="kernels._C not built (run `pip install -e .`)")
def test_cpp_op_rejects_out_of_range_expert():
    with pytest.raises(RuntimeError, match="outside"):
        _ext.op("moe_align")(torch.tensor([[0, 9]]), 4, 8)


def test_extension_is_built_in_a_normal_install():
    # The normal install (`make setup`) builds csrc/; a silent fallback would hide a broken build.
    if os.environ.get("LIVEMOE_NO_EXT") == "1":
        pytest.skip("LIVEMOE_NO_EXT=1: installed without the extension on purpose")
    assert _ext.available(), f"kernels._C failed to import: {_ext.EXT_ERROR}"
