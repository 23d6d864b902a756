"""Saving, reloading, and every way a checkpoint can be wrong."""
import json
import os

import pytest
import torch
from safetensors.torch import load_file, save_file

from livemoe import engine
from livemoe.engine import CheckpointError
from tiny_models import make_checkpoint, write_config


@pytest.fixture
def moe_ckpt(tmp_path):
    path, hf = make_checkpoint(tmp_path / "src", moe=True, seed=7)
    return path, hf


@pytest.mark.parametrize("layout", ["per_expert", "fused"])
@pytest.mark.parametrize("shard", [None, 40_000])
def test_save_then_transformers_loads_same_logits(tmp_path, moe_ckpt, layout, shard):
    from transformers import AutoModelForCausalLM

    model = engine.load_model(moe_ckpt[0], device="cpu")
    kw = {"max_shard_size": shard} if shard else {}
    out = engine.save_model(model, tmp_path / "out", layout=layout, **kw)
    assert os.path.exists(os.path.join(out, "model.safetensors.index.json")) == bool(shard)
    hf = AutoModelForCausalLM.from_pretrained(out, attn_implementation="eager").eval()
    ids = torch.randint(0, 131, (2, 12))
    with torch.no_grad():
        assert (model(ids) - hf(ids).logits).abs().max().item() <= 1e-4
    reloaded = engine.load_model(out, device="cpu")  # load -> save -> load is lossless
    for (n, a), (m, b) in zip(model.state_dict().items(), reloaded.state_dict().items()):
        assert n == m and torch.equal(a, b), n


def test_save_keeps_dtype_and_tokenizer_files(tmp_path, moe_ckpt):
    src = moe_ckpt[0]
    with open(os.path.join(src, "tokenizer_config.json"), "w") as f:
        json.dump({"model_max_length": 64}, f)
    model = engine.load_model(src, dtype="bfloat16", device="cpu")
    out = engine.save_model(model, tmp_path / "bf16")
    assert json.load(open(os.path.join(out, "config.json")))["dtype"] == "bfloat16"
    assert os.path.exists(os.path.join(out, "tokenizer_config.json"))
    assert engine.load_model(out, device="cpu").lm_head_weight.dtype == torch.bfloat16


def test_a_config_field_changed_before_init_is_saved_as_changed(tmp_path, moe_ckpt):
    # bench_tp cuts a preset's num_hidden_layers before init_model: the saved config.json must say so, or the
    # checkpoint cannot be loaded (the H200 run found it naming layer 4's tensors missing)
    cfg = engine.load_config(moe_ckpt[0])
    assert cfg.num_hidden_layers > 1
    cfg.num_hidden_layers = 1
    out = engine.save_model(engine.init_model(cfg, device="cpu"), tmp_path / "cut")
    assert json.load(open(os.path.join(out, "config.json")))["num_hidden_layers"] == 1
    assert engine.load_model(out, device="cpu").config.num_hidden_layers == 1


def test_save_replaces_existing_dir_whole(tmp_path, moe_ckpt):
    model = engine.load_model(moe_ckpt[0], device="cpu")
    out = tmp_path / "out"
    os.makedirs(out)
    (out / "stale.safetensors").write_text("old")
    engine.save_model(model, out)
    assert not (out / "stale.safetensors").exists()
    assert [p for p in os.listdir(tmp_path) if ".tmp-" in p or ".old-" in p] == []


def _rewrite(path, fn):
    file = os.path.join(path, "model.safetensors")
    state = load_file(file)
    fn(state)
    save_file(state, file, metadata={"format": "pt"})
    return file


def test_missing_tensor_is_named(moe_ckpt):
    path = moe_ckpt[0]
    _rewrite(path, lambda s: s.pop("model.layers.1.self_attn.k_norm.weight"))
    with pytest.raises(CheckpointError, match=r"missing tensors: model\.layers\.1\.self_attn\.k_norm\.weight"):
        engine.load_model(path, device="cpu")


def test_missing_expert_is_named(moe_ckpt):
    path = moe_ckpt[0]
    _rewrite(path, lambda s: s.pop("model.layers.0.mlp.experts.3.up_proj.weight"))
    with pytest.raises(CheckpointError, match=r"model\.layers\.0\.mlp\.experts\.gate_up_proj"):
        engine.load_model(path, device="cpu")


def test_unexpected_tensor_is_named(moe_ckpt):
    path = moe_ckpt[0]
    file = _rewrite(path, lambda s: s.__setitem__("model.layers.0.extra.weight", torch.zeros(2)))
    with pytest.raises(CheckpointError, match=r"model\.safetensors: unexpected tensor 'model\.layers\.0\.extra\.weight'"):
        engine.load_model(path, device="cpu")
    assert file


def test_expert_beyond_config_is_named(moe_ckpt):
    path = moe_ckpt[0]
    _rewrite(path, lambda s: s.__setitem__("model.layers.0.mlp.experts.8.down_proj.weight", torch.zeros(64, 32)))
    with pytest.raises(CheckpointError, match="expert 8 but the config has num_experts=8"):
        engine.load_model(path, device="cpu")


def test_wrong_shape_is_named(moe_ckpt):
    path = moe_ckpt[0]
    _rewrite(path, lambda s: s.__setitem__("model.norm.weight", torch.ones(63)))
    with pytest.raises(CheckpointError, match=r"'model\.norm\.weight' has shape \(63,\), expected \(64,\)"):
        engine.load_model(path, device="cpu")


def test_truncated_file_is_named(moe_ckpt):
    path = moe_ckpt[0]
    file = os.path.join(path, "model.safetensors")
    size = os.path.getsize(file)
    with open(file, "r+b") as f:
        f.truncate(size // 2)
    with pytest.raises(CheckpointError, match="model.safetensors"):
        engine.load_model(path, device="cpu")


def test_garbage_file_is_named(moe_ckpt):
    path = moe_ckpt[0]
    with open(os.path.join(path, "model.safetensors"), "wb") as f:
        f.write(b"\x00not a safetensors file")
    with pytest.raises(CheckpointError, match="unreadable safetensors file"):
        engine.load_model(path, device="cpu")


def test_missing_shard_is_named(tmp_path):
    path, _ = make_checkpoint(tmp_path / "sh", moe=True, max_shard_size="60KB")
    index = json.load(open(os.path.join(path, "model.safetensors.index.json")))
    victim = sorted(set(index["weight_map"].values()))[-1]
    os.remove(os.path.join(path, victim))
    with pytest.raises(CheckpointError, match=victim):
        engine.load_model(path, device="cpu")


def test_no_weights_at_all(tmp_path):
    path = write_config(tmp_path / "c", json.load(open(make_checkpoint(tmp_path / "m")[0] + "/config.json")))
    with pytest.raises(CheckpointError, match="no model.safetensors"):
        engine.load_model(path, device="cpu")


@pytest.mark.parametrize("change,message", [
    ({"model_type": "llama"}, "unknown model_type 'llama'"),
    ({"hidden_size": None}, "missing required field 'hidden_size'"),
    ({"num_experts_per_tok": None}, "missing required field 'num_experts_per_tok'"),
    ({"num_experts_per_tok": 9}, "num_experts_per_tok must be in"),
    ({"num_key_value_heads": 3}, "must be a multiple of num_key_value_heads"),
    ({"rope_parameters": {"rope_type": "yarn", "factor": 4.0}}, "rope type 'yarn' is not supported"),
    ({"mlp_only_layers": [0], "intermediate_size": None}, "dense MLPs but 'intermediate_size'"),
])
def test_bad_config_fields_are_named(tmp_path, moe_ckpt, change, message):
    path = moe_ckpt[0]
    cfg = json.load(open(os.path.join(path, "config.json")))
    cfg.update(change)
    cfg = {k: v for k, v in cfg.items() if v is not None}
    write_config(path, cfg)
    with pytest.raises(CheckpointError, match=message) as e:
        engine.load_model(path, device="cpu")
    assert "config.json" in str(e.value)


def test_not_json_config(tmp_path):
    os.makedirs(tmp_path / "x")
    (tmp_path / "x" / "config.json").write_text("{oops")
    with pytest.raises(CheckpointError, match="not valid JSON"):
        engine.load_model(str(tmp_path / "x"))
    with pytest.raises(CheckpointError, match="no such file"):
        engine.load_model(str(tmp_path / "nowhere"))


def test_bad_dtype_is_rejected(moe_ckpt):
    with pytest.raises(ValueError, match="unknown dtype 'float8'"):
        engine.load_model(moe_ckpt[0], dtype="float8")


def test_init_model_is_random_and_runs():
    cfg = engine.load_config(os.path.join(os.path.dirname(engine.__file__), "model", "presets", "qwen3-30b-a3b.json"))
    small = engine.ModelConfig.from_dict({**cfg.raw, "num_hidden_layers": 1, "hidden_size": 64, "num_experts": 8,
                                          "moe_intermediate_size": 16, "vocab_size": 100, "head_dim": 16})
    model = engine.init_model(small, device="cpu")
    logits = model(torch.randint(0, 100, (1, 5)))
    assert logits.shape == (1, 5, 100) and torch.isfinite(logits).all()


def _sharded(tmp_path):
    path, _ = make_checkpoint(tmp_path / "sh", moe=True, max_shard_size="60KB")
    index_file = os.path.join(path, "model.safetensors.index.json")
    return path, index_file, json.load(open(index_file))


@pytest.mark.parametrize("escape", ["absolute", "dotdot", "symlink"])
def test_shard_paths_leaving_the_directory_are_refused(tmp_path, escape):
    path, index_file, index = _sharded(tmp_path)
    victim = sorted(set(index["weight_map"].values()))[0]
    outside = tmp_path / "outside.safetensors"
    os.rename(os.path.join(path, victim), outside)  # a real shard, so only the path can be wrong
    name = {"absolute": str(outside), "dotdot": "../outside.safetensors", "symlink": victim}[escape]
    if escape == "symlink":
        os.symlink(outside, os.path.join(path, victim))
    index["weight_map"] = {k: (name if v == victim else v) for k, v in index["weight_map"].items()}
    json.dump(index, open(index_file, "w"))
    with pytest.raises(CheckpointError, match=f"shard path '{name}' leaves the checkpoint directory"):
        engine.load_model(path, device="cpu")


def test_a_symlinked_shard_inside_the_directory_still_loads(tmp_path):
    path, index_file, index = _sharded(tmp_path)
    victim = sorted(set(index["weight_map"].values()))[0]
    os.makedirs(os.path.join(path, "blobs"))
    os.rename(os.path.join(path, victim), os.path.join(path, "blobs", "x"))
    os.symlink(os.path.join("blobs", "x"), os.path.join(path, victim))  # as the hub cache lays files out
    assert engine.load_model(path, device="cpu") is not None


@pytest.mark.parametrize("bad", [float("nan"), float("inf")])
def test_nonfinite_weights_are_refused_naming_the_tensor(moe_ckpt, bad):
    path = moe_ckpt[0]

    def poison(s):
        s["model.layers.1.mlp.experts.5.up_proj.weight"][3, 7] = bad
    _rewrite(path, poison)
    with pytest.raises(CheckpointError, match=r"tensor 'model\.layers\.1\.mlp\.experts\.5\.up_proj\.weight' holds NaN or Inf"):
        engine.load_model(path, device="cpu")


def test_nonfinite_model_is_never_saved(tmp_path, moe_ckpt):
    model = engine.load_model(moe_ckpt[0], device="cpu")
    with torch.no_grad():
        model.model.norm.weight[0] = float("nan")
    with pytest.raises(CheckpointError, match=r"parameter 'model\.norm\.weight' holds NaN or Inf"):
        engine.save_model(model, tmp_path / "out")
    assert os.listdir(tmp_path) == ["src"]  # no folder, no temp dir


@pytest.mark.parametrize("umask, dir_mode, file_mode", [(0o022, 0o755, 0o644), (0o027, 0o750, 0o640)])
def test_saved_model_gets_the_umask_permissions(tmp_path, moe_ckpt, umask, dir_mode, file_mode):
    model = engine.load_model(moe_ckpt[0], device="cpu")
    old = os.umask(umask)
    try:
        out = engine.save_model(model, tmp_path / "out", max_shard_size=400_000)
    finally:
        os.umask(old)
    assert os.stat(out).st_mode & 0o777 == dir_mode
    files = os.listdir(out)
    assert "config.json" in files and "model.safetensors.index.json" in files and "model-00003-of-00003.safetensors" in files
    assert {name: os.stat(os.path.join(out, name)).st_mode & 0o777 for name in files} == dict.fromkeys(files, file_mode)
