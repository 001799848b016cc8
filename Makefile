# chatroute: `make run` starts the service on the example config, `make test` runs the suite.
PY ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed
export HF_HUB_OFFLINE := 1
export TRANSFORMERS_OFFLINE := 1
export TOKENIZERS_PARALLELISM := false

.PHONY: install run demo test test-deps lint typecheck bench bench-core bench-routing bench-service bench-solo bench-traced bench-compare bench-soak bench-shared bench-peers peers clean

$(BIN)/python:
	$(PY) -m venv $(VENV)
	$(BIN)/pip install --quiet --upgrade pip

# torch is pinned to the CPU build first so that no multi-GB CUDA wheel is pulled in.
$(STAMP): pyproject.toml | $(BIN)/python
	$(BIN)/pip install --quiet "torch==2.13.0"
	$(BIN)/pip install --quiet -e ".[dev,anthropic,redis,ray,otel]"
	touch $(STAMP)

install: $(STAMP)

run: $(STAMP)
	$(BIN)/chatroute serve --config examples/chatroute.yaml

demo: $(STAMP)
	$(BIN)/python -m chatroute.demo

lint: $(STAMP)
	$(BIN)/ruff check chatroute tests bench
	$(BIN)/ruff format --check chatroute tests bench

typecheck: $(STAMP)
	$(BIN)/mypy

# pytest keeps the test modules it has rewritten (for its assert messages) as bytecode
# under __pycache__/, unless PYTHONDONTWRITEBYTECODE is set: then each of its worker
# processes rewrites them all again on every run (seconds of CPU each).
test: $(STAMP) test-deps lint typecheck
	env -u PYTHONDONTWRITEBYTECODE $(BIN)/python -m pytest -q

# The tests start real redis-server processes (the breaker state replicas share): the
# Debian package is installed when the binary is missing.
SUDO := $(shell [ "$$(id -u)" = 0 ] || echo sudo)
test-deps:
	@command -v redis-server >/dev/null 2>&1 || { \
		echo "installing redis-server (Debian package) for the tests"; \
		$(SUDO) apt-get update -qq && \
		DEBIAN_FRONTEND=noninteractive $(SUDO) apt-get install -y -qq redis-server >/dev/null; }

# The benchmarks run in their own environment: the bench extra brings semantic-router
# 1.1.1 (compared side by side), whose pins differ from the service's newest openai.
BENCH_VENV := .venv-bench
BENCH_STAMP := $(BENCH_VENV)/.installed

$(BENCH_STAMP): pyproject.toml
	$(PY) -m venv $(BENCH_VENV)
	$(BENCH_VENV)/bin/pip install --quiet --upgrade pip
	$(BENCH_VENV)/bin/pip install --quiet "torch==2.13.0"
	$(BENCH_VENV)/bin/pip install --quiet -e ".[bench]"
	touch $(BENCH_STAMP)

bench-core: $(STAMP)
	$(BIN)/python bench/failover_overhead.py

bench-routing: $(BENCH_STAMP)
	$(BENCH_VENV)/bin/python bench/routing_clinc150.py

# The service's targets, then the floor under the proxy-overhead one (what each layer of the
# serving stack adds with no chatroute code at all), then what chatroute's own steps of a
# call cost with the CPU caches warm and cold, alone and inside a real call.
bench-service: $(STAMP)
	$(BIN)/python bench/service_bench.py
	$(BIN)/python bench/proxy_floor.py
	$(BIN)/python bench/cold_path.py
	$(BIN)/python bench/chat_path_layers.py

# The proxy overhead of this tree against another git revision, both in one run (the
# machine's speed drifts between runs): make bench-compare AGAINST=<revision>
bench-compare: $(STAMP)
	$(BIN)/python bench/proxy_compare.py --against $(AGAINST)

# A lone decision with the embedder's solo passes off and on, each arm in its own process,
# and /v1/route one request at a time against a service with each setting.
bench-solo: $(STAMP)
	$(BIN)/python bench/solo_passes.py

# The embedder's packed pass eager and traced, alone and beside a busy Python thread.
bench-traced: $(STAMP)
	$(BIN)/python bench/traced_pass.py

# 200 streaming clients for 5 minutes through the real service, 2% injected faults.
bench-soak: $(STAMP)
	$(BIN)/python bench/load_soak.py

# How soon a breaker opened (or closed) on one replica reaches another through a real
# redis-server that the bench starts.
bench-shared: $(STAMP) test-deps
	$(BIN)/python bench/shared_breaker.py

# Peer gateways on this machine, side by side with chatroute (bench/peer_overhead.py).
# They live outside the project's environments: LiteLLM's proxy in its own virtual
# environment, Portkey's gateway (Node) under .peers/.
PEERS_VENV := .venv-peers
LITELLM_VERSION := 1.105.0
PORTKEY_VERSION := 1.15.2

$(PEERS_VENV)/.installed:
	$(PY) -m venv $(PEERS_VENV)
	$(PEERS_VENV)/bin/pip install --quiet "litellm[proxy]==$(LITELLM_VERSION)"
	touch $@

.peers/.installed:
	npm install --prefix .peers --no-audit --no-fund --silent "@portkey-ai/gateway@$(PORTKEY_VERSION)"
	touch $@

peers: $(PEERS_VENV)/.installed .peers/.installed

bench-peers: $(STAMP) peers
	$(BIN)/python bench/peer_overhead.py

bench: bench-core bench-routing bench-service bench-solo bench-traced bench-soak bench-shared

clean:
	rm -rf $(VENV) $(BENCH_VENV) $(PEERS_VENV) .peers .mypy_cache .ruff_cache .pytest_cache
