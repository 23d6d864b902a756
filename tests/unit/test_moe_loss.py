"""The load-balancing loss against transformers' load_balancing_loss_func, and its known values."""
import pytest
import torch
from transformers.models.qwen3_moe.modeling_qwen3_moe import load_balancing_loss_func

from livemoe.engine.model.moe_loss import load_balancing_loss


@pytest.mark.parametrize("E,k", [(8, 2), (7, 1), (5, 5)])
@pytest.mark.parametrize("masked", [False, True])
def test_global_equals_transformers(E, k, masked):
    g = torch.Generator().manual_seed(E * 10 + k)
    B, T, L = 3, 11, 4
    logits = tuple(torch.randn(B * T, E, generator=g) * 2 for _ in range(L))
    mask = (torch.rand(B, T, generator=g) > 0.3).long() if masked else None
    ours = load_balancing_loss(logits, E, k, mask)
    ref = load_balancing_loss_func(logits, E, k, mask)
    assert torch.allclose(ours, ref, rtol=1e-5), (ours, ref)


def balanced_logits(E=4, k=2):
    """Each token prefers a cyclic shift of the same k experts: counts and mean probs are uniform."""
    base = torch.tensor([3.0] * k + [0.0] * (E - k))
    return torch.stack([base.roll(s) for s in range(E)])


def test_perfect_balance_values():
    logits = (balanced_logits(), balanced_logits())
    assert torch.allclose(load_balancing_loss(logits, 4, 2, mode="global"), torch.tensor(2.0))  # = top_k
    assert torch.allclose(load_balancing_loss(logits, 4, 2, mode="per_layer"), torch.tensor(1.0))


def test_per_layer_penalises_collapse_more_than_balance():
    collapsed = torch.tensor([[5.0, 4.0, 0.0, 0.0]]).repeat(8, 1)
    assert load_balancing_loss((collapsed,), 4, 2, mode="per_layer") > load_balancing_loss((balanced_logits(),), 4, 2, mode="per_layer")


def test_differentiable_and_bad_mode():
    logits = torch.randn(10, 6, requires_grad=True)
    load_balancing_loss((logits,), 6, 2).backward()
    assert logits.grad.abs().sum() > 0
    with pytest.raises(ValueError, match="mode must be one of"):
        load_balancing_loss((logits,), 6, 2, mode="local")
