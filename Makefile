# Two commands on a fresh machine: `make demo` and `make test`. Each creates .venv and installs what it needs.
PY ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.kvmesh-installed

.PHONY: demo test bench clean

$(STAMP): pyproject.toml
	$(PY) -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade pip
	$(BIN)/python -m pip install -q -e '.[test]'
	touch $@

demo: $(STAMP)
	$(BIN)/kvmesh demo $(ARGS)

test: $(STAMP)
	$(BIN)/python -m pytest -q -p no:cacheprovider $(ARGS)

bench: $(STAMP)
	$(BIN)/python bench/core.py $(ARGS)

clean:
	rm -rf $(VENV) build *.egg-info
