# Developer and CI entry points. The venv is rebuilt whenever pyproject.toml changes,
# tracked by a stamp file so `make test` does not reinstall on every run.

PYTHON ?= python3
VENV := .venv
STAMP := $(VENV)/.installed

.PHONY: venv demo test format clean

# `make .venv` and `make venv` both (re)build the environment when it is stale.
$(VENV): $(STAMP)
venv: $(STAMP)

$(STAMP): pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(VENV)/bin/python -m pip install --upgrade pip
	$(VENV)/bin/python -m pip install -e '.[test]'
	touch $(STAMP)

demo: $(STAMP)
	$(VENV)/bin/plaserve demo

test: $(STAMP)
	$(VENV)/bin/ruff check src tests benchmarks
	$(VENV)/bin/ruff format --check src tests benchmarks
	$(VENV)/bin/python -m pytest -q tests

format: $(STAMP)
	$(VENV)/bin/ruff check --fix src tests benchmarks
	$(VENV)/bin/ruff format src tests benchmarks

clean:
	rm -rf $(VENV) build dist src/*.egg-info .pytest_cache out
	find . -name __pycache__ -type d -prune -exec rm -rf {} +
