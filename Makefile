# One-command set-up: every target installs what it needs into .venv first.
PY ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed

.PHONY: demo test test-fast lint bench install clean

$(STAMP): pyproject.toml
	$(PY) -m venv $(VENV)
	$(BIN)/pip install --quiet --upgrade pip
	# torch 2.13.0 pinned for the CPU build (see docs/install.md); a GPU machine may use any torch>=2.6
	$(BIN)/pip install --quiet torch==2.13.0
	$(BIN)/pip install --quiet -e '.[test]'
	touch $(STAMP)

install: $(STAMP)

## The embedded default job: warm start + async GRPO on the built-in task, on this machine.
demo: $(STAMP)
	$(BIN)/streamrl train

## The whole test suite (unit, contract, integration), then lint.
test: $(STAMP)
	$(BIN)/ruff check streamrl tests benchmarks
	$(BIN)/pytest -q -p no:cacheprovider tests

test-fast: $(STAMP)
	$(BIN)/pytest -q -m "not integration" tests

lint: $(STAMP)
	$(BIN)/ruff check streamrl tests benchmarks
	$(BIN)/ruff format --check streamrl tests benchmarks

bench: $(STAMP)
	$(BIN)/python benchmarks/async_vs_sync.py

clean:
	rm -rf $(VENV) runs .cache
