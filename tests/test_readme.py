"""Every ```python block of README.md runs as written, on the CPU, against the committed student."""
import os
import re
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def python_blocks() -> list:
    with open(os.path.join(ROOT, "README.md"), encoding="utf-8") as f:
        text = f.read()
    return re.findall(r"^```python\n(.*?)^```$", text, flags=re.S | re.M)


def test_the_readme_has_python_examples():
    blocks = python_blocks()
    assert len(blocks) >= 2
    assert all("train/assets/student" in b for b in blocks)  # the committed student, as a clone has it


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
