"""CI's plain-install check (`make plain-install`): run by the python of a fresh venv that has livemoe from
`pip install .` without extras, from outside the source tree, with a checkpoint dir as its argument.
`import engine` and a short greedy generation must work without Triton and without the test extras."""
import importlib.util
import os
import sys

import engine
from kernels import _ext

if len(sys.argv) != 2:
    sys.exit("usage: plain_install_check.py CHECKPOINT_DIR")
source_tree = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
assert os.path.dirname(engine.__file__) != os.path.join(source_tree, "engine"), "engine came from the source tree"
for name in ("triton", "pytest"):
    assert importlib.util.find_spec(name) is None, f"{name} is installed: the check would not show a plain install"

llm = engine.LLM(sys.argv[1], use_tqdm=False)
out = llm.generate(["What is 2 + 3?"], engine.SamplingParams(temperature=0, max_tokens=16))[0]
assert out.token_ids and out.finish_reason in ("stop", "length"), out
print(f"plain install ok: engine from {os.path.dirname(engine.__file__)}, C++ extension "
      f"{'built' if _ext.available() else 'not built'}; {len(out.token_ids)} tokens: {out.text!r}")
