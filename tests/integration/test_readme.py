"""README.md and docs/*.md: every ```python block runs as written, on the CPU, against the committed student (a
client block against the `livemoe serve` command its page gives just before it, which serves the committed
student); every relative link resolves; the commands and figures some sections quote are the code's."""
import os
import re
import subprocess
import sys
import time
import urllib.request

import pytest
from docs_text import ROOT, anchor, blocks, doc_files, headings, outside_code, read, section

STUDENT = "livemoe/train/assets/student"  # the committed student, as a clone has it
SERVER = "127.0.0.1:8000"  # where a client block expects the server its page starts


def python_blocks() -> list[tuple[str, int, str]]:
    """(file, index in the file, code) of every ```python block of README.md and docs/*.md."""
    return [(path, i, code) for path in doc_files() for i, code in enumerate(blocks(read(path), "python"))]


def serve_command(path: str, code: str) -> list[str]:
    """The words of the `livemoe serve` line of the last ```bash block before `code` on its page."""
    text = read(path)
    before = text[:text.index(code)]
    lines = [ln.split("#")[0].split() for b in blocks(before, "bash")[-1:] for ln in b.splitlines()]
    serve = [words for words in lines if words[:2] == ["livemoe", "serve"]]
    assert len(serve) == 1, f"{path}: a client block needs one `livemoe serve` line in the ```bash block before it"
    return serve[0]


def test_the_docs_have_python_examples():
    found = python_blocks()
    assert len([b for b in found if b[0] == "README.md"]) >= 2
    assert {path for path, _, _ in found} >= {"README.md", "docs/decoder.md", "docs/serving.md", "docs/live.md"}
    for path, i, code in found:
        if SERVER in code:  # a client: the server it talks to serves the committed student
            words = serve_command(path, code)
            assert words[words.index("--model") + 1] == STUDENT, (path, i, words)
        else:
            assert STUDENT in code, (path, i)


def wait_healthy(url: str, proc: subprocess.Popen, log: str, within_s: float = 180.0) -> None:
    deadline = time.monotonic() + within_s
    while time.monotonic() < deadline:
        assert proc.poll() is None, f"the server exited with {proc.returncode}:\n{open(log).read()[-3000:]}"
        try:
            with urllib.request.urlopen(url + "/health", timeout=5) as r:
                if r.status == 200:
                    return
        except OSError:
            pass
        time.sleep(0.5)
    raise AssertionError(f"the server was not healthy within {within_s} s:\n{open(log).read()[-3000:]}")


@pytest.mark.parametrize("path,index", [(p, i) for p, i, _ in python_blocks()],
                         ids=[f"{p}-{i}" for p, i, _ in python_blocks()])
def test_python_block_runs(path, index, tmp_path):
    code = blocks(read(path), "python")[index]
    # the repository's layout under a scratch directory, so relative paths work as from a clone's root
    # and whatever a block writes (out/...) lands outside the repository
    for name in os.listdir(ROOT):
        if not name.startswith("."):
            os.symlink(os.path.join(ROOT, name), tmp_path / name)
    env = {**os.environ, "PYTHONPATH": ROOT, "CUDA_VISIBLE_DEVICES": "", "OMP_NUM_THREADS": "1"}
    server = None
    if SERVER in code:
        pytest.importorskip("openai", reason="the client example needs the openai package (pip install -e .[test])")
        from livemoe.engine.net import free_port

        # the page's own serve command (`python -m livemoe serve` is the `livemoe serve` script), on a free port
        port = free_port()
        log = str(tmp_path / "server.log")
        with open(log, "w") as out:
            server = subprocess.Popen([sys.executable, "-m", "livemoe", *serve_command(path, code)[1:],
                                       "--port", str(port)], cwd=tmp_path, env=env, stdout=out,
                                      stderr=subprocess.STDOUT)
        code = code.replace(SERVER, f"127.0.0.1:{port}")
    try:
        if server is not None:
            wait_healthy(f"http://127.0.0.1:{port}", server, log)
        res = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, env=env, capture_output=True, text=True,
                             timeout=300)
        assert res.returncode == 0, f"{path} block {index} failed:\n{code}\n{res.stderr[-3000:]}"
    finally:
        if server is not None:
            server.terminate()  # SIGTERM: the server stops its engine core
            try:
                server.wait(timeout=60)
            except subprocess.TimeoutExpired:
                server.kill()
                server.wait()


def test_relative_links_resolve():
    """Every relative link of README.md and docs/*.md names a file or folder that exists, and an anchor a heading
    of its page (docs/ links a repository path as ../path)."""
    checked = 0
    for path in doc_files():
        for target in re.findall(r"\]\(([^)\s]+)\)", outside_code(read(path))):
            if re.match(r"[a-z]+:", target):  # https:, mailto:
                continue
            file, _, frag = target.partition("#")
            dest = os.path.normpath(os.path.join(os.path.dirname(path), file)) if file else path
            assert not dest.startswith(".."), (path, target)
            assert os.path.exists(os.path.join(ROOT, dest)), f"{path}: {target} does not exist"
            if frag:
                assert frag in {anchor(t) for _, t, _ in headings(read(dest))}, f"{path}: no heading for {target}"
            checked += 1
    assert checked >= 20


def check_command(line: str, capsys) -> str:
    """One documented command line: every flag of a trainer command is one of that trainer's options, and a
    `livemoe plan` command runs. Returns the module (or "livemoe plan")."""
    from livemoe.train.config import build_parser
    from livemoe.train.grpo.config import GRPOConfig
    from livemoe.train.live.config import LiveConfig
    from livemoe.train.rft.config import RFTConfig
    from livemoe.train.plan import main as plan_main

    trainers = {"livemoe.train.rft": RFTConfig, "livemoe.train.grpo": GRPOConfig, "livemoe.train.live": LiveConfig}
    words = line.split()
    if words[0] == "livemoe":
        assert words[1] == "plan", line
        assert plan_main(words[2:]) == 0
        return "livemoe plan"
    if words[0] == "torchrun":
        module = words[words.index("-m") + 1]
    else:
        assert words[:2] == ["python", "-m"] and words[2].startswith("train."), line
        module = "livemoe." + words[2]  # the checkout's train.X runs livemoe.train.X
    flags = [w for w in words[words.index("-m") + 2:] if w.startswith("--")]
    known = {s for a in build_parser(trainers[module])._actions for s in a.option_strings}
    assert set(flags) <= known, (line, set(flags) - known)
    return module


def bash_lines(text: str) -> list[str]:
    return list(filter(None, (ln.split("#")[0].strip() for b in blocks(text, "bash") for ln in b.splitlines())))


def test_many_gpu_commands_use_real_options(capsys):
    """The "Training on many GPUs" section's commands (docs/training.md): every flag of a livemoe.train.rft /
    livemoe.train.grpo command is one of that trainer's options, and the planner command runs and prints the
    figures the section quotes."""
    _, text = section("Training on many GPUs")
    checked = []
    for line in bash_lines(text):
        module = check_command(line, capsys)
        if module == "livemoe plan" and "--rollout_gpus" in line.split():  # disaggregated: the rollout GPUs' table
            out = capsys.readouterr().out
            assert "update 136.65" in out and "77.97  fits in 141.0 GB" in out
            assert "each of the 8 rollout GPUs 78.0 GB" in " ".join(text.split())
        elif module == "livemoe plan":
            out = capsys.readouterr().out
            assert "rollout 131.38, update 136.65" in out and "136.65  fits in 141.0 GB" in out
            assert "rollouts 131.4 GB, update 136.7 GB, which fits in 141 GB" in " ".join(text.split())
        else:
            assert line.split()[0] == "torchrun", line
            assert "--expert_parallel" in line.split()
        checked.append(module)
    assert sorted(set(checked)) == ["livemoe plan", "livemoe.train.grpo", "livemoe.train.rft"]


def test_training_commands_use_real_options(capsys):
    """The README's "Training" commands and docs/training.md's "In one process" ones: real options of each
    trainer (and a planner command that runs)."""
    checked = []
    for title in ("Training", "In one process"):
        _, text = section(title)
        checked += [check_command(line, capsys) for line in bash_lines(text)]
    assert {"livemoe.train.rft", "livemoe.train.grpo", "livemoe.train.live", "livemoe plan"} <= set(checked)
