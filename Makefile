# Two commands: `make demo` and `make test`. Each creates .venv (Python 3.12) if missing,
# installs the project with the pinned constraints, then runs its job.
SHELL := /bin/bash
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed

# pyenv resolves python3.12 through .python-version; elsewhere python3.12 is on PATH.
PYTHON312 := $(shell command -v python3.12 2>/dev/null || pyenv which python3.12 2>/dev/null)

.PHONY: demo test lint gpu-check clean

$(PY):
	@if [ -z "$(PYTHON312)" ]; then \
	  echo "error: python3.12 not found. Install Python 3.12 (e.g. 'pyenv install 3.12') and retry."; \
	  exit 1; \
	fi
	$(PYTHON312) -m venv $(VENV)

$(STAMP): $(PY) pyproject.toml constraints.txt
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q -c constraints.txt -e ".[test]"
	@touch $(STAMP)

# The demo includes text through LLM on the shipped trained model (flax_models/assets/
# kjv-bamba, a 4.6M-parameter hybrid trained on the King James Bible); then the generate
# CLI streams a sampled completion from it.
demo: $(STAMP)
	JAX_PLATFORMS=$${JAX_PLATFORMS:-cpu} $(PY) -m flax_models.demo
	JAX_PLATFORMS=$${JAX_PLATFORMS:-cpu} $(PY) -m flax_models.generate flax_models/assets/kjv-bamba \
	  --prompt "And God said," --max-tokens 48 --temperature 0.8 --top-p 0.9 --seed 1

lint: $(STAMP)
	$(PY) -m ruff check pallas_kernels flax_models tests benchmarks tools notebooks

# Whole files to a worker (--dist loadfile): a module's expensive fixtures (a server, a
# multi-device subprocess, a shared LLM) are built once.
test: $(STAMP) lint
	JAX_PLATFORMS=$${JAX_PLATFORMS:-cpu} $(PY) -m pytest -q -n 2 --dist loadfile -m "not gpu" -p no:cacheprovider

# On a GPU machine with JAX preinstalled (no network): see tools/gpu_check.sh.
gpu-check:
	bash tools/gpu_check.sh $${OUT:-gpu_out}

clean:
	rm -rf $(VENV) .pytest_cache .hypothesis
