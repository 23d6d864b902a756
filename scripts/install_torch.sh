#!/usr/bin/env bash
# Installs torch into the given interpreter's environment before anything else asks for it: a plain
# `torch` requirement on a machine without a GPU would otherwise pull a multi-GB CUDA build.
set -euo pipefail
PY=${1:-python3}
if "$PY" -c "import torch" 2>/dev/null; then
  exit 0
fi
if command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L >/dev/null 2>&1; then
  "$PY" -m pip install -q torch
else
  # 2.13.0 is the CPU build this project is tested with; fall back to whatever pip resolves.
  "$PY" -m pip install -q "torch==2.13.0" || "$PY" -m pip install -q torch
fi
