# Two commands for a newcomer:  make demo   and   make test
# (each sets up the virtualenv first; Python 3.11+ is all they need).
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed-stamp

.PHONY: setup system-deps demo serve test lint unit integration e2e claims protos clean

# Debian packages the tests use, as command:package. Installed when missing (as root, or with sudo).
SYSTEM_TOOLS := docker-compose:docker-compose promtool:prometheus redis-server:redis-server tmux:tmux wrk:wrk

$(STAMP): pyproject.toml
	python3 -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q -e '.[dev]'
	touch $(STAMP)

setup: $(STAMP)

system-deps:
	@missing=""; for pair in $(SYSTEM_TOOLS); do \
	  command -v "$${pair%%:*}" >/dev/null || missing="$$missing $${pair##*:}"; done; \
	if [ -n "$$missing" ]; then \
	  echo "installing Debian packages:$$missing"; \
	  sudo=$$( [ "$$(id -u)" = 0 ] || echo sudo ); \
	  $$sudo apt-get update -qq && \
	  DEBIAN_FRONTEND=noninteractive $$sudo apt-get install -y -qq --no-install-recommends $$missing; \
	fi

# The same 1.5x overload of a simulated 70B backend, without and with extproc (about 2.5 minutes):
# prints a side-by-side table, writes bench/results/demo.json and demo.png.
demo: setup
	$(VENV)/bin/extproc demo

# extproc (examples/policy.yaml) + Envoy (envoy/envoy.yaml) on 127.0.0.1:10000, in front of
# an OpenAI-compatible backend on 127.0.0.1:8000. Ctrl-C stops both.
serve: setup
	@trap 'kill 0' EXIT INT TERM; \
	$(VENV)/bin/extproc serve --policy examples/policy.yaml --log-format console & \
	$(VENV)/bin/envoy -c envoy/envoy.yaml --log-level warn --concurrency 1

lint: setup
	$(VENV)/bin/ruff check .
	$(VENV)/bin/mypy

# Two workers (pytest-xdist), a test module to each at a time: most tests wait on real processes.
test: lint system-deps
	$(VENV)/bin/pytest -n 2 --dist loadfile

unit: setup
	$(VENV)/bin/pytest tests/unit

integration: setup
	$(VENV)/bin/pytest tests/integration

e2e: setup
	$(VENV)/bin/pytest tests/e2e

# Figures the docs quote: rerun the simulator's (bench/simulate_claims.py: its claims and the Azure
# trace replays, about 2 minutes, deterministic but for wall times) into bench/results/, then check
# every marked figure in README.md and docs/ against its results file (bench/claims.py; live
# benchmarks' files are checked, not rerun).
claims: setup
	$(PY) bench/simulate_claims.py
	$(PY) bench/claims.py

# Regenerate extproc/api from protos/ after editing a .proto (the generated code is checked in;
# tests/unit/test_protos.py fails when it does not match).
PROTOS := $(shell find protos -name '*.proto')
protos: setup
	$(PY) -m grpc_tools.protoc -Iprotos --python_out=. --pyi_out=. --grpc_python_out=. $(PROTOS)

clean:
	rm -rf $(VENV) .pytest_cache .mypy_cache .ruff_cache .hypothesis
