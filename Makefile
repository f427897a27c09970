# `make demo` and `make test` each create .venv if missing, install what they need, and run.
# TORCH_SPEC pins the CPU build that lies on local disk on our machines and CI; users may pass any torch.
PYTHON ?= python3
VENV ?= .venv
TORCH_SPEC ?= torch==2.13.0
PY := $(VENV)/bin/python
PIP := $(PY) -m pip
STAMP := $(VENV)/.stamp
DEMO_ARGS ?=
PYTEST_ARGS ?=

.PHONY: demo test lint typecheck bench clean

$(PY):
	$(PYTHON) -m venv $(VENV)
	$(PIP) install -q --upgrade pip

$(STAMP)-core: $(PY) pyproject.toml
	$(PIP) install -q "$(TORCH_SPEC)"
	$(PIP) install -q -e ".[demo]"
	touch $@

# the integration tests run the examples on diffusers, transformers, peft, accelerate and lightning
$(STAMP)-test: $(STAMP)-core
	$(PIP) install -q "$(TORCH_SPEC)" -e ".[demo,test,dev,diffusers,peft,accelerate,lightning]"
	touch $@

demo: $(STAMP)-core
	$(PY) -m gradroute demo $(DEMO_ARGS)

test: $(STAMP)-test
	$(PY) -m pytest $(PYTEST_ARGS)

lint: $(STAMP)-test
	$(PY) -m ruff check src tests examples benchmarks
	$(PY) -m ruff format --check src tests examples benchmarks

typecheck: $(STAMP)-test
	$(PY) -m mypy

bench: $(STAMP)-core
	PY=$(PY) bash benchmarks/run.sh

clean:
	rm -rf $(VENV) .pytest_cache .mypy_cache .ruff_cache
