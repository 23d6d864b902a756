"""livemoe.train.plan: parameter, gradient and AdamW bytes equal what a CPU run allocates (one process here; the FSDP2
shards of 2 ranks in test_parallel_fsdp.py), hand-checked figures for Qwen3-30B-A3B, and its bad-input errors."""
import json
import math

import pytest
import torch

from livemoe.engine.model.config import ModelConfig
from livemoe.engine.model.flops import resolve_config
from livemoe.engine.model.qwen3 import Qwen3ForCausalLM
from tiny_models import BASE, MOE
from livemoe.train.plan import PlanConfig, main, plan


def tiny_config(**overrides) -> ModelConfig:
    return ModelConfig.from_dict({**BASE, **MOE, "model_type": "qwen3_moe", **overrides})


def allocated_after_adamw_step(model) -> dict:
    """Bytes of the parameters, their gradients and AdamW's state after one step, as allocated."""
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    ids = torch.randint(0, model.config.vocab_size, (2, 5))
    model(ids).float().pow(2).mean().backward()
    opt.step()
    params = list(model.parameters())
    assert len(params) > 0 and all(p.grad is not None for p in params)
    states = [t for p in params for t in opt.state[p].values() if torch.is_tensor(t)]
    assert len(states) == 3 * len(params)  # exp_avg, exp_avg_sq, step
    return {"parameters_fp32": sum(p.nbytes for p in params), "gradients_fp32": sum(p.grad.nbytes for p in params),
            "optimizer_adamw_fp32": sum(t.nbytes for t in states)}


@pytest.mark.parametrize("tied", [False, True])
def test_one_process_bytes_equal_what_an_adamw_step_allocates(tied):
    cfg = tiny_config(tie_word_embeddings=tied)
    torch.manual_seed(0)
    model = Qwen3ForCausalLM(cfg)
    for p in model.parameters():
        torch.nn.init.normal_(p, std=0.02)
    measured = allocated_after_adamw_step(model)
    report = plan(cfg, PlanConfig(gpus=1, gpu_mem_gb=1, batch_size=2))
    assert {k: report["per_gpu_bytes"][k] for k in measured} == measured


def test_qwen3_30b_a3b_by_hand():
    cfg = resolve_config("qwen3-30b-a3b")
    # per layer: q 2048x4096, k and v 2048x512, o 4096x2048, 4 norms, router 128x2048, 128 experts of 3x2048x768
    layer = 2048 * 4096 * 2 + 2048 * 512 * 2 + 2 * 2048 + 2 * 128 + 128 * 2048 + 128 * 3 * 2048 * 768
    total = 48 * layer + 2 * 151936 * 2048 + 2048
    assert total == 30_532_122_624
    tensors = 48 * 11 + 3
    r = plan(cfg, PlanConfig(gpus=8, gpu_mem_gb=141, expert_parallel=8, batch_size=64, seq_len=4096))
    assert r["model"]["params_total"] == total and r["per_gpu_params"]["tensors"] == tensors
    # every dim 0 splits evenly over 8 (experts: 16 whole experts per EP rank, FSDP over 1 rank)
    assert r["per_gpu_params"]["total"] == total // 8
    b = r["per_gpu_bytes"]
    assert b["parameters_fp32"] == b["gradients_fp32"] == 4 * total // 8 == 15_266_061_312
    assert b["optimizer_adamw_fp32"] == 8 * total // 8 + 4 * tensors
    assert r["fits"] and 60e9 < r["total_bytes"] < 141e9

    # 3 GPUs: FSDP2 gives rank 0 ceil(rows / 3) rows of every tensor
    c = lambda rows: math.ceil(rows / 3)  # noqa: E731
    layer3 = (c(4096) * 2048 + 2 * c(512) * 2048 + c(2048) * 4096 + 2 * c(128) + 2 * c(2048) + c(128) * 2048
              + c(128) * 1536 * 2048 + c(128) * 2048 * 768)
    r3 = plan(cfg, PlanConfig(gpus=3, gpu_mem_gb=141, batch_size=3))
    assert r3["per_gpu_params"]["total"] == 48 * layer3 + 2 * c(151936) * 2048 + c(2048)
    # 16 GPUs, EP 8: 16 experts per EP rank, sharded over the 2 ranks holding them: 8 each
    r16 = plan(cfg, PlanConfig(gpus=16, gpu_mem_gb=141, expert_parallel=8, batch_size=16))
    assert r16["per_gpu_params"]["experts"] == 48 * 8 * 3 * 2048 * 768


def test_grpo_adds_rollout_weights_kv_cache_and_reference():
    cfg = resolve_config("qwen3-30b-a3b")
    kw = dict(gpus=8, gpu_mem_gb=141, expert_parallel=8, trainer="grpo", batch_size=16, rollouts=8, seq_len=2048)
    gathered = plan(cfg, PlanConfig(**kw))["per_gpu_bytes"]
    sharded = plan(cfg, PlanConfig(**kw, rollout_weights="sharded"))["per_gpu_bytes"]
    assert gathered["rollout_weights_bf16"] == 2 * 30_532_122_624 and sharded["rollout_weights_bf16"] == 0
    # 16 rollouts per rank x 2048 tokens x (k and v) x 48 layers x 4 kv heads x 128 x 2 bytes
    assert gathered["rollout_kv_cache_bf16"] == 16 * 2048 * 2 * 48 * 4 * 128 * 2
    assert gathered["reference_model_bf16"] == gathered["parameters_fp32"] // 2
    assert gathered["activations_checkpointing"] < gathered["activations_no_checkpointing"]
    # the peak is the larger phase: rollouts hold no gradients or activations, the update no KV cache
    r = plan(cfg, PlanConfig(**kw))
    g = r["per_gpu_bytes"]
    common = (g["parameters_fp32"] + g["optimizer_adamw_fp32"] + g["rollout_weights_bf16"] + g["reference_model_bf16"]
              + g["reserve"])
    assert r["phase_bytes"] == {"rollout": common + g["rollout_kv_cache_bf16"],
                                "update": common + g["gradients_fp32"] + g["fsdp_gathered_bf16"]
                                + g["activations_checkpointing"]}
    assert r["total_bytes"] == max(r["phase_bytes"].values()) < sum(g[k] for k in r["counted"])


@pytest.mark.parametrize("kw, message", [
    (dict(gpus=8, expert_parallel=3), "expert_parallel=3 does not divide world_size=8"),
    (dict(gpus=6, expert_parallel=6, batch_size=6), "expert_parallel=6 does not divide the model's num_experts=128"),
    (dict(gpus=8, batch_size=12), "the global batch of 12 sequences does not split over --gpus 8"),
    (dict(gpus=2, batch_size=6, micro_batch_size=2), "3 sequences per rank do not split into micro-batches"),
    (dict(gpus=2, trainer="ppo"), "--trainer must be one of"),
])
def test_bad_input(kw, message):
    with pytest.raises(ValueError, match=message):
        plan(resolve_config("qwen3-30b-a3b"), PlanConfig(gpu_mem_gb=80, **kw))


def test_cli_table_json_and_error(capsys):
    args = ["--model", "qwen3-30b-a3b", "--gpus", "8", "--gpu_mem_gb", "141", "--expert_parallel", "8"]
    assert main(args + ["--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["per_gpu_params"]["total"] == 30_532_122_624 // 8 and report["fits"] is True
    assert main(args + ["--gpu_mem_gb", "40"]) == 0
    table = capsys.readouterr().out
    assert "parameters_fp32" in table and "does NOT fit in 40.0 GB" in table
    assert main(args + ["--batch_size", "3"]) == 2
    assert "the global batch of 3 sequences does not split over --gpus 8" in capsys.readouterr().err


def test_disaggregated_grpo_plans_the_rollout_fleet_apart():
    """--rollout_gpus: the trainer GPUs hold no KV cache; each rollout GPU holds its TP share of the bf16 weights,
    a staged copy of it, and the KV cache of its replica's share of S steps of rollouts in flight."""
    from livemoe.engine.model.memory import serving_memory

    cfg = resolve_config("qwen3-30b-a3b")
    kw = dict(gpus=8, gpu_mem_gb=141, expert_parallel=8, trainer="grpo", batch_size=16, rollouts=8, seq_len=2048)
    colocated = plan(cfg, PlanConfig(**kw))
    r = plan(cfg, PlanConfig(**kw, rollout_gpus=8, rollout_tensor_parallel=2, max_staleness=2))
    g = r["per_gpu_bytes"]
    assert g["rollout_kv_cache_bf16"] == 0 and g["rollout_weights_bf16"] == 2 * 30_532_122_624  # the pushed copy
    assert r["phase_bytes"]["update"] == colocated["phase_bytes"]["update"]  # the update phase is unchanged
    fleet = r["rollout_fleet"]
    assert fleet["replicas"] == 4 and fleet["sequences_in_flight_per_replica"] == 2 * 16 * 8 // 4
    share = serving_memory(cfg, 2)
    f = fleet["per_gpu_bytes"]
    assert f["weights_bf16"] == f["weight_update_staging_bf16"] == round(share["weights_gb_per_gpu"] * 1e9)
    # 64 sequences x 2048 tokens x (k and v) x 48 layers x 2 of the 4 KV heads x 128 x 2 bytes
    assert f["kv_cache_bf16"] == 64 * 2048 * 2 * 48 * 2 * 128 * 2
    assert fleet["total_bytes"] == sum(f.values()) and fleet["fits"] and r["fits"]
    # S steps of finished rollouts wait on the trainer's host: id, log-prob, mask and k routed experts per MoE layer
    assert r["host_bytes"]["async_buffer_host"] == 2 * 16 * 2048 * (8 + 4 + 4 + 48 * 8)
    small = plan(cfg, PlanConfig(**kw, rollout_gpus=2, rollout_tensor_parallel=2, rollout_gpu_mem_gb=80,
                                 max_staleness=4))
    assert not small["rollout_fleet"]["fits"] and not small["fits"]  # the fleet, not the trainer, is short


def test_async_colocated_rollouts_overlap_the_update():
    """--max_staleness S without rollout GPUs: the rollouts of S steps share the GPUs with the update, so the
    peak is both phases at once, with S steps' KV cache."""
    cfg = resolve_config("qwen3-30b-a3b")
    kw = dict(gpus=8, gpu_mem_gb=141, expert_parallel=8, trainer="grpo", batch_size=16, rollouts=8, seq_len=2048)
    sync, s2 = plan(cfg, PlanConfig(**kw)), plan(cfg, PlanConfig(**kw, max_staleness=2))
    assert s2["per_gpu_bytes"]["rollout_kv_cache_bf16"] == 2 * sync["per_gpu_bytes"]["rollout_kv_cache_bf16"]
    assert list(s2["phases"]) == ["step"] and s2["total_bytes"] == sum(s2["per_gpu_bytes"][k] for k in s2["counted"])
    assert s2["total_bytes"] > sync["total_bytes"]


@pytest.mark.parametrize("kw, message", [
    (dict(rollout_gpus=8), "pass --trainer grpo"),
    (dict(trainer="grpo", rollout_gpus=6, rollout_tensor_parallel=4), "do not split into replicas"),
    (dict(trainer="grpo", rollout_gpus=6, rollout_tensor_parallel=3), "tensor_parallel_size=3 does not divide"),
    (dict(trainer="grpo", rollout_tensor_parallel=2), "needs --rollout_gpus"),
    (dict(trainer="grpo", max_staleness=-1), "must be >= 0"),
])
def test_bad_disaggregated_input(kw, message):
    with pytest.raises(ValueError, match=message):
        plan(resolve_config("qwen3-30b-a3b"), PlanConfig(gpus=8, gpu_mem_gb=141, batch_size=8, **kw))


def test_cli_plans_the_rollout_fleet(capsys):
    args = ["--model", "qwen3-30b-a3b", "--gpus", "8", "--gpu_mem_gb", "141", "--expert_parallel", "8", "--trainer",
            "grpo", "--rollout_gpus", "8", "--rollout_tensor_parallel", "2", "--max_staleness", "1"]
    assert main(args) == 0
    out = capsys.readouterr().out
    assert "per rollout GPU: 8 GPUs, 4 replica(s) of tensor parallel 2" in out and "async_buffer_host" in out
