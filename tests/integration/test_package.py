"""One import package: livemoe lives beside Hugging Face's `kernels` and transformers (which imports it from 5.25
on), installs no other top-level name, and its commands answer as documented: `livemoe SUBCOMMAND`,
`python -m livemoe SUBCOMMAND`, `python -m livemoe.train.rft`, and the checkout's `python -m train.rft`."""
import importlib.util
import os
import subprocess
import sys
import tomllib

import pytest

import livemoe
from livemoe.cli import COMMANDS

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def run_python(*args, cwd=ROOT, timeout=180):
    """A fresh interpreter started in `cwd`, so that cwd is on sys.path as it is for `python -m train.rft`."""
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    return subprocess.run([sys.executable, *args], cwd=cwd, env={**env, "CUDA_VISIBLE_DEVICES": ""},
                          capture_output=True, text=True, timeout=timeout)


def test_hf_kernels_transformers_moe_and_livemoe_in_one_process_from_the_checkout_root():
    code = """
import importlib.metadata, os, sys
import kernels, transformers
from transformers import AutoModelForCausalLM, Qwen3MoeConfig, Qwen3MoeForCausalLM
import livemoe.engine
root = os.path.abspath(os.getcwd())
assert root in [os.path.abspath(p or os.curdir) for p in sys.path], sys.path  # the shadowing configuration
# the `kernels` that Hugging Face's distribution installed, not a folder of ours
installed = importlib.metadata.distribution("kernels").locate_file("kernels/__init__.py")
assert os.path.samefile(kernels.__file__, installed), (kernels.__file__, installed)
assert not os.path.exists(os.path.join(root, "kernels"))
cfg = Qwen3MoeConfig(vocab_size=64, hidden_size=32, intermediate_size=32, moe_intermediate_size=16,
                     num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=1, head_dim=16,
                     num_experts=4, num_experts_per_tok=2)
hf = AutoModelForCausalLM.from_config(cfg)
assert isinstance(hf, Qwen3MoeForCausalLM)
print("ok", kernels.__file__, transformers.__version__)
"""
    res = run_python("-c", code)
    assert res.returncode == 0, res.stderr[-3000:]
    assert res.stdout.startswith("ok "), res.stdout


def test_pip_installs_one_top_level_name_and_the_data_the_defaults_read():
    with open(os.path.join(ROOT, "pyproject.toml"), "rb") as f:
        project = tomllib.load(f)
    setuptools = project["tool"]["setuptools"]
    assert setuptools["packages"]["find"] == {"include": ["livemoe*"], "namespaces": False}
    from setuptools import find_packages

    packages = find_packages(ROOT, include=setuptools["packages"]["find"]["include"])
    assert not any(".results" in p or ".assets" in p for p in packages), packages  # results/ is not shipped
    assert "livemoe.engine" in packages and "livemoe.kernels.moe" in packages and "livemoe.train.live" in packages
    assert {p.split(".")[0] for p in packages} == {"livemoe"}
    assert project["project"]["scripts"] == {"livemoe": "livemoe.cli:main"}
    # what the installed defaults read: the student of `livemoe rft` and the FLOPs presets
    from livemoe.engine.model.flops import PRESET_DIR
    from livemoe.train.config import DEFAULT_STUDENT

    data = setuptools["package-data"]
    assert os.path.isfile(os.path.join(DEFAULT_STUDENT, "model.safetensors"))
    assert DEFAULT_STUDENT == os.path.join(ROOT, "livemoe", "train", "assets", "student")
    assert "assets/student/*" in data["livemoe.train"]
    assert PRESET_DIR == os.path.join(ROOT, "livemoe", "engine", "model", "presets") and "presets/*.json" in data["livemoe.engine.model"]
    with open(os.path.join(ROOT, "setup.py")) as f:
        assert '"livemoe._C"' in f.read()


def test_the_checkout_root_has_no_generic_package_but_the_thin_train_entry_points():
    roots = {n for n in os.listdir(ROOT) if os.path.isfile(os.path.join(ROOT, n, "__init__.py"))}
    # bench: `python -m bench.static_gpu`, experiments: `python -m experiments`; neither is installed
    assert roots == {"livemoe", "train", "bench", "experiments"}, roots
    shims = sorted(n for n in os.listdir(os.path.join(ROOT, "train")) if n.endswith(".py") and n != "__init__.py")
    assert shims == ["experiments.py", "grpo.py", "live.py", "rft.py"]
    for name in shims:
        with open(os.path.join(ROOT, "train", name)) as f:
            body = f.read()
        # experiments are not a subcommand (not installed): its entry runs the root experiments/ package
        runs = "from experiments.__main__ import main" if name == "experiments.py" else \
            f'checkout_entry_point(__name__, "{name[:-3]}")'
        assert runs in body and len(body.splitlines()) <= 7, body
    assert not importlib.util.find_spec("train.rft").origin.startswith(os.path.join(ROOT, "livemoe"))


@pytest.mark.parametrize("name", sorted(COMMANDS))
def test_every_subcommand_answers_help_the_same_three_ways(name):
    """`python -m livemoe NAME --help`, `python -m MODULE --help` and (for the trainers) the checkout's
    `python -m train.NAME --help` print the same text: one parser behind each command, named `livemoe NAME`."""
    via_cli = run_python("-m", "livemoe", name, "--help")
    assert via_cli.returncode == 0, via_cli.stderr[-2000:]
    assert via_cli.stdout.startswith(f"usage: livemoe {name}"), via_cli.stdout[:200]
    if name in ("rft", "serve"):  # cli.run calls the module's own main: one module of each half shows it
        via_module = run_python("-m", COMMANDS[name][0].removesuffix(".__main__"), "--help")
        assert via_module.returncode == 0 and via_module.stdout == via_cli.stdout, via_module.stderr[-2000:]
    if os.path.isfile(os.path.join(ROOT, "train", f"{name}.py")):
        via_checkout = run_python("-m", f"train.{name}", "--help")
        assert via_checkout.returncode == 0 and via_checkout.stdout == via_cli.stdout, via_checkout.stderr[-2000:]


@pytest.mark.parametrize("module", ["experiments", "train.experiments"])
def test_the_checkouts_experiments_answer_help_under_the_name_they_were_run_by(module):
    res = run_python("-m", module, "--help")
    assert res.returncode == 0, res.stderr[-2000:]
    assert res.stdout.startswith(f"usage: python -m {module} ") and "length_sweep" in res.stdout, res.stdout[:300]


def test_the_cli_lists_its_subcommands_and_refuses_an_unknown_one():
    res = run_python("-m", "livemoe", "--help")
    assert res.returncode == 0
    for name in ("serve", "rft", "grpo", "live", "flops", "plan"):
        assert f"\n  {name} " in res.stdout, res.stdout
    bad = run_python("-m", "livemoe", "trian")
    assert bad.returncode == 2 and "unknown subcommand 'trian'" in bad.stderr and "usage:" in bad.stderr
    assert bad.stdout == ""


def test_the_public_api_from_the_top_is_the_engines_own_and_costs_no_torch_import():
    from livemoe import (LLM, AsyncLLM, LiveSession, SamplingParams, StructuredOutput, load_model, load_tokenizer,
                         save_model)
    from livemoe.engine import LLM as engine_llm
    from livemoe.engine.model import loader
    from livemoe.engine.sampling.structured import StructuredOutput as structured

    assert LLM is engine_llm and StructuredOutput is structured and load_model is loader.load_model
    assert {AsyncLLM, LiveSession, SamplingParams, load_tokenizer, save_model} <= set(
        getattr(livemoe, n) for n in livemoe.__all__)
    with pytest.raises(AttributeError, match="no attribute 'nope'"):
        livemoe.nope  # noqa: B018
    res = run_python("-c", "import sys, livemoe; assert 'torch' not in sys.modules, 'torch imported'; print('ok')")
    assert res.returncode == 0 and res.stdout == "ok\n", res.stderr
