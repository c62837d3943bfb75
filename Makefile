# Every target sets up .venv on first use: torch's CPU build first (a plain `pip install torch`
# would pull several GB of CUDA packages), then ddpgpt itself with its dev extra.
PYTHON ?= python3
VENV   := .venv
PY     := $(VENV)/bin/python
STAMP  := $(VENV)/.installed
DATA   ?= data/stdlib
RUN    ?= runs/demo
NPROC  ?= 2
TEST_WORKERS ?= 2
# A nanoGPT checkout for the speedrun benchmark (git clone https://github.com/karpathy/nanoGPT);
# empty: that benchmark skips nanoGPT, with one line, and times ddpgpt's recipes alone.
NANOGPT ?=
# The config with the lowest val bits per byte in the demo's budget (benchmarks/sweep_demo.py):
# Muon, 128-token sequences, 32 of them per step (the same 4,096 tokens per step as tiny's).
DEMO_FLAGS := --optim.name muon --model.block-size 128 --data.global-batch 32 --data.eval-windows 0

.PHONY: setup test test-fast demo bench lint clean data device-check

setup: $(STAMP)

$(STAMP): pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet torch==2.13.0
	$(PY) -m pip install --quiet -e '.[dev]'
	touch $(STAMP)

# The suite on $(TEST_WORKERS) pytest-xdist workers, each test file whole on one of them (its
# module-scoped shared runs built once); it ends with its total time and the 15 slowest tests.
# test-fast: the unit tests alone, for the edit-and-test loop.
test: $(STAMP)
	$(PY) -m pytest -q -n $(TEST_WORKERS) --dist loadfile --durations=15

test-fast: $(STAMP)
	$(PY) -m pytest -q -n $(TEST_WORKERS) --dist loadfile --durations=5 tests/unit

# The quick start: prepare the standard-library corpus (once), train the tiny preset on $(NPROC)
# CPU processes (its last step scores the val split), then print a sample, and draw its curves
# ($(RUN).png). Run again: it resumes (or, when finished, says its recorded val loss and
# samples); `rm -rf $(RUN)` to train from scratch.
demo: $(STAMP) data
	$(PY) -m ddpgpt train --data $(DATA) --preset tiny $(DEMO_FLAGS) --run-dir $(RUN) --nproc $(NPROC) --device cpu
	$(PY) -m ddpgpt sample --run-dir $(RUN) --device cpu --prompt "def " --max-new-tokens 150
	$(PY) -m ddpgpt plot $(RUN)

data: $(STAMP)
	test -f $(DATA)/meta.json || $(PY) -m ddpgpt prepare --out $(DATA)

bench: $(STAMP) data
	$(PY) -m benchmarks.bench_loader --data $(DATA)
	$(PY) -m benchmarks.bench_train --data $(DATA)
	$(PY) -m ddpgpt bench --nproc $(NPROC) --data $(DATA) --repeats 3 --out bench
	$(PY) -m benchmarks.scaling --out bench/scaling.png
	$(PY) -m benchmarks.bench_prepare --work bench/prepare --json bench/prepare.json
	$(PY) -m benchmarks.speedrun --work bench/speedrun $(if $(NANOGPT),--nanogpt $(NANOGPT))

# On new hardware, first: every path (sync modes, precisions, optimizers, compile, checkpoints,
# signals, eval, sample, export) against its oracle on the device here (CUDA when torch sees
# it); prints the table and writes device-check/device-check.md and .json; exit 1 if a row fails.
device-check: $(STAMP)
	$(PY) -m ddpgpt check --out device-check

# Style (ruff) and the house's one direction (import-linter's contracts in pyproject.toml).
lint: $(STAMP)
	$(VENV)/bin/ruff check ddpgpt tests benchmarks
	$(VENV)/bin/lint-imports

clean:
	rm -rf $(VENV) build *.egg-info .pytest_cache
