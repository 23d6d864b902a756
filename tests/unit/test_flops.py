"""FLOPs accounting against the LiveThinking seed's Table 3 and the published parameter counts."""
import json
import os
import subprocess
import sys

import pytest

from livemoe.engine.model import flops
from livemoe.engine.model.flops.__main__ import main

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

# Table 3 (Tblive-E-Commerce QA): D. TFLOPs and TPR -> decode FLOPs per token = D. TFLOPs / TPR.
TABLE3 = {"qwen3-30b-a3b": (2.38, 396), "qwen3-235b-a22b": (17.03, 387), "qwen3-32b": (23.55, 368)}
PUBLISHED_TOTAL = {"qwen3-30b-a3b": 30.5e9, "qwen3-235b-a22b": 235e9, "qwen3-32b": 32.8e9}


@pytest.mark.parametrize("name", sorted(TABLE3))
def test_decode_flops_per_token_reproduce_table3(name):
    tflops, tpr = TABLE3[name]
    cfg = flops.resolve_config(name)
    per_token = flops.decode_flops_per_token(cfg)["matmul"]
    assert abs(per_token / (tflops * 1e12 / tpr) - 1) < 0.03
    assert abs(flops.decode_flops(cfg, tpr) / 1e12 / tflops - 1) < 0.03


@pytest.mark.parametrize("name", sorted(PUBLISHED_TOTAL))
def test_total_params_match_published(name):
    counts = flops.param_counts(flops.resolve_config(name))
    assert abs(counts["total"] / PUBLISHED_TOTAL[name] - 1) < 0.01
    assert counts["active"] <= counts["total"]


def test_attention_and_prefill_terms():
    cfg = flops.resolve_config("qwen3-30b-a3b")
    d0, d1k = flops.decode_flops_per_token(cfg, 0), flops.decode_flops_per_token(cfg, 1024)
    assert d1k["matmul"] == d0["matmul"]
    assert d1k["attention"] == 4 * 48 * 32 * 128 * 1024
    p = flops.prefill_flops(cfg, 8)
    assert p["matmul"] == 8 * d0["matmul"] and p["attention"] == 4 * 48 * 32 * 128 * 36
    # decode with attention: token i sees prompt + i keys
    assert flops.decode_flops(cfg, 2, prompt_len=10) == 2 * d0["matmul"] + 4 * 48 * 32 * 128 * (11 + 12)


def test_cli_prints_json(capsys, tmp_path):
    assert main(["qwen3-30b-a3b", "--context", "4096", "--prompt", "100", "--tokens", "153"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["params_total"] == 30532122624
    assert out["decode_flops_per_token"]["attention"] > 0 and out["prefill_flops"]["total"] > 0
    assert abs(out["decode_tflops_per_response"] - 0.92) < 0.03  # LiveThinking's 153-token responses
    assert main([str(tmp_path / "missing.json")]) == 2
    assert "no such file" in capsys.readouterr().err


def test_cli_without_prompt_has_no_prefill_and_unknown_preset_lists_the_presets(capsys):
    assert main(["qwen3-32b"]) == 0
    assert "prefill_flops" not in json.loads(capsys.readouterr().out)  # only with --prompt, as docs/decoder.md says
    assert main(["qwen3-99b"]) == 2
    err = capsys.readouterr().err
    assert "qwen3-99b" in err and all(name in err for name in flops.preset_names())


def test_python_m_engine_flops_runs_without_a_warning():
    # `import livemoe.engine` imports livemoe.engine.model.flops; running it as __main__ used to make runpy warn on every run
    env = {**os.environ, "PYTHONPATH": ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""), "PYTHONWARNINGS": "default"}
    res = subprocess.run([sys.executable, "-m", "livemoe.engine.model.flops", "qwen3-30b-a3b", "--prompt", "8"], cwd=ROOT, env=env,
                         capture_output=True, text=True, timeout=120)
    assert res.returncode == 0, res.stderr
    assert res.stderr == ""
    assert json.loads(res.stdout)["prefill_flops"]["total"] > 0
