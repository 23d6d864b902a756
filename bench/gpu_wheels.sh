#!/usr/bin/env bash
# Downloads, here (with network), the cp312 wheels the GPU image lacks into .whl/, at the versions this checkout's
# .venv has, so the GPU run tests what CI tests. bench/gpu_check.sh installs them there when .whl/ is carried:
#   bash bench/gpu_wheels.sh && <device run, carry [".whl"]> bash bench/gpu_check.sh
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-.venv/bin/python}
grep -qx '/.whl/' .git/info/exclude 2>/dev/null || { mkdir -p .git/info; echo /.whl/ >> .git/info/exclude; }
rm -rf .whl && mkdir .whl
# the core's and the server's packages and what they need beyond the image's own (KINDS.md lists the image)
NAMES="msgspec pyzmq xgrammar apache-tvm-ffi fastapi starlette uvicorn httptools pydantic pydantic_core
  annotated-types typing-inspection typing_extensions anyio sniffio opentelemetry-api openai httpx2 httpcore2
  truststore jiter"
PLATFORMS=""
for p in manylinux1 manylinux2014 manylinux_2_17 manylinux_2_24 manylinux_2_27 manylinux_2_28; do
  PLATFORMS+=" --platform ${p}_x86_64"
done
for name in $NAMES; do
  version=$("$PY" -m pip show "$name" 2>/dev/null | sed -n "s/^Version: //p" || true)
  [ -n "$version" ] || { echo "$name is not installed in $PY's environment: skipped" >&2; continue; }
  # shellcheck disable=SC2086
  "$PY" -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp $PLATFORMS \
    -d .whl "$name==$version" 2>&1 | grep -v "^WARNING: Location" || true
done
ls .whl && du -sh .whl
