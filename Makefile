# Every target sets up .venv on first use: torch's CPU build first (a plain `pip install torch`
# would pull several GB of CUDA packages), then ddpgpt itself with its dev extra.
PYTHON ?= python3
VENV   := .venv
PY     := $(VENV)/bin/python
STAMP  := $(VENV)/.installed
DATA   ?= data/stdlib
RUN    ?= runs/demo
NPROC  ?= 2

.PHONY: setup test demo bench lint clean

setup: $(STAMP)

$(STAMP): pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	$(PY) -m pip install --quiet torch==2.13.0
	$(PY) -m pip install --quiet -e '.[dev]'
	touch $(STAMP)

test: $(STAMP)
	$(PY) -m pytest -q

lint: $(STAMP)
	$(VENV)/bin/ruff check ddpgpt tests benchmarks

clean:
	rm -rf $(VENV) build *.egg-info .pytest_cache
