# Every target creates .venv at the repo root and installs what it needs by itself.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
# torch first, from an explicit spec: on machines whose pip has a local CPU wheel this avoids a multi-GB
# CUDA download. Elsewhere override it, e.g. `make test TORCH_SPEC='torch>=2.9'`.
TORCH_SPEC ?= torch==2.13.0
DEMO_DIR ?= .work/demo-model

.PHONY: venv demo test lint format clean

# the native extension is built by the editable install: sources newer than the stamp rebuild it (a stale one
# lacks the ops' current signatures)
$(VENV)/.installed: pyproject.toml setup.py $(wildcard csrc/*)
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q '$(TORCH_SPEC)' || $(PY) -m pip install -q 'torch>=2.9'
	$(PY) -m pip install -q 'setuptools>=77' wheel
	$(PY) -m pip install -q --no-build-isolation -e '.[dev]'
	touch $@

venv: $(VENV)/.installed

demo: venv
	$(VENV)/bin/weightstream demo --out $(DEMO_DIR)

test: venv
	$(PY) -m pytest -q tests

# ruff: the formatter and linter configured in pyproject.toml; `make format` applies what `make lint` checks.
lint: venv
	$(VENV)/bin/ruff format --check .
	$(VENV)/bin/ruff check .

format: venv
	$(VENV)/bin/ruff format .
	$(VENV)/bin/ruff check --fix .

clean:
	rm -rf $(VENV) .work
