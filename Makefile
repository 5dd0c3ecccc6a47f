# octacloud: two commands on a fresh machine.
#   make up    install into .venv and run the main job
#   make test  install the dev tools and run the whole suite (lint, types, layering, tests)

PYTHON   ?= python3
VENV     ?= .venv
BIN      := $(VENV)/bin
PY       := $(BIN)/python
PIP      := $(PY) -m pip
STAMP    := $(VENV)/.octacloud-installed
DEVSTAMP := $(VENV)/.octacloud-dev-installed
BUILDSTAMP := $(VENV)/.octacloud-build-installed
PYTEST_ARGS ?=

.PHONY: up install dev build-tools browser test lint types layers pytest models clean

# The main job: the cloud on this machine, serving the example models (built once, cached) behind one
# OIP endpoint on 127.0.0.1:8000 (REST) and :8001 (gRPC). Ctrl-C stops it; replicas keep running until
# `octacloud undeploy` or the next `make up` adopts them.
UP_ARGS ?= --deploy mlp --deploy minilm
up: install models
	$(BIN)/octacloud up --repository $(MODELS) $(UP_ARGS)

$(PY):
	$(PYTHON) -m venv $(VENV)
	$(PIP) install --quiet --upgrade pip

$(STAMP): pyproject.toml | $(PY)
	$(PIP) install --quiet -e .
	@touch $@

install: $(STAMP)

$(DEVSTAMP): $(STAMP) requirements/dev.txt
	$(PIP) install --quiet -r requirements/dev.txt
	@touch $@

dev: $(DEVSTAMP)

# torch/transformers are only needed to build models (convert, the example repository).
$(BUILDSTAMP): $(STAMP) requirements/build-models.txt
	$(PIP) install --quiet -r requirements/build-models.txt
	@touch $@

build-tools: $(BUILDSTAMP)

lint: dev
	$(BIN)/ruff check src tests bench
	$(BIN)/ruff format --check src tests bench

types: dev build-tools
	$(BIN)/mypy

layers: dev
	$(BIN)/lint-imports

# The example model repository (ResNet-50, BERT-base, MiniLM-L6, a tiny MLP): built once, then skipped while
# its recipe, libraries and source weights are unchanged. Nothing is downloaded.
MODELS ?= models
models: build-tools
	HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 $(BIN)/octacloud models build --out $(MODELS)

# The dashboard's browser test drives Debian's Chromium (Playwright with executable_path; no browser download).
# Installed once as root (CI runs as root on a clean clone); skipped when both binaries are present.
browser:
	@if [ -x /usr/bin/chromium ] && [ -x /usr/bin/chromedriver ]; then :; \
	else DEBIAN_FRONTEND=noninteractive apt-get update -qq && \
	     DEBIAN_FRONTEND=noninteractive apt-get install -y -qq chromium chromium-driver; fi

pytest: dev build-tools models browser
	scripts/netns-run $(BIN)/pytest $(PYTEST_ARGS)

test: lint types layers pytest

clean:
	rm -rf $(VENV) .mypy_cache .pytest_cache .ruff_cache build
