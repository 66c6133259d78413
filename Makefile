# Two entry points (see README): `make demo` and `make test`. Both set everything up first.
PYTHON ?= python3
VENV   := .venv
BIN    := $(VENV)/bin
STAMP  := $(VENV)/.shardc-installed

.PHONY: setup demo test test-fast lint mutants bench clean

$(STAMP): pyproject.toml
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	# torch first, pinned to the CPU wheel, so nothing pulls a multi-GB CUDA build
	$(BIN)/pip install -q torch==2.13.0
	$(BIN)/pip install -q -e '.[all]'
	touch $(STAMP)

setup: $(STAMP)

demo: setup
	$(BIN)/python scripts/setup_demo.py
	$(BIN)/shardc build plans/demo-tp3pp2-bf16.yaml
	$(BIN)/shardc verify --manifest build/demo-tp3pp2-bf16/manifest.json
	$(BIN)/shardc inspect build/demo-tp3pp2-bf16/manifest.json
	$(BIN)/shardc run --manifest build/demo-tp3pp2-bf16 --prompt "The capital of France is" --max-new-tokens 12

# The suite runs on both cores (pytest-xdist), each test file on one worker so that a file's
# module-scoped builds are made once; ruff and mypy (strict on layout/ and formats/: [tool.mypy]) first, as CI does.
test: setup
	$(BIN)/ruff check .
	$(BIN)/mypy
	$(BIN)/python scripts/setup_demo.py
	$(BIN)/python -m pytest -q -rs --durations=15 -n 2 --dist loadfile

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
