# Two commands on a fresh machine: `make run` (the whole stack) and `make test` (every test).
# Each installs what it needs into a local venv first; torch is pinned to the CPU wheel here.
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
TORCH_PIN ?= torch==2.13.0

.PHONY: install run test test-all bench clean

$(VENV)/.installed: pyproject.toml Makefile
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q "$(TORCH_PIN)"
	$(PY) -m pip install -q -e '.[server,dev]' "$(TORCH_PIN)"
	touch $@

install: $(VENV)/.installed

run: install
	$(VENV)/bin/gradsvc up

test: install
	$(PY) -m pytest -q -p no:cacheprovider -m "not slow"

test-all: install
	GRADSVC_TEST_ALL=1 $(PY) -m pytest -q -p no:cacheprovider

bench: install
	$(PY) bench/run_all.py

clean:
	rm -rf $(VENV) .gradsvc .pytest_cache
