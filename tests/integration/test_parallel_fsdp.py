"""parallelize (expert parallel + FSDP2) on 2 and 4 gloo ranks: a few AdamW steps of a tiny MoE model, with and
without expert_parallel 2, give the same losses and final weights as one process with the same global batch;
rank 0's sharded parameters, gradients and AdamW states take the bytes livemoe.train.plan says.

Tolerance (fp32): losses rtol 1e-5 (seen 1.2e-7); weights atol 5e-6 after 3 steps at lr 1e-3 (seen 6e-8
without EP, 9e-7 with). The ranks compute the same sums in other groupings (each rank's share of the batch,
the reduce-scatter's sum of partial gradients, the EP layer's order of the k expert outputs), which differ by
fp32 roundings; Adam divides by sqrt(v), so for an element whose gradient is tiny a rounding of it moves its
update by a visible fraction of lr. 5e-6 is still 200x below one step's update (lr), so a wrong gradient (a
missing rank's share, an averaged instead of summed reduction) fails it."""
import pytest
import torch
import torch.nn.functional as F

from spawn_ranks import spawn_ranks

from livemoe.engine.model.config import ModelConfig
from livemoe.engine.model.qwen3 import Qwen3ForCausalLM
from livemoe.train.parallel import ParallelDims, ParallelMesh, clip_grad_norm_, init_distributed, parallelize
from livemoe.train.parallel.mesh import build_mesh
from livemoe.train.plan import PlanConfig, plan

CFG = dict(model_type="qwen3_moe", vocab_size=61, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
           num_key_value_heads=2, head_dim=8, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=16,
           norm_topk_prob=True, tie_word_embeddings=False)
BATCH, SEQ, STEPS, LR, MAX_NORM = 4, 7, 3, 1e-3, 0.5


def build_model(tied: bool = False) -> Qwen3ForCausalLM:
    cfg = ModelConfig.from_dict({**CFG, "tie_word_embeddings": tied})
    torch.manual_seed(0)
    model = Qwen3ForCausalLM(cfg)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("mlp.gate.weight"):
                p.normal_(0.0, 1.0)  # spread routing: the top-k is decided by the weights, not by rounding
            elif "norm" in name:
                p.uniform_(0.5, 1.5)
            else:
                p.normal_(0.0, 0.1)
    return model


def batch(step: int):
    """The global batch of a step: ids [B, T+1] and a completion mask with uneven token counts per sequence."""
    g = torch.Generator().manual_seed(100 + step)
    ids = torch.randint(0, CFG["vocab_size"], (BATCH, SEQ + 1), generator=g)
    mask = torch.rand(BATCH, SEQ, generator=g) < torch.tensor([0.9, 0.3, 0.6, 0.8])[:, None]
    mask[:, 0] = True
    return ids, mask


def loss_sum(model, ids, mask):
    """Sum of the masked next-token losses (logits through model.lm_head_weight, as the fused kernels read it)."""
    hidden = model.forward_hidden(ids[:, :-1])
    logits = model.compute_logits(hidden).float()
    token_loss = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), ids[:, 1:].reshape(-1), reduction="none")
    return (token_loss * mask.reshape(-1)).sum()


def train(model, rows: slice, step_hook=None) -> list[float]:
    """STEPS AdamW steps on `rows` of each global batch, the loss normalised by the global batch's target tokens;
    returns the global loss of each step (the ranks' shares summed when distributed)."""
    import torch.distributed as dist

    opt = torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=0.1)
    losses = []
    for step in range(STEPS):
        ids, mask = batch(step)
        loss = loss_sum(model, ids[rows], mask[rows]) / mask.sum()
        loss.backward()
        clip_grad_norm_(list(model.parameters()), MAX_NORM)
        opt.step()
        if step_hook and step == STEPS - 1:
            step_hook(model, opt)
        opt.zero_grad()
        total = loss.detach().clone()
        if dist.is_initialized():
            dist.all_reduce(total)
        losses.append(total.item())
    return losses


def shard_bytes(model, opt) -> dict:
    params = list(model.parameters())
    states = [t for p in params for t in opt.state[p].values() if torch.is_tensor(t)]
    local = lambda t: t.to_local() if hasattr(t, "to_local") else t  # noqa: E731
    return {"parameters_fp32": sum(local(p).nbytes for p in params),
            "gradients_fp32": sum(local(p.grad).nbytes for p in params),
            "optimizer_adamw_fp32": sum(local(t).nbytes for t in states)}


def full_weights(model) -> dict:
    """Every parameter gathered over its FSDP mesh (experts: this EP rank's slice)."""
    return {name: p.full_tensor().detach() for name, p in model.named_parameters()}


def fsdp_worker(expert_parallels: list[int], tied: bool, checkpointing: bool):
    world = init_distributed(timeout_s=60)
    rank, size = world.rank, world.dims.world_size
    per_rank = BATCH // size
    out = {}
    for ep in expert_parallels:
        dims = ParallelDims(world_size=size, expert_parallel=ep)
        dp, ep_mesh, dp_mod_ep = build_mesh(dims, "cpu")
        mesh = ParallelMesh(dims=dims, rank=rank, local_rank=rank, device=torch.device("cpu"), dp=dp, ep=ep_mesh,
                            dp_mod_ep=dp_mod_ep)
        model = build_model(tied)
        model.gradient_checkpointing = checkpointing  # recomputes each FSDP layer (gathers it again) in backward
        model = parallelize(model, mesh, param_dtype=torch.float32, reduce_dtype=torch.float32)
        measured = {}
        losses = train(model, slice(rank * per_rank, (rank + 1) * per_rank),
                       lambda m, o: measured.update(shard_bytes(m, o)))
        out[ep] = (losses, full_weights(model), ep_mesh.get_local_rank(), measured)
    return out


def single_process(tied: bool):
    model = build_model(tied)
    losses = train(model, slice(None))
    return losses, {name: p.detach() for name, p in model.named_parameters()}


def compare(results, tied: bool, eps: list[int]):
    ref_losses, ref_weights = single_process(tied)
    for ep in eps:
        losses, weights, _, measured = results[0][ep]
        assert len(losses) == len(ref_losses) == STEPS and ref_losses[-1] < ref_losses[0]
        torch.testing.assert_close(torch.tensor(losses), torch.tensor(ref_losses), rtol=1e-5, atol=0)
        for rank_result in results[1:]:
            assert rank_result[ep][0] == losses  # every rank reports the same global loss
        assert weights.keys() == ref_weights.keys() and len(weights) > 0
        for name, ref in ref_weights.items():
            if ".mlp.experts." in name and ep > 1:  # each EP rank holds a slice: join them in EP-rank order
                parts = {}
                for r in results:  # ranks with the same EP index gathered the same experts
                    ep_rank, slice_ = r[ep][2], r[ep][1][name]
                    assert ep_rank not in parts or torch.equal(parts[ep_rank], slice_)
                    parts[ep_rank] = slice_
                assert sorted(parts) == list(range(ep))
                got = torch.cat([parts[i] for i in range(ep)])
            else:
                got = weights[name]
            torch.testing.assert_close(got, ref, rtol=0, atol=5e-6, msg=f"{name} (expert_parallel {ep})")
        model = build_model(tied)
        expected = plan(model.config, PlanConfig(gpus=len(results), gpu_mem_gb=1, expert_parallel=ep,
                                                 batch_size=BATCH))["per_gpu_bytes"]
        assert measured == {k: expected[k] for k in measured}, (ep, measured)
    moved = [(w - build_model(tied).state_dict()[n]).abs().max() for n, w in ref_weights.items()]
    assert min(moved) > 0  # every weight trained, so the comparison is not of initial weights


@pytest.mark.slow
def test_two_ranks_match_one_process_with_and_without_expert_parallel():
    results = spawn_ranks(fsdp_worker, 2, [1, 2], False, False, timeout=240)
    compare(results, False, [1, 2])


@pytest.mark.slow
def test_four_ranks_expert_parallel_2_experts_sharded_tied_checkpointed():
    """Two EP groups: each expert is held by 2 ranks, which shard it (dp_mod_ep = 2); a tied embedding/head;
    gradient checkpointing."""
    results = spawn_ranks(fsdp_worker, 4, [2], True, True, timeout=300)
    compare(results, True, [2])
