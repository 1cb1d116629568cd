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

.PHONY: install run test test-fast lint clean gpu-check

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

# The fault-tolerant local cluster (embedded etcd, a controller, 2 nodes + 1 spare, CPU) with one
# fault: detection, self-check and recovery in ~20-40 s. `make run ARGS=...` adds launch options.
run: $(STAMP)
	$(VENV)/bin/megascale launch --nodes 2 --nproc-per-node 1 --spares 1 \
		--inject kill-worker:rank=1,step=25 $(ARGS)

test: $(STAMP)
	scripts/install-test-deps.sh
	$(PY) -m pytest -q $(PYTEST_ARGS)

test-fast: $(STAMP)
	$(PY) -m pytest -q -m "not slow" $(PYTEST_ARGS)

# The GPU test tier and the GPU benchmarks as one Markdown block (scripts/gpu-check); on a machine
# without a GPU it says so and does nothing.
gpu-check: $(STAMP)
	PYTHON=$(PY) scripts/gpu-check

lint: $(STAMP)
	$(VENV)/bin/ruff check megascale tests benchmarks
	$(VENV)/bin/ruff format --check megascale tests benchmarks

clean:
	rm -rf $(VENV) runs .pytest_cache
