# nmt: top-level targets. `make multi30k` runs the CPU recipe end to end; `make test` runs the tests.
PYTHON ?= python3
VENV   ?= .venv
BIN     = $(VENV)/bin
export PATH := $(abspath $(BIN)):$(PATH)
# The command every recipe runs its nmt steps with.
NMT    ?= nmt

.PHONY: install test test-margins lint bench bench-scale bench-gpu bench-save gpu-check
install: $(VENV)/.installed
$(VENV)/.installed: pyproject.toml
	test -x $(BIN)/pip || $(PYTHON) -m venv $(VENV)   # pip too: a venv cut short by Ctrl-C is made again
	$(BIN)/python -c "import torch" 2>/dev/null || $(BIN)/pip install --no-compile torch==2.13.0
	$(BIN)/pip install --no-compile -e ".[dev]"
	@# pip byte-compiles one file at a time (a minute of a 2-core install); this uses every core. Files written
	@# for a newer Python fail here as they do under pip, hence the `|| true`.
	$(BIN)/python -m compileall -qq -j 0 "$$($(BIN)/python -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')" || true
	@touch $@

# Two test processes of one thread each (tests/conftest.py sets that): one process leaves a core idle through
# start-ups and Python-bound steps; test files stay whole on one process, which shares their fixtures.
TEST_PROCESSES ?= 2
PYTEST = $(BIN)/python -m pytest -q -n $(TEST_PROCESSES) --dist loadfile
test: install
	$(PYTEST)

MARGINS ?= exp/test-margins.jsonl
test-margins: install   # the tests, then every threshold's measured value and margin on this machine (tests/README.md)
	@mkdir -p $(dir $(MARGINS)) && rm -f $(MARGINS)
	NMT_MARGINS=$(abspath $(MARGINS)) $(PYTEST) $(PYTEST_ARGS)
	$(BIN)/python tests/margins.py $(MARGINS)

lint: install
	$(BIN)/ruff check nmt_cli tests benchmarks recipes

bench: install
	$(BIN)/python benchmarks/run_all.py

PAIRS ?= 4500000
bench-scale: install   # prepare + train start-up at WMT14 size (prepare: 18.5-20.6 minutes at 4.5M pairs on 2 cores)
	$(BIN)/python benchmarks/scale.py --pairs $(PAIRS)

bench-gpu: install     # base and big on all GPUs under torchrun (needs CUDA; `--estimate` runs anywhere)
	$(BIN)/python benchmarks/gpu.py

bench-save: install    # updates per minute with checkpoints written on the training thread vs the background writer
	$(BIN)/python benchmarks/save.py

DEVICE ?= cuda
gpu-check: install     # does training work on this GPU, and how fast: one PASS/FAIL table in < 8 minutes, no download
	$(BIN)/python -m nmt_cli.training.gpu_check --device $(DEVICE)   # DEVICE=cpu: the same checks at tiny sizes

include recipes/multi30k.mk
include recipes/wmt14.mk
include recipes/tatoeba.mk
include recipes/finetune.mk
