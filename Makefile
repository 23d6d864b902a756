# `make demo` and `make test` each set everything up from scratch (a venv in .venv) and run.
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python

.PHONY: setup demo test bench gpu-check clean

setup: $(VENV)/.installed

# pip runs with -q, so each step says first what it does and how long it takes: the C++ build prints
# nothing for minutes otherwise and looks hung.
$(VENV)/.installed: pyproject.toml setup.py $(wildcard csrc/*.cpp csrc/*.cu csrc/*.h)
	@echo "== setup 1/3: virtual environment $(VENV), setuptools, wheel"
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade "setuptools>=64" wheel
	@echo "== setup 2/3: torch (the CPU build where there is no GPU; ~1 minute to download, nothing if installed)"
	bash scripts/install_torch.sh $(PY)
	@echo "== setup 3/3: livemoe's dependencies, then the C++ extension kernels._C from csrc/"
	@echo "   (compiling prints nothing: about 2 minutes on 2 cores, longer with the CUDA sources on a GPU machine)"
	@start=$$(date +%s); \
	$(PY) -m pip install -q -e ".[test]" --no-build-isolation --config-settings editable_mode=compat && \
	echo "== setup done in $$(( $$(date +%s) - start )) s"
	touch $@

demo: setup
	$(PY) -m train.rft
	$(PY) -m train.grpo

test: setup
	@echo "== the whole suite, tests/ and bench/ in quick mode: about 4 minutes on 2 cores"
	$(PY) -m pytest tests bench -q

bench: setup
	$(PY) -m pytest bench --benchmark

gpu-check:
	bash bench/gpu_check.sh

clean:
	rm -rf $(VENV) build *.egg-info kernels/_C*.so
