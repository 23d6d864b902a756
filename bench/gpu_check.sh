#!/usr/bin/env bash
# The one script for a GPU machine (no network; runs from the source tree with the python3 there):
# builds the CUDA extension, runs the GPU-only correctness tests (bf16 at real shapes), runs the GPU
# benchmark suites, and prints a short table last. Results land in bench/out/ (copy them to
# bench/results/<date>-<gpu>/ to commit). Budget: 8 minutes.
set -uo pipefail
cd "$(dirname "$0")/.."
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
OUT=${LIVEMOE_BENCH_OUT:-bench/out}
mkdir -p "$OUT"
{
  date -u +"date %Y-%m-%dT%H:%M:%SZ"
  nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader | sed 's/^/gpu /'
  python3 -c "import torch, triton, transformers; print('torch', torch.__version__, 'cuda', torch.version.cuda, 'triton', triton.__version__, 'transformers', transformers.__version__)"
} | tee "$OUT/environment.txt"

echo "== build the extension (CUDA sources included)"
t0=$(date +%s)
timeout 240 python3 setup.py -q build_ext --inplace > "$OUT/build.log" 2>&1
build=$?
echo "build rc=$build in $(( $(date +%s) - t0 ))s (log: $OUT/build.log)"; tail -3 "$OUT/build.log"

echo "== GPU-only correctness tests"
LIVEMOE_GPU_ONLY=1 timeout 180 python3 -m pytest tests -q -x -p no:cacheprovider --junitxml="$OUT/gpu_tests.xml" 2>&1 | tail -25
tests=${PIPESTATUS[0]}

echo "== GPU benchmarks"
timeout 240 python3 -m pytest bench --benchmark -q -p no:cacheprovider --benchmark-json="$OUT/pytest_benchmark.json" 2>&1 | tail -60
benches=${PIPESTATUS[0]}

echo "== summary: build rc=$build, gpu tests rc=$tests, benchmarks rc=$benches"
[ -f "$OUT/results.md" ] && cat "$OUT/results.md"
exit $(( build || tests || benches ))
