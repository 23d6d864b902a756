# `make demo` and `make test` each set everything up from scratch (a venv in .venv) and run.
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
# torch threads of the demo's two runs: both cores of a 2-core CPU the demo has to itself (RFT 9.8 -> 6.7 min,
# GRPO 3.2 -> 2.0 min, the same numbers); the trainers' own default is 1, for a machine shared with other jobs
DEMO_THREADS ?= 2

.PHONY: setup demo test test-fast lint plain-install bench gpu-check clean system-tools

setup: $(VENV)/.installed system-tools

# Debian's espeak-ng speaks the heard live world's host lines (livemoe/train/live/media_world.py): installed where
# apt-get runs as root (each apt step capped at 2 minutes: a machine without package mirrors must not hang setup);
# elsewhere its tests skip, saying so
system-tools:
	@command -v espeak-ng >/dev/null || { [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null && \
	  { timeout 120 apt-get install -y -q espeak-ng >/dev/null 2>&1 || \
	    { timeout 120 apt-get update -q >/dev/null 2>&1 && timeout 120 apt-get install -y -q espeak-ng >/dev/null 2>&1; }; }; } || \
	  echo "== espeak-ng is not installed (apt-get install espeak-ng): the heard live world's speech tests skip"

# pip runs with -q, so each step says first what it does and how long it takes: the C++ build prints
# nothing for minutes otherwise and looks hung.
$(VENV)/.installed: pyproject.toml setup.py $(wildcard csrc/*.cpp csrc/*.cu csrc/*.h)
	@echo "== setup 1/3: virtual environment $(VENV), setuptools, wheel"
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade "setuptools>=64" wheel
	@echo "== setup 2/3: torch (the CPU build where there is no GPU; ~1 minute to download, nothing if installed)"
	bash scripts/install_torch.sh $(PY)
	@echo "== setup 3/3: livemoe's dependencies, then the C++ extension livemoe._C from csrc/"
	@echo "   (compiling prints nothing: about 2 minutes on 2 cores, longer with the CUDA sources on a GPU machine)"
	@start=$$(date +%s); \
	$(PY) -m pip install -q -e ".[test]" --no-build-isolation --config-settings editable_mode=compat && \
	echo "== setup done in $$(( $$(date +%s) - start )) s"
	touch $@

demo: setup
	$(PY) -m train.rft --threads $(DEMO_THREADS)
	$(PY) -m train.grpo --threads $(DEMO_THREADS)

test: setup
	@echo "== the whole suite, tests/ and bench/ in quick mode: about 18-26 minutes on 2 cores (gpu tests skip without a GPU)"
	$(PY) -m pytest tests bench -q

# markers in pyproject.toml: slow (10 s or more each on 2 cores) and gpu (needs a CUDA GPU) left out
test-fast: setup
	@echo "== tests/ and bench/ in quick mode without the slow and the gpu tests"
	$(PY) -m pytest tests bench -q -m "not slow and not gpu"

# ruff, then mypy over the packages [tool.mypy] names (the engine's sampling, decoder and core; the modules they
# import are read for their types, not reported on): 45-90 s on 2 cores from a cold cache, a few seconds with
# its .mypy_cache.
lint: setup
	@echo "== ruff (the rules in pyproject.toml)"
	$(PY) -m ruff check .
	@echo "== mypy: livemoe/engine/sampling, livemoe/engine/decoder, livemoe/engine/core ([tool.mypy] in pyproject.toml)"
	$(PY) -m mypy

# A user's install: a fresh venv, CPU torch, `pip install .` without extras, then livemoe beside HF kernels and a short
# generation from outside the source tree (scripts/plain_install_check.py). The C++ extension is not built
# again (LIVEMOE_NO_EXT=1, 2 minutes saved): `make setup` builds it, and this run covers the PyTorch fallbacks
# of an install without one. About 3 minutes on 2 cores: unpacking torch, then downloading the rest, most of
# it the Triton wheel that xgrammar pulls on x86-64 Linux; Triton is then removed, so that the import is
# checked as on an ARM or macOS machine, which have none. build/lib goes first: a module deleted from the
# source would be installed from it.
PLAIN_VENV ?= .venv-plain
plain-install:
	@echo "== plain install: fresh venv $(PLAIN_VENV), CPU torch, pip install . (no extras, no C++ build)"
	@start=$$(date +%s); \
	rm -rf $(PLAIN_VENV) && $(PYTHON) -m venv $(PLAIN_VENV) && \
	$(PLAIN_VENV)/bin/python -m pip install -q --upgrade "setuptools>=64" wheel && \
	bash scripts/install_torch.sh $(PLAIN_VENV)/bin/python && \
	rm -rf build/lib && LIVEMOE_NO_EXT=1 $(PLAIN_VENV)/bin/python -m pip install -q --no-build-isolation . && \
	$(PLAIN_VENV)/bin/python -m pip uninstall -q -y triton && \
	cd $(PLAIN_VENV) && ./bin/python $(CURDIR)/scripts/plain_install_check.py $(CURDIR)/livemoe/train/assets/student && \
	echo "== plain install checked in $$(( $$(date +%s) - start )) s"

bench: setup
	$(PY) -m pytest bench --benchmark

gpu-check:
	bash bench/gpu_check.sh

clean:
	rm -rf $(VENV) $(PLAIN_VENV) build *.egg-info livemoe/_C*.so
