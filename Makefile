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
# `make test TEST_PROCS=0` runs them in this one process. Three on two cores: much of an integration test is
# waiting (a stack starting, a lease lapsing), so a third process fills the cores (docs/testing.md).
TEST_PROCS ?= 3
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

# The conformance run over the public zoos (bench/zoo.py, docs/models.md): the libraries and the SDK in a venv of
# their own (.venv-zoo/, ignored, ~5.8 GB): torch 2.14.1 with torchvision 0.29.1 (+cu130, run on the CPU), which timm
# and torchvision need here (PyPI's torchvision does not load beside the CPU wheel of 2.13); the stack on .venv's
# pinned torch, as a user's client and the service may differ. ZOO_ARGS="--zoo transformers --limit 5" for a part.
ZOO_VENV ?= .venv-zoo
ZOO_TORCH ?= torch==2.14.1 torchvision==0.29.1
ZOO_LIBRARIES ?= timm==1.0.31 transformers==5.25.0 diffusers==0.42.1 torch_geometric==2.8.1
ZOO_ARGS ?=
zoo: install-server
	@test -x $(ZOO_VENV)/bin/python || $(PYTHON) -m venv $(ZOO_VENV)
	@test -f $(ZOO_VENV)/.installed || { echo "installing $(ZOO_TORCH) and the zoos into $(ZOO_VENV)/ (minutes)"; \
	  $(ZOO_VENV)/bin/python -m pip install -q --disable-pip-version-check $(ZOO_TORCH) && \
	  $(ZOO_VENV)/bin/python -m pip install -q --disable-pip-version-check $(ZOO_LIBRARIES) -e . $(ZOO_TORCH) && \
	  touch $(ZOO_VENV)/.installed; }
	$(ZOO_VENV)/bin/python bench/zoo.py --server-python $(PY) $(ZOO_ARGS)

# .whl/ (ignored): the server's packages the GPU machine's image lacks, as py3.12 manylinux wheels, for
# bench/gpu_check.sh to install there without the network (docs/testing.md, "On a GPU").
wheels:
	bash bench/gpu_wheels.sh

bench: install
	$(PY) bench/run_all.py

clean:
	rm -rf $(VENV) $(COMPAT_VENV) $(ZOO_VENV) .gradsvc .pytest_cache
