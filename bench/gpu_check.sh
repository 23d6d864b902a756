#!/usr/bin/env bash
# The one script for a GPU machine (no network; runs from the source tree with the python3 there):
#   1. environment             (seconds)
#   2. build the extension     in the background, on the CPUs, while the GPU tests run (csrc/ holds CPU
#                              ops only, which no GPU path needs: a failed build costs no GPU figure)
#   3. GPU correctness tests   -m "gpu or triton" (markers in pyproject.toml): the bf16 real-shape checks, CUDA
#                              graphs (gpu), the Triton kernels' tests compiled for this GPU (triton)
#   4. GPU benchmarks          kernels first (MoE, log-probs, attention), then the decoder, then the training
#                              step of Qwen3-30B-A3B-shaped layers with expert parallel against FSDP alone
#                              (bench_parallel.py: on one GPU the 1-GPU step, the EP case skipped with its
#                              reason), then the rest; every row is written to results.{json,md} as soon as it
#                              is measured
# Budget: LIVEMOE_GPU_CHECK_BUDGET seconds in all (default 450, i.e. under 8 minutes); each stage gets a
# timeout from what is left, so a slow stage never takes the figures of the next with it.
# Output: $OUT when set (the device tool's folder that comes back), else $LIVEMOE_BENCH_OUT, else bench/out:
# gpu_check.log (everything printed here), build.log, tests.xml, results.{json,md,png}, pytest_benchmark.json
# (7 files: the device tool returns at most 8). Copy them to bench/results/<date>-<gpu>/ to commit.
# On a lent GPU: run `bash bench/gpu_check.sh` with a timeout_s of about 540 (the budget plus a margin).
# Here, without a GPU, LIVEMOE_GPU_CHECK_ALLOW_CPU=1 LIVEMOE_GPU_CHECK_BUDGET=300 PYTHON=<venv python> bash
# bench/gpu_check.sh walks every stage (Triton tests under the interpreter, CPU benchmarks until the limit).
set -uo pipefail
cd "$(dirname "$0")/.."
START=$(date +%s)
BUDGET=${LIVEMOE_GPU_CHECK_BUDGET:-450}
RES=${OUT:-${LIVEMOE_BENCH_OUT:-bench/out}}
mkdir -p "$RES"
RES=$(cd "$RES" && pwd)
export LIVEMOE_BENCH_OUT=$RES PYTHONUNBUFFERED=1
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
unset TRITON_INTERPRET  # the GPU runs the compiled kernels
PY=${PYTHON:-python3}
# the GPU image lacks the server's and the core's packages (msgspec, pyzmq, xgrammar, fastapi, ...): without them a
# third of the test modules cannot import. bench/gpu_wheels.sh downloads them here into .whl/ (git-ignored through
# .git/info/exclude); carried there, they are installed into /tmp/site
if compgen -G ".whl/*.whl" >/dev/null; then
  "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
    && export PYTHONPATH="/tmp/site:$PYTHONPATH" || echo "installing .whl/ failed: the modules that need them fail"
fi
exec > >(tee -a "$RES/gpu_check.log") 2>&1  # a kill still leaves everything printed so far in the log

left() { echo $(( BUDGET - ($(date +%s) - START) )); }
limit() { local t=$(( $(left) * $1 / $2 - ${3:-0} )); echo $(( t < 20 ? 20 : t )); }  # share of what is left
stage() { echo; echo "== [$(( $(date +%s) - START ))s] $*"; }
# per-test limit where pytest-timeout is installed (it is on the GPU image): one hung test fails alone
TIMEOUT_OPT=() BENCH_TIMEOUT_OPT=()
if "$PY" -c "import pytest_timeout" 2>/dev/null; then
  TIMEOUT_OPT=(--timeout=150) BENCH_TIMEOUT_OPT=(--timeout=300)  # the 30B-shaped decode suite runs long
fi
# the correctness tests compile a hundred-odd Triton kernels, one CPU core each: pytest-xdist (on the GPU image)
# spreads them over LIVEMOE_GPU_CHECK_WORKERS processes (0: one process)
WORKERS_OPT=()
WORKERS=${LIVEMOE_GPU_CHECK_WORKERS:-4}
[ "$WORKERS" -gt 0 ] && "$PY" -c "import xdist" 2>/dev/null && WORKERS_OPT=(-n "$WORKERS")

stage "environment"
date -u +"date %Y-%m-%dT%H:%M:%SZ"
nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.sm,temperature.gpu --format=csv,noheader \
  | sed 's/^/gpu /' || echo "nvidia-smi failed"
"$PY" - <<'EOF' || echo "environment probe failed"
import platform, torch
print("python", platform.python_version(), "torch", torch.__version__, "cuda", torch.version.cuda,
      "cuda available", torch.cuda.is_available())
for name in ("triton", "transformers", "numpy", "pytest", "pytest_benchmark", "pytest_timeout", "setuptools",
             "ninja", "fastapi", "openai"):
    try:
        m = __import__(name)
        print(" ", name, getattr(m, "__version__", "?"))
    except Exception as e:  # noqa: BLE001
        print(" ", name, "MISSING:", type(e).__name__)
if torch.cuda.is_available():
    p = torch.cuda.get_device_properties(0)
    print("device", p.name, f"sm_{p.major}{p.minor}", p.multi_processor_count, "SMs",
          round(p.total_memory / 2**30, 1), "GiB")
EOF
command -v nvcc >/dev/null && nvcc --version | tail -2 || echo "nvcc not on PATH"
command -v ninja >/dev/null && echo "ninja $(ninja --version)" || echo "ninja not on PATH (setup.py falls back to setuptools)"
# without a usable GPU every later stage would measure the CPU: stop here, unless asked to walk the stages
if ! "$PY" -c "import sys, torch; sys.exit(0 if torch.cuda.is_available() else 1)" 2>/dev/null \
    && [ "${LIVEMOE_GPU_CHECK_ALLOW_CPU:-0}" != 1 ]; then
  echo "no CUDA device visible to torch: stopping (LIVEMOE_GPU_CHECK_ALLOW_CPU=1 walks the stages on the CPU)"
  sleep 1
  exit 2
fi

stage "build the extension (background; log: $RES/build.log)"
build_pid=
build_t0=$(date +%s)
if "$PY" -c "import setuptools" 2>/dev/null; then
  timeout 300 "$PY" setup.py -q build_ext --inplace > "$RES/build.log" 2>&1 &
  build_pid=$!
else
  echo "setuptools missing: no build (the GPU paths use Triton; only CPU ops live in csrc/)" | tee "$RES/build.log"
fi

# modules that cannot import on this image (the HTTP server's tests need fastapi and openai, absent from the
# GPU image) are left out by name; --continue-on-collection-errors keeps any other such module from
# stopping the rest
IGNORE=()
"$PY" -c "import fastapi, openai, uvicorn" 2>/dev/null || IGNORE=(--ignore=tests/integration/test_server.py)

t=$(limit 2 5)
stage "GPU correctness tests (limit ${t}s)"
# the tests marked gpu (CUDA only) or triton (the Triton kernels: compiled here, interpreted on a CPU)
timeout $t "$PY" -m pytest tests -m "gpu or triton" -v -p no:cacheprovider -rfE --tb=short "${IGNORE[@]}" \
  --continue-on-collection-errors --durations=8 --junitxml="$RES/tests.xml" "${TIMEOUT_OPT[@]}" "${WORKERS_OPT[@]}"
tests=$?
build=0
if [ -n "$build_pid" ]; then
  stage "waiting for the build (at most 90s: the GPU benchmarks do not need it, and it would load the CPUs)"
  for _ in $(seq 90); do kill -0 "$build_pid" 2>/dev/null || break; sleep 1; done
  kill -0 "$build_pid" 2>/dev/null && { kill "$build_pid"; echo "build still running: stopped"; }
  wait "$build_pid"; build=$?
  echo "build rc=$build in $(( $(date +%s) - build_t0 ))s" | tee -a "$RES/build.log"
  grep -iE -m 8 "error|warning:" "$RES/build.log"
  ls livemoe/_C*.so 2>/dev/null || echo "no livemoe/_C*.so"
fi

t=$(limit 1 1 15)
stage "GPU benchmarks (limit ${t}s)"
# kernels first, the end-to-end decoder (bench_spec.py: speculative decoding against the same engine without it,
# its verification steps on CUDA graphs) and the expert-parallel training step next (its GPU case runs before its
# gloo one), then the exact mode's cost (bench_exact.py: each batch-invariant Triton kernel against the default
# one at Qwen3-30B-A3B's shapes, and the decode and training steps with the mode on against off), the CPU-side
# suites last; any other suite after them.
# bench_tp.py last: its rows for TP 2 and 4 skip (saying how many GPUs they need) where fewer are visible
order=(bench/bench_moe.py bench/bench_logprobs.py bench/bench_attention.py bench/bench_decode.py bench/bench_spec.py
       bench/bench_parallel.py bench/bench_exact.py bench/bench_flops.py bench/bench_serve.py)
files=()
for f in "${order[@]}" bench/bench_*.py; do
  [ -f "$f" ] && [ "$f" != bench/bench_tp.py ] && [[ ! " ${files[*]} " =~ " $f " ]] && files+=("$f")
done
[ -f bench/bench_tp.py ] && files+=(bench/bench_tp.py)
# LIVEMOE_GPU_CHECK_BENCH="bench/bench_a.py ...": only these suites (a rerun of what failed)
[ -n "${LIVEMOE_GPU_CHECK_BENCH:-}" ] && read -ra files <<< "$LIVEMOE_GPU_CHECK_BENCH"
timeout $t "$PY" -m pytest "${files[@]}" --benchmark -v -p no:cacheprovider -rfEs --tb=short \
  --continue-on-collection-errors --benchmark-json="$RES/pytest_benchmark.json" "${BENCH_TIMEOUT_OPT[@]}"
benches=$?

stage "summary: build rc=$build, gpu tests rc=$tests, benchmarks rc=$benches (124: stage timed out)"
[ -f "$RES/results.md" ] && cat "$RES/results.md"
sleep 1  # let tee write the last lines to the log
exit $(( build || tests || benches ))
