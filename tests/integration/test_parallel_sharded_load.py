"""Trainer ranks reading only their shards (livemoe/train/parallel/sharded_load.py), on gloo ranks:

- the sharded model holds exactly load_model(path)'s weights (gathered back whole and compared with ==, the same
  bytes read from the same file), on 4 ranks with expert parallel 2, rows that do not divide and an empty shard;
- peak host memory per rank falls with the ranks: the rise of each rank's peak RSS over the load (VmHWM, reset to
  the current RSS just before it through /proc/self/clear_refs, after a warm-up load of a tiny checkpoint, so the
  imports', the process group's and DTensor's one-off memory is not counted) at 4 ranks is below half of one process's load_model, and at 2 ranks below one process's. The model
  (~100 MB of fp32 weights) is large enough that its weights dominate the rise and small enough for CI.
"""
import os
import re

import pytest
import torch

from spawn_ranks import spawn_ranks

from livemoe.engine.model.config import ModelConfig
from livemoe.engine.model.loader import init_model, load_model
from livemoe.engine.model.saver import save_model

SMALL = dict(model_type="qwen3_moe", vocab_size=61, hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
             num_key_value_heads=2, head_dim=16, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=24,
             norm_topk_prob=True, tie_word_embeddings=False, max_position_embeddings=128)
# 4 layers x 16 experts x 3 x 384 x 384 x 4 B = 113 MB of expert weights (the rest ~2 MB)
LARGE = dict(SMALL, hidden_size=384, num_attention_heads=4, head_dim=32, num_hidden_layers=4, num_experts=16,
             moe_intermediate_size=384)


def write(path, cfg: dict, seed: int = 0) -> str:
    save_model(init_model(ModelConfig.from_dict(cfg), seed=seed), str(path))
    return str(path)


def status_kib(key: str) -> int:
    with open("/proc/self/status") as f:
        return int(re.search(rf"{key}:\s+(\d+)", f.read()).group(1))


def equal_worker(path: str, expert_parallel: int) -> list[str]:
    """The names of the parameters whose gathered sharded weights differ from load_model's (none expected)."""
    from livemoe.train.distributed import setup

    d = setup(expert_parallel, backend="gloo", timeout_s=60)
    model = d.load_sharded(path, torch.float32, bf16=False)
    ref = dict(load_model(path, dtype=torch.float32, device="cpu").named_parameters())
    gathered = dict(d.full_tensors(model))
    assert gathered.keys() == ref.keys()
    return [n for n, t in gathered.items() if not torch.equal(t, ref[n])]


def rss_worker(path: str, warm_up: str) -> int:
    """KiB the load adds to this rank's peak RSS, after a load of a tiny checkpoint (`warm_up`) has paid the one-off
    costs (lazy imports, DTensor's dispatch caches) that are no part of the weights."""
    from livemoe.train.distributed import setup

    world = int(os.environ["WORLD_SIZE"])
    d = setup(1, backend="gloo", timeout_s=60) if world > 1 else None
    load = (lambda p: d.load_sharded(p, torch.float32, bf16=False)) if d else (lambda p: load_model(p, dtype=torch.float32))
    load(warm_up)
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")  # VmHWM := VmRSS now
    before = status_kib("VmRSS")
    model = load(path)
    rise = status_kib("VmHWM") - before
    del model
    return rise


def test_sharded_load_holds_load_models_weights(tmp_path):
    """4 ranks, expert parallel 2, a tied embedding; 6 experts: each EP rank's 3 split 2 + 1 over its 2 FSDP ranks,
    the router's 6 rows 2, 2, 2, 0 over the 4 (a rank with an empty shard), the vocab's 61 rows 16, 16, 16, 13."""
    path = write(tmp_path / "ckpt", dict(SMALL, tie_word_embeddings=True, num_experts=6))
    assert spawn_ranks(equal_worker, 4, path, 2, timeout=180) == [[]] * 4


@pytest.mark.slow
def test_peak_memory_per_rank_falls_with_the_ranks(tmp_path):
    path, small = write(tmp_path / "large", LARGE), write(tmp_path / "small", SMALL)
    weights_kib = os.path.getsize(os.path.join(path, "model.safetensors")) / 1024
    rise = {n: max(spawn_ranks(rss_worker, n, path, small, timeout=240)) for n in (1, 2, 4)}
    print({n: f"{kib / 1024:.0f} MiB" for n, kib in rise.items()}, f"weights {weights_kib / 1024:.0f} MiB")
    assert rise[1] > 0.9 * weights_kib  # one process holds the whole model: the weights dominate its rise
    assert rise[2] < rise[1]
    assert rise[4] < rise[1] / 2
