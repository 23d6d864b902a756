"""livemoe.train.distributed on 2 gloo ranks with expert_parallel 2: a global batch's shares, rank-0-only work, the
load-balancing loss over the global batch (value and gradient equal one process's), and the gathered export
that engine.load_model reads back equal to the model before sharding."""
import sys

import pytest
import torch

from spawn_ranks import spawn_ranks

from livemoe.engine.model.moe_loss import load_balancing_loss
from test_parallel_fsdp import build_model

E, K = 4, 2


def router_logits(seed: int = 3):
    """Two MoE layers' logits of 8 tokens, and an attention mask that drops some."""
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(8, E, generator=g) for _ in range(2)], torch.tensor([[1, 1, 1, 0], [1, 1, 1, 1]])


def trainer_worker(export_dir: str):
    from livemoe.train.distributed import setup

    d = setup(expert_parallel=2, timeout_s=60, num_experts=E)
    out = {"stdout_silenced": sys.stdout.name == "/dev/null", "share": d.local_share(list(range(6))),
           "uneven": d.local_share(list(range(3)))}
    for bad in (lambda: d.local_share([7]), lambda: d.check_batch_sizes(4, 9)):
        try:
            bad()
        except ValueError as e:
            out.setdefault("bad", []).append(str(e))
    out["from_main"] = d.from_main(lambda: f"made on rank {d.rank}")
    # rank r holds batch row r (4 tokens of each layer's logits)
    logits, mask = router_logits()
    local = [x[4 * d.rank:4 * d.rank + 4].clone().requires_grad_() for x in logits]
    for mode in ("global", "per_layer"):
        share = load_balancing_loss(local, E, K, mask[d.rank:d.rank + 1], mode, group=d.group)
        grads = torch.autograd.grad(share, local)
        out[mode] = (d.sum(share).item(), [g for g in grads])
    model = d.parallelize(build_model(), bf16=False)
    d.export(model, export_dir)
    return out


@pytest.mark.slow
def test_trainer_helpers_on_two_ranks(tmp_path):
    from livemoe import engine

    export_dir = str(tmp_path / "final")
    results = spawn_ranks(trainer_worker, 2, export_dir, timeout=180)
    assert [r["stdout_silenced"] for r in results] == [False, True]
    assert [r["share"] for r in results] == [[0, 1, 2], [3, 4, 5]]
    assert [r["uneven"] for r in results] == [[0, 1], [2]]
    assert results[0]["bad"] == results[1]["bad"] == [
        "the batch of 1 sequences does not split over 2 ranks (each rank needs at least one)",
        "the last micro-batch of an epoch has 1 sequences, fewer than the 2 ranks (batch_size 4, 9 examples): "
        "each rank needs at least one"]
    assert [r["from_main"] for r in results] == ["made on rank 0"] * 2

    logits, mask = router_logits()
    for mode in ("global", "per_layer"):
        full = [x.clone().requires_grad_() for x in logits]
        loss = load_balancing_loss(full, E, K, mask, mode)
        grads = torch.autograd.grad(loss, full)
        for r in results:  # every rank logs the global value
            torch.testing.assert_close(torch.tensor(r[mode][0]), loss.detach(), rtol=1e-6, atol=0)
        # the ranks' gradients (summed over ranks by FSDP, here each on its own rows) are the one-process one
        assert len(grads) == 2 and all(g.abs().sum() > 0 for g in grads)
        for layer, g in enumerate(grads):
            torch.testing.assert_close(torch.cat([r[mode][1][layer] for r in results]), g, rtol=1e-5, atol=1e-7)
    # a local-only loss would differ: the two halves route differently
    local_only = sum(load_balancing_loss([x[4 * r:4 * r + 4] for x in logits], E, K, mask[r:r + 1]) for r in (0, 1))
    assert not torch.allclose(local_only / 2, load_balancing_loss(logits, E, K, mask))

    exported = engine.load_model(export_dir, dtype=torch.float32)
    ref = build_model()
    ref_state, got = ref.state_dict(), exported.state_dict()
    assert got.keys() == ref_state.keys() and len(got) > 0
    for name, t in ref_state.items():
        assert torch.equal(got[name], t), name
