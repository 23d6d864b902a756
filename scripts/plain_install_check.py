"""CI's plain-install check (`make plain-install`): run by the python of a fresh venv that has livemoe from
`pip install .` without extras, from outside the source tree, with a checkpoint dir as its argument.

- `livemoe` is the one top-level import name the install wrote;
- Hugging Face's `kernels` (transformers >= 5.25 imports it), a transformers Qwen3-MoE model and livemoe.engine
  load in one process;
- the `livemoe` console script answers;
- a short greedy generation works without Triton and without the test extras.
"""
import importlib.metadata
import importlib.util
import os
import subprocess
import sys

if len(sys.argv) != 2:
    sys.exit("usage: plain_install_check.py CHECKPOINT_DIR")
source_tree = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
assert not any(os.path.abspath(p or os.curdir) == source_tree for p in sys.path), "the source tree is on sys.path"
for name in ("triton", "pytest"):
    assert importlib.util.find_spec(name) is None, f"{name} is installed: the check would not show a plain install"

files = importlib.metadata.distribution("livemoe").files
tops = {f.parts[0] for f in files if not f.parts[0].endswith((".dist-info", ".egg-info", ".pth")) and
        f.parts[0] not in ("..", "__pycache__")}
assert tops == {"livemoe"}, f"pip install wrote top-level names other than livemoe: {sorted(tops)}"
for data in ("livemoe/train/assets/student/model.safetensors", "livemoe/engine/model/presets/qwen3-30b-a3b.json"):
    assert any(str(f) == data for f in files), f"{data} is not installed"
assert not any("/results/" in str(f) for f in files), "committed results were installed"

import transformers  # noqa: E402
from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM  # noqa: E402

import livemoe.engine  # noqa: E402
from livemoe import LLM, SamplingParams  # noqa: E402
from livemoe.kernels import _ext  # noqa: E402

if importlib.util.find_spec("kernels") is not None:  # Hugging Face's: transformers >= 5.25 depends on it
    import kernels

    assert not os.path.abspath(kernels.__file__).startswith(os.path.dirname(os.path.abspath(livemoe.__file__))), \
        kernels.__file__
hf = Qwen3MoeForCausalLM(Qwen3MoeConfig(vocab_size=64, hidden_size=32, intermediate_size=32, moe_intermediate_size=16,
                                        num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=1,
                                        head_dim=16, num_experts=4, num_experts_per_tok=2))
assert os.path.dirname(livemoe.engine.__file__) != os.path.join(source_tree, "livemoe", "engine"), \
    "livemoe came from the source tree"

cli = subprocess.run([os.path.join(os.path.dirname(sys.executable), "livemoe"), "--help"], capture_output=True,
                     text=True, timeout=120)
assert cli.returncode == 0 and "serve" in cli.stdout and "rft" in cli.stdout, (cli.stdout, cli.stderr)

llm = LLM(sys.argv[1], use_tqdm=False)
out = llm.generate(["What is 2 + 3?"], SamplingParams(temperature=0, max_tokens=16))[0]
assert out.token_ids and out.finish_reason in ("stop", "length"), out
print(f"plain install ok: livemoe from {os.path.dirname(livemoe.__file__)} (the only top-level name it installed), "
      f"transformers {transformers.__version__}, HF kernels "
      f"{importlib.metadata.version('kernels') if importlib.util.find_spec('kernels') else 'not installed'}, "
      f"C++ extension {'built' if _ext.available() else 'not built'}; {len(out.token_ids)} tokens: {out.text!r}")
