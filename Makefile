# `make demo` and `make test` each create .venv if missing and install with constraints.txt.
PY ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed
export HF_HUB_OFFLINE := 1
export TRANSFORMERS_OFFLINE := 1
export RAY_USAGE_STATS_ENABLED := 0

.PHONY: setup test demo bench serve clean

$(STAMP): pyproject.toml constraints.txt
	test -x $(BIN)/python || $(PY) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	$(BIN)/pip install -q -c constraints.txt torch==2.14.1 torchvision==0.29.1
	$(BIN)/pip install -q -c constraints.txt -e ".[dev,imagebind]"
	$(BIN)/pip install -q --no-deps imagebind-unofficial==0.1.1
	touch $(STAMP)

setup: $(STAMP)

# The default suite shares one local Ray cluster; the `network` suite needs the package index
# (skipped offline); the `cluster` suite starts its own two-node cluster on loopback, so it runs
# in a pytest process of its own; the `integration` suite starts each shipped Serve config on fresh
# 2-CPU local clusters (`serve run` subprocesses).
test: $(STAMP)
	$(BIN)/python -m pytest -q --durations=25
	$(BIN)/python -m pytest -q --durations=10 -m network
	$(BIN)/python -m pytest -q --durations=10 -m cluster tests/test_cluster.py
	$(BIN)/python -m pytest -q --durations=10 -m integration

demo: $(STAMP)
	$(BIN)/python -m trainer.demo

# Serve the embedded graph on 127.0.0.1:8000 (Ray ports on loopback, dashboard on 127.0.0.1:8265).
serve: $(STAMP)
	RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER=0 RAY_AUTH_MODE=disabled $(BIN)/serve run graph:app

bench: $(STAMP)
	$(BIN)/python -m bench.run_all

clean:
	rm -rf $(VENV) runs/ .pytest_cache
