# Two commands on a fresh machine: `make run` (the whole stack) and `make test` (every test).
# Each installs what it needs into a local venv first, quietly: `make run` the service's dependencies
# (the `server` extra and torch), `make test` the rest (the `dev` extra). torch is pinned to the CPU wheel here.
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
TORCH_PIN ?= torch==2.13.0
PIP := $(PY) -m pip install -q --disable-pip-version-check

.PHONY: install install-server run test test-all test-compat check-deps lint-docker zoo wheels bench clean

$(PY):
	@echo "creating $(VENV)/"
	@$(PYTHON) -m venv $(VENV)
	@$(PIP) --upgrade pip

$(VENV)/.installed-server: pyproject.toml Makefile | $(PY)
	@echo "installing the service into $(VENV)/ (the server extra and $(TORCH_PIN); minutes the first time)"
	@$(PIP) "$(TORCH_PIN)"
	@$(PIP) -e '.[server]' "$(TORCH_PIN)"
	@touch $@

$(VENV)/.installed-dev: $(VENV)/.installed-server
	@echo "installing the test dependencies into $(VENV)/ (the dev extra)"
	@$(PIP) -e '.[server,dev]' "$(TORCH_PIN)"
	@# BackPACK (the diagnostics tests' answer key) declares torchvision, which is not needed and would replace torch
	@$(PIP) --no-deps "backpack-for-pytorch>=1.7"
	@touch $@

install-server: $(VENV)/.installed-server

install: $(VENV)/.installed-dev

run: install-server
	$(VENV)/bin/gradsvc up

# Every third-party import declared where it ships (deptry): the server's trees against the bare install and the
# `server` extra ([tool.deptry] in pyproject.toml), then the SDK against the bare install and its own extras (torch,
# progress, plot, client), the server's and the test tools' counting as absent.
check-deps: install
	$(VENV)/bin/deptry gradsvc service workers
	$(VENV)/bin/deptry gradclient --optional-dependencies-dev-groups dev,bench,server

lint-docker: install
	$(VENV)/bin/hadolint Dockerfile

# The test modules run on TEST_PROCS processes (pytest-xdist; each module and its fixtures on one of them):
# `make test TEST_PROCS=0` runs them in this one process.
TEST_PROCS ?= 2
TEST_SPREAD := -n $(TEST_PROCS) --dist loadfile

test: install
	$(PY) -m pytest -q -p no:cacheprovider -m "not slow" $(TEST_SPREAD) --durations=25

test-all: install
	GRADSVC_TEST_ALL=1 $(PY) -m pytest -q -p no:cacheprovider $(TEST_SPREAD)

# The engine's tests on the oldest torch pyproject admits, in a venv of its own (.venv-compat/, ignored): PyPI's
# torch for x86_64 is a CUDA build (~0.8 GB, and its nvidia-* libraries), so this is not part of `make test`;
# CI keeps $(TORCH_PIN). docs/testing.md says when to run it.
COMPAT_VENV ?= .venv-compat
TORCH_OLDEST ?= torch==2.11.0
test-compat:
	@test -x $(COMPAT_VENV)/bin/python || $(PYTHON) -m venv $(COMPAT_VENV)
	@test -f $(COMPAT_VENV)/.installed || { echo "installing $(TORCH_OLDEST) and the dev extra into $(COMPAT_VENV)/"; \
	  $(COMPAT_VENV)/bin/python -m pip install -q --disable-pip-version-check "$(TORCH_OLDEST)" && \
	  $(COMPAT_VENV)/bin/python -m pip install -q --disable-pip-version-check -e '.[dev]' "$(TORCH_OLDEST)" && \
	  $(COMPAT_VENV)/bin/python -m pip install -q --disable-pip-version-check --no-deps "backpack-for-pytorch>=1.7" && \
	  touch $(COMPAT_VENV)/.installed; }
	$(COMPAT_VENV)/bin/python -c "import torch; print('torch', torch.__version__)"
	$(COMPAT_VENV)/bin/python -m pytest -q -p no:cacheprovider tests/gradsvc/engine

# .whl/ (ignored): the server's packages the GPU machine's image lacks, as py3.12 manylinux wheels, for
# bench/gpu_check.sh to install there without the network (docs/testing.md, "On a GPU").
wheels:
	bash bench/gpu_wheels.sh

bench: install
	$(PY) bench/run_all.py

clean:
	rm -rf $(VENV) $(COMPAT_VENV) $(ZOO_VENV) .gradsvc .pytest_cache
