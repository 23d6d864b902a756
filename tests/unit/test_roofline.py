"""The roofline model (bench/roofline.py): byte and FLOP counts against cases worked by hand."""
import pytest

from bench import roofline as rl

H, I, E, K = 2048, 768, 128, 8  # Qwen3-30B-A3B's MoE layer


def test_batch1_moe_layer_reads_eight_experts_once():
    parts = rl.moe_decode_layer_bytes(H, I, E, K)
    assert parts["experts"] == 8 * 3 * 2048 * 768 * 2 == 75_497_472
    assert parts["router"] == 128 * 2048 * 2
    # 75.5 MB at the 4.3 TB/s a copy reaches: the 17.6 us floor of the MoE target (<= 25 us)
    assert parts["experts"] / rl.H200_COPY_BPS * 1e6 == pytest.approx(17.56, abs=0.01)
    # activations: x and the combine's [T, H] rows, act [k, I] out and in, y [k, H] out and in, ids, weights
    assert 0 < parts["activations"] < 200_000


def test_moe_forward_counts_by_hand():
    ops = rl.moe_forward(1, H, I, E, K, block_m=16)
    assert rl.touched_experts(1, E, K) == pytest.approx(8)
    assert ops["gate_up"].flops == 2 * 8 * 2048 * 2 * 768
    assert ops["gate_up"].bytes == pytest.approx(2048 * 2 + 8 * 2 * 768 * 2048 * 2 + 8 * 768 * 2)
    assert ops["down"].flops == 2 * 8 * 768 * 2048
    assert ops["down"].bytes == pytest.approx(8 * 768 * 2 + 8 * 2048 * 768 * 2 + 8 * 4 + 8 * 2048 * 2)
    assert ops["router"] == rl.Cost(2048 * 2 + 128 * 2048 * 2 + 128 * 2, 2 * 128 * 2048)
    # many tokens touch every expert: weights once each, however many align blocks
    assert rl.touched_experts(4096, E, K) == pytest.approx(128)
    assert rl.moe_forward(4096, H, I, E, K, 64)["gate_up"].bytes == pytest.approx(
        4096 * 2048 * 2 + 128 * 2 * 768 * 2048 * 2 + 4096 * 8 * 768 * 2)


def test_expert_gradients_write_every_expert():
    dw = rl.moe_backward(1, H, I, E, K, block_n=32)
    assert dw["dW_gate_up"].bytes == pytest.approx(8 * 1536 * 2 + 2048 * 2 + 128 * 1536 * 2048 * 2)
    assert dw["dW_down"].flops == 2 * 8 * 2048 * 768


def test_logprobs_is_compute_bound_at_training_shapes():
    fwd = rl.logprobs_forward(8192, 151_936, 2048)
    assert fwd.flops == 2 * 8192 * 151_936 * 2048
    assert fwd.bytes == 8192 * 2048 * 2 + 151_936 * 2048 * 2 + 8192 * 8 + 4 * 8192 * 4
    assert fwd.bound() == "compute"
    assert rl.predict_s(fwd) == pytest.approx(fwd.flops / 989e12)
    bwd = rl.logprobs_pass(8192, 151_936, 2048, "bwd")
    assert bwd.flops == 3 * fwd.flops  # d logits recomputed, then dW and dh
    assert rl.logprobs_pass(8192, 151_936, 2048, "fwd+bwd") == fwd + bwd


def test_attention_counts_by_hand():
    dec = rl.paged_decode(1, 4096, 32, 4, 128, 16)
    assert dec.bytes == 2 * 4096 * 4 * 128 * 2 + 2 * 32 * 128 * 2 + 256 * 4
    assert dec.flops == 4 * 32 * 4096 * 128
    assert dec.bound() == "memory"
    assert rl.predict_s(dec) == pytest.approx(dec.bytes / 4.3e12)
    # 4 new tokens, no prefix, one head of width 1: they see 1 + 2 + 3 + 4 positions
    pre = rl.paged_prefill(1, 0, 4, 1, 1, 1)
    assert pre == rl.Cost(2 * 4 * 2 + 2 * 4 * 2, 4 * 10)


def test_cost_time_is_the_slower_of_bytes_and_flops():
    c = rl.Cost(4.3e12, 989e12 / 2)
    assert c.time_s() == pytest.approx(1.0) and c.bound() == "memory"
    assert c.time_s(rl.H200_PEAK_BPS) == pytest.approx(4.3 / 4.8)


def test_decode_step_at_batch_one_reads_the_active_weights_and_kv():
    from livemoe.engine.model.flops import param_counts, resolve_config

    cfg = resolve_config("qwen3-30b-a3b")
    c = param_counts(cfg)
    kv = 1024 * cfg.num_hidden_layers * 2 * cfg.num_key_value_heads * cfg.head_dim
    step = rl.decode_step(cfg, 1, 1024)
    assert step.bytes == pytest.approx((c["active_matmul"] + kv) * 2)
    assert step.bound() == "memory"
