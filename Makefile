# One virtualenv for everything; every target does its own set-up.
VENV   := .venv
PY     := $(VENV)/bin/python
PIP    := $(PY) -m pip
STAMP  := $(VENV)/.installed
TORCH  := torch==2.13.0

.PHONY: setup serve test lint format bench clean

setup: $(STAMP)

$(STAMP): pyproject.toml
	test -x $(PY) || python3 -m venv $(VENV)
	$(PY) -c "import torch" 2>/dev/null || $(PIP) install -q $(TORCH)
	$(PIP) install -q -e ".[dev]"
	touch $(STAMP)

serve: setup
	$(VENV)/bin/tandem serve

test: setup lint
	$(PY) -m pytest -q -m "not gpu" --durations=25

lint: setup
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .
	$(VENV)/bin/lint-imports

format: setup
	$(VENV)/bin/ruff check --fix .
	$(VENV)/bin/ruff format .

bench: setup
	$(PY) benchmarks/engine_throughput.py

clean:
	rm -rf $(VENV) build *.egg-info
