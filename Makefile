# The project's own commands; CI calls `make test` too. Everything installs into .venv from pyproject.toml.
PYTHON ?= python3
VENV   := .venv
BIN    := $(VENV)/bin
STAMP  := $(VENV)/.installed-stamp
PYTEST_ARGS ?=

.PHONY: install run test test-slow lint bench clean

$(STAMP): pyproject.toml
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet --upgrade pip
	$(BIN)/python -m pip install --quiet -e '.[dev]'
	touch $(STAMP)

install: $(STAMP)

run: install
	$(BIN)/transcript-store gateway

test: install
	$(BIN)/python -m pytest -q -m "not slow" $(PYTEST_ARGS)

test-slow: install
	$(BIN)/python -m pytest -q -m slow $(PYTEST_ARGS)

lint: install
	$(BIN)/ruff check transcript_store engines tests
	$(BIN)/mypy transcript_store engines

bench: install
	$(BIN)/python -m bench

clean:
	rm -rf $(VENV) .pytest_cache .mypy_cache .ruff_cache .hypothesis
