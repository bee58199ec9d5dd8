# `make demo` and `make test` each create .venv if missing and install with constraints.txt.
PY ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed
export HF_HUB_OFFLINE := 1
export TRANSFORMERS_OFFLINE := 1
export RAY_USAGE_STATS_ENABLED := 0

.PHONY: setup test test-all demo bench serve clean

$(STAMP): pyproject.toml constraints.txt
	test -x $(BIN)/python || $(PY) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	$(BIN)/pip install -q -c constraints.txt torch==2.14.1 torchvision==0.29.1
	$(BIN)/pip install -q -c constraints.txt -e ".[dev,imagebind]"
	$(BIN)/pip install -q --no-deps imagebind-unofficial==0.1.1
	touch $(STAMP)

setup: $(STAMP)

# Two tiers (README "Development"). `make test`, the default tier: unit and in-process tests plus
# the smoke graph on one shared local Ray cluster; `-ra` (pyproject) lists the skips by reason.
# `make test-all`, the integration tier, each part in its own pytest process: every other test
# that needs the Ray cluster (deployed graphs, faults, autoscaling, ETP, the trainer against a
# graph, Ray Train; tests/conftest.py marks them `integration`), the shipped Serve configs on
# fresh clusters, the `network` tests (need the package index; skipped offline) and the
# `cluster` tests (their own two-node cluster on loopback). Exit status 5 = no test selected.
PYTEST := $(BIN)/python -m pytest -q
test: $(STAMP)
	$(PYTEST) --durations=25

test-all: $(STAMP)
	$(PYTEST) --durations=25 -m 'integration and not network and not cluster' \
		--ignore=tests/test_serve_configs.py || [ $$? -eq 5 ]
	$(PYTEST) --durations=10 -m integration tests/test_serve_configs.py || [ $$? -eq 5 ]
	$(PYTEST) --durations=10 -m network || [ $$? -eq 5 ]
	$(PYTEST) --durations=10 -m cluster tests/test_cluster.py || [ $$? -eq 5 ]

demo: $(STAMP)
	$(BIN)/python -m trainer.demo

# Serve the embedded graph on 127.0.0.1:8000 (Ray ports on loopback, dashboard on 127.0.0.1:8265).
serve: $(STAMP)
	RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER=0 RAY_AUTH_MODE=disabled $(BIN)/serve run graph:app

bench: $(STAMP)
	$(BIN)/python -m bench.run_all

clean:
	rm -rf $(VENV) runs/ .pytest_cache
