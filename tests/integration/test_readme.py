"""Every ```python block of README.md runs as written, on the CPU, against the committed student."""
import os
import re
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def python_blocks() -> list:
    with open(os.path.join(ROOT, "README.md"), encoding="utf-8") as f:
        text = f.read()
    return re.findall(r"^```python\n(.*?)^```$", text, flags=re.S | re.M)


def test_the_readme_has_python_examples():
    blocks = python_blocks()
    assert len(blocks) >= 2
    assert all("livemoe/train/assets/student" in b for b in blocks)  # the committed student, as a clone has it


@pytest.mark.parametrize("index", range(len(python_blocks())))
def test_readme_python_block_runs(index, tmp_path):
    code = python_blocks()[index]
    # the repository's layout under a scratch directory, so relative paths work as from a clone's root
    # and whatever a block writes (out/...) lands outside the repository
    for name in os.listdir(ROOT):
        if not name.startswith("."):
            os.symlink(os.path.join(ROOT, name), tmp_path / name)
    env = {**os.environ, "PYTHONPATH": ROOT, "CUDA_VISIBLE_DEVICES": "", "OMP_NUM_THREADS": "1"}
    res = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, env=env, capture_output=True, text=True,
                         timeout=300)
    assert res.returncode == 0, f"README block {index} failed:\n{code}\n{res.stderr[-3000:]}"


def test_many_gpu_commands_use_real_options(capsys):
    """The "Training on many GPUs" section's commands: every flag of a livemoe.train.rft / livemoe.train.grpo command is one of
    that trainer's options, and the planner command runs and prints the figures the section quotes."""
    from livemoe.train.config import RFTConfig, build_parser
    from livemoe.train.grpo import GRPOConfig
    from livemoe.train.plan import main as plan_main

    with open(os.path.join(ROOT, "README.md"), encoding="utf-8") as f:
        text = f.read()
    section = text.split("## Training on many GPUs", 1)[1].split("\n## ", 1)[0]
    lines = [ln.split("#")[0].strip() for b in re.findall(r"^```bash\n(.*?)^```$", section, flags=re.S | re.M)
             for ln in b.splitlines()]
    trainers = {"livemoe.train.rft": RFTConfig, "livemoe.train.grpo": GRPOConfig}
    checked = []
    for line in filter(None, lines):
        words = line.split()
        if words[0] == "livemoe":
            assert words[1] == "plan", line
            module = "livemoe plan"
            assert plan_main(words[2:]) == 0
            out = capsys.readouterr().out
            assert "rollout 131.38, update 136.65" in out and "136.65  fits in 141.0 GB" in out
            assert "rollouts 131.4 GB, update 136.7 GB, which fits in 141 GB" in " ".join(section.split())
        else:
            assert words[0] == "torchrun", line
            module = words[words.index("-m") + 1]
            flags = [w for w in words[words.index("-m") + 2:] if w.startswith("--")]
            known = {s for a in build_parser(trainers[module])._actions for s in a.option_strings}
            assert set(flags) <= known, (line, set(flags) - known)
            assert "--expert_parallel" in flags
        checked.append(module)
    assert sorted(set(checked)) == ["livemoe plan", "livemoe.train.grpo", "livemoe.train.rft"]
