"""Block-size configs (livemoe/kernels/moe/configs.py): the heuristic, the per-GPU JSON cache, and tuning."""
import json

import pytest
import torch
from test_moe_triton import DEVICE, triton_here

from livemoe.kernels.moe import configs
from livemoe.kernels.moe.configs import MoEConfig


@pytest.fixture
def cache(tmp_path, monkeypatch):
    path = tmp_path / "moe.json"
    monkeypatch.setenv("LIVEMOE_MOE_CONFIG", str(path))
    configs._LOADED.clear()
    yield path
    configs._LOADED.clear()


@pytest.mark.parametrize("T", [1, 7, 16, 64, 512, 4096, 65536])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_heuristic_is_valid_everywhere(T, dtype):
    cfg = configs.heuristic_config(T, 128, 2048, 768, 8, dtype)
    assert cfg.block_m in (16, 32, 64, 128)
    if T <= 16:  # decode: one block per touched expert
        assert cfg.block_m == 16


def test_bad_config_is_a_value_error():
    with pytest.raises(ValueError, match="block_n"):
        MoEConfig(16, 48, 32)


def test_untuned_gpu_gets_the_heuristic(cache):
    got = configs.get_config(64, 128, 2048, 768, 8, torch.bfloat16, gpu="Some Untuned GPU")
    assert got == configs.heuristic_config(64, 128, 2048, 768, 8, torch.bfloat16)


def test_saved_config_is_reloaded_per_gpu_name(cache):
    cfg = MoEConfig(32, 128, 64, group_m=4, num_warps=8, num_stages=2)
    key = configs.bucket_key(60, 128, 2048, 768, 8, torch.bfloat16)
    assert key == configs.bucket_key(64, 128, 2048, 768, 8, torch.bfloat16)  # same power-of-two bucket
    configs.save_config(key, cfg, gpu="GPU A")
    configs._LOADED.clear()  # a fresh process
    assert json.loads(cache.read_text())["GPU A"][key]["block_n"] == 128
    assert configs.get_config(64, 128, 2048, 768, 8, torch.bfloat16, gpu="GPU A") == cfg
    assert configs.get_config(64, 128, 2048, 768, 8, torch.bfloat16, gpu="GPU B") != cfg


def test_broken_cache_falls_back_to_the_heuristic(cache):
    cache.write_text("{not json")
    assert configs.get_config(8, 16, 64, 32, 2, torch.float16) == configs.heuristic_config(8, 16, 64, 32, 2,
                                                                                          torch.float16)
    configs._LOADED.clear()
    key = configs.bucket_key(8, 16, 64, 32, 2, torch.float16)
    cache.write_text(json.dumps({configs.device_name(): {key: {"block_m": 17, "block_n": 64, "block_k": 32}}}))
    assert configs.get_config(8, 16, 64, 32, 2, torch.float16).block_m == 16


def test_tune_picks_the_fastest_runnable_candidate_and_saves_it(cache):
    cands = [MoEConfig(16, 32, 32), MoEConfig(16, 64, 32), MoEConfig(32, 64, 32)]
    cost = {cands[0]: 3.0, cands[1]: 1.0}  # cands[2] "fails to compile"

    def run(cfg):
        if cfg not in cost:
            raise RuntimeError("out of shared memory")
        return cost[cfg]

    best = configs.tune(run, 8, 16, 64, 32, 2, torch.float16, candidates=cands, timer=lambda fn: fn())
    assert best == cands[1]
    configs._LOADED.clear()
    assert configs.get_config(8, 16, 64, 32, 2, torch.float16) == cands[1]


@triton_here
def test_tune_runs_the_real_kernels(cache):
    # the run function fused_moe's autotune uses, on the interpreter (or the GPU), with a wall-clock timer
    import time

    from livemoe.kernels.moe.triton_moe import experts_forward

    x, w1, w2 = (t.to(DEVICE) for t in (torch.randn(4, 32), torch.randn(3, 32, 32) * 0.1, torch.randn(3, 32, 16) * 0.1))
    topk_w, topk_ids = torch.rand(4, 2, device=DEVICE), torch.tensor([[0, 1], [1, 2], [2, 0], [0, 2]], device=DEVICE)

    def timer(fn):
        t0 = time.perf_counter()
        fn()
        return time.perf_counter() - t0

    run = lambda cfg: experts_forward(x, w1, w2, topk_w, topk_ids, cfg, save_preact=False)  # noqa: E731
    best = configs.tune(run, 4, 3, 32, 16, 2, torch.float32, candidates=[MoEConfig(16, 32, 32)], timer=timer)
    assert best == MoEConfig(16, 32, 32)
