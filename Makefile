# Two commands on a fresh machine:  `make run` (train the default config) and `make test`.
# Both create .venv and install everything on first use.

VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed
# The CPU build of torch goes in first on machines without a GPU: an unpinned torch (pulled in by
# megatron-core) would otherwise fetch several GB of CUDA packages. Override for other machines,
# e.g. make TORCH_SPEC=torch==2.13.0 TORCH_PIP_ARGS="--index-url <PyTorch's CPU wheel index>".
TORCH_SPEC ?= torch==2.13.0
TORCH_PIP_ARGS ?=
HAVE_GPU := $(shell command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L >/dev/null 2>&1 && echo 1)

# The second environment CI runs (`make test-compat`): Python 3.12, the CUDA build of torch that a
# plain `pip install torch` gives (on a machine without a driver here), and the newest
# megatron-core the project allows. Other rows of the support table, e.g.
#   make test-compat COMPAT_PYTHON=python3.11 COMPAT_VENV=.venv-compat-311
#   make test-compat COMPAT_MCORE=megatron-core==0.16.1 COMPAT_VENV=.venv-compat-mc016
# (default interpreter: pyenv's newest 3.12, else python3.12 on PATH).
COMPAT_PYTHON ?= $(shell for p in $$(ls -d $(HOME)/.pyenv/versions/3.12.*/bin/python3.12 2>/dev/null | sort -V -r) \
	$$(command -v python3.12); do "$$p" -c "" 2>/dev/null && echo "$$p" && break; done)
COMPAT_VENV ?= .venv-py312
COMPAT_MCORE ?= megatron-core
COMPAT_FREE_GB ?= 8
COMPAT_TESTS ?= tests/unit tests/distributed/test_fork_safety.py tests/distributed/test_cli.py \
	tests/distributed/test_equivalence.py \
	tests/distributed/test_reshard.py::test_resume_at_another_layout_matches_the_uninterrupted_run \
	tests/fault/test_cluster.py::test_kill_worker_detected_named_recovered \
	tests/distributed/test_wheel.py

# The GPU kit for a GPU machine without network: `make gpu-bundle` writes the wheels it lacks into
# .gpu-bundle/ (travels with the working tree); `make gpu-rehearse` installs that bundle here as the
# GPU machine will (Python 3.12, torch $(REHEARSE_TORCH) and the image's other packages,
# `pip install --no-index --no-deps --target`) and starts every step of the plan without a GPU.
REHEARSE_VENV ?= .venv-gpu-rehearse
REHEARSE_TORCH ?= torch==2.11.0
REHEARSE_IMAGE ?= numpy prometheus-client psutil transformers safetensors tokenizers tensorboard

.PHONY: install run test test-fast test-compat lint clean gpu-check gpu-bundle gpu-rehearse

install: $(STAMP)

$(STAMP): pyproject.toml
	test -x $(PY) || python3 -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
ifeq ($(HAVE_GPU),)
	$(PY) -m pip install -q $(TORCH_PIP_ARGS) "$(TORCH_SPEC)"
endif
ifeq ($(HAVE_GPU),)
	$(PY) -m pip install -q -e ".[dev]"
else
	@# A GPU machine: the gpu extra too (Transformer Engine, NVML bindings), for tests/gpu and
	@# scripts/gpu-check. Never on a CPU machine (see below).
	$(PY) -m pip install -q -e ".[dev,gpu]"
endif
	@# Transformer Engine must never be in a CPU environment: a broken TE breaks megatron.core.
	@if [ -z "$(HAVE_GPU)" ] && $(PY) -c "import importlib.util,sys; sys.exit(importlib.util.find_spec('transformer_engine') is None)"; then \
		echo "transformer_engine is installed in $(VENV) on a machine without a GPU: remove it (pip uninstall transformer-engine transformer-engine-torch)"; exit 1; fi
	touch $(STAMP)

$(COMPAT_VENV)/.installed: pyproject.toml
	@test -n "$(COMPAT_PYTHON)" || { echo "test-compat: no Python 3.12 here; set COMPAT_PYTHON=/path/to/python3.12"; exit 1; }
	test -x $(COMPAT_VENV)/bin/python || $(COMPAT_PYTHON) -m venv $(COMPAT_VENV)
	$(COMPAT_VENV)/bin/python -m pip install -q --upgrade pip
	@# Unpinned on purpose: what `pip install torch` gives a user (a CUDA build), GPU or not. It
	@# takes ~6 GB here (5.4 GB installed); pip's cache would hold ~3 GB more of its wheels.
	@free=$$(df -Pk . | awk 'NR==2 {print int($$4 / 1048576)}'); \
	if ! $(COMPAT_VENV)/bin/python -c "import torch" 2>/dev/null && [ "$$free" -lt $(COMPAT_FREE_GB) ]; then \
		echo "test-compat: the CUDA build of torch needs about $(COMPAT_FREE_GB) GB free in $(CURDIR); $$free GB free"; exit 1; fi
	$(COMPAT_VENV)/bin/python -m pip install -q --no-cache-dir torch
	$(COMPAT_VENV)/bin/python -m pip install -q --upgrade -e ".[dev]" "$(COMPAT_MCORE)"
	@if $(COMPAT_VENV)/bin/python -c "import importlib.util,sys; sys.exit(importlib.util.find_spec('transformer_engine') is None)"; then \
		echo "transformer_engine is installed in $(COMPAT_VENV): remove it"; exit 1; fi
	touch $@

# The fault-tolerant local cluster (embedded etcd, a controller, 2 nodes + 1 spare, CPU) with one
# fault: detection, self-check and recovery in ~20-40 s. `make run ARGS=...` adds launch options.
run: $(STAMP)
	$(VENV)/bin/megascale launch --nodes 2 --nproc-per-node 1 --spares 1 \
		--inject kill-worker:rank=1,step=25 $(ARGS)

# tests/k8s/apiserver/build.sh: the real Kubernetes CRD API server from Debian's Go sources for
# tests/k8s/test_apiserver.py, built once (a few minutes) and cached under ~/.cache/megascale;
# where it cannot be built (no network, Debian sid's packages uninstallable for a day) those tests
# skip with the build's one-line reason, in CI too: a moving third-party archive must not fail CI.
test: $(STAMP)
	scripts/install-test-deps.sh
	@tests/k8s/apiserver/build.sh >/dev/null || echo "make test: the real Kubernetes API server was not built (the reason above); tests/k8s/test_apiserver.py skips"
	$(PY) -m pytest -q $(PYTEST_ARGS)

# Python 3.12 x CUDA torch x the newest megatron-core: the unit tests, multi-rank training (TP2 +
# SP among them), a resume at another layout, `megascale launch` with a killed worker, the CPU
# backend's guard against new CUDA call sites, fork safety without a driver, and the wheel.
test-compat: $(COMPAT_VENV)/.installed
	scripts/install-test-deps.sh
	$(COMPAT_VENV)/bin/python -c "import sys, torch, megatron.core as m; print('test-compat: Python', sys.version.split()[0], '| torch', torch.__version__, '| megatron-core', m.__version__)"
	$(COMPAT_VENV)/bin/python -m pytest -q $(COMPAT_TESTS) $(PYTEST_ARGS)

test-fast: $(STAMP)
	$(PY) -m pytest -q -m "not slow" $(PYTEST_ARGS)

# The GPU test tier and the GPU benchmarks as one Markdown block (scripts/gpu-check); on a machine
# without a GPU it says so and does nothing.
gpu-check: $(STAMP)
	PYTHON=$(PY) scripts/gpu-check

gpu-bundle:
	scripts/gpu-bundle

$(REHEARSE_VENV)/.installed:
	@test -n "$(COMPAT_PYTHON)" || { echo "gpu-rehearse: no Python 3.12 here; set COMPAT_PYTHON=/path/to/python3.12"; exit 1; }
	test -x $(REHEARSE_VENV)/bin/python || $(COMPAT_PYTHON) -m venv $(REHEARSE_VENV)
	$(REHEARSE_VENV)/bin/python -m pip install -q "$(REHEARSE_TORCH)" $(REHEARSE_IMAGE)
	touch $@

gpu-rehearse: $(REHEARSE_VENV)/.installed gpu-bundle
	rm -rf $(REHEARSE_VENV)/bundle-site
	$(REHEARSE_VENV)/bin/python -m pip install -q --no-index --no-deps --target $(REHEARSE_VENV)/bundle-site .gpu-bundle/*.whl
	PYTHONPATH=$(CURDIR)/$(REHEARSE_VENV)/bundle-site $(REHEARSE_VENV)/bin/python scripts/gpu_check.py --rehearse 1 --quick
	PYTHONPATH=$(CURDIR)/$(REHEARSE_VENV)/bundle-site $(REHEARSE_VENV)/bin/python scripts/gpu_check.py --rehearse 8 --quick

lint: $(STAMP)
	$(VENV)/bin/ruff check megascale tests benchmarks
	$(VENV)/bin/ruff format --check megascale tests benchmarks

clean:
	rm -rf $(VENV) $(COMPAT_VENV) runs .pytest_cache
