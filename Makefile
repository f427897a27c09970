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

.PHONY: demo test test-torch test-oldest test-matrix lint typecheck docs bench benchmarks-md clean

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

# the suite against other torch releases: noxfile.py's sessions, one venv per release under MATRIX_CACHE (the
# pinned .venv stays as it is); nox itself goes into .venv. Records and JUnit reports: build/torch-matrix/
MATRIX_CACHE ?= $(HOME)/.cache/gradroute-matrix
MATRIX_ARGS ?=
NOX = PIP_CACHE_DIR="$(MATRIX_CACHE)/pip" $(PY) -m nox --envdir "$(MATRIX_CACHE)"

$(STAMP)-nox: $(PY)
	$(PIP) install -q "nox>=2024.3"
	touch $@

# every column against one supported release, its venv kept: e.g. make test-torch TORCH_SPEC="torch==2.6.0"
test-torch: $(STAMP)-nox
	$(NOX) --reuse-existing-virtualenvs -s "tests(torch='$(subst torch==,,$(TORCH_SPEC))')" -- --examples all \
		$(MATRIX_ARGS)

# CI's check of the oldest supported torch: the core test files (no examples), its venv kept between runs
test-oldest: $(STAMP)-nox
	$(NOX) --reuse-existing-virtualenvs -s "tests(torch='2.5.1')" -- --columns core --examples none \
		--results build/torch-oldest $(MATRIX_ARGS)

# every supported torch minor (and the refusal of the last older one), one at a time, each venv deleted after
# its run (about 5 GB each); the table goes to build/torch-matrix/table.md and docs/versions.md
test-matrix: $(STAMP)-nox
	$(NOX) -s tests refused -- --drop $(MATRIX_ARGS); status=$$?; \
		$(PYTHON) tools/versions_table.py --docs docs/versions.md && exit $$status

lint: $(STAMP)-test
	$(PY) -m ruff check src tests examples benchmarks tools noxfile.py
	$(PY) -m ruff format --check src tests examples benchmarks tools noxfile.py

typecheck: $(STAMP)-test
	$(PY) -m mypy

# the docs site (mkdocs.yml: docs/, README.md as its home page, the API reference from the docstrings) into site/,
# every warning an error (a broken link, a docstring mkdocstrings cannot parse, a page left out of the nav)
$(STAMP)-docs: $(STAMP)-core
	$(PIP) install -q -e ".[docs]"
	touch $@

docs: $(STAMP)-docs
	NO_MKDOCS_2_WARNING=1 $(PY) -m mkdocs build --strict

bench: $(STAMP)-core
	PY=$(PY) bash benchmarks/run.sh

# BENCHMARKS.md from the measurement records in benchmarks/results/*.json (tests/test_benchmarks_md.py checks it)
benchmarks-md:
	$(PYTHON) benchmarks/render.py

clean:
	rm -rf $(VENV) .pytest_cache .mypy_cache .ruff_cache site
