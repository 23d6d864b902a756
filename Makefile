# `make demo` and `make test` each set everything up from scratch (a venv in .venv) and run.
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python

.PHONY: setup demo test bench gpu-check clean

setup: $(VENV)/.installed

$(VENV)/.installed: pyproject.toml setup.py $(wildcard csrc/*.cpp csrc/*.cu csrc/*.h)
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade "setuptools>=64" wheel
	bash scripts/install_torch.sh $(PY)
	$(PY) -m pip install -q -e ".[test]" --no-build-isolation --config-settings editable_mode=compat
	touch $@

demo: setup
	$(PY) -m train.rft
	$(PY) -m train.grpo

test: setup
	$(PY) -m pytest tests bench -q

bench: setup
	$(PY) -m pytest bench --benchmark

gpu-check:
	bash bench/gpu_check.sh

clean:
	rm -rf $(VENV) build *.egg-info kernels/_C*.so
