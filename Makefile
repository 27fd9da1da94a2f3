# The two commands a newcomer runs: `make demo` and `make test`. Each sets itself up.
VENV ?= .venv
PY := $(VENV)/bin/python

.PHONY: venv system demo test lint unit bench clean

venv:
	@./scripts/setup-venv.sh

# System packages the tests use (redis-server, redis-cli, redis-benchmark); no-op when present.
system:
	@./scripts/setup-system.sh

demo: venv
	$(PY) -m lmtier demo

lint: venv
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .

unit: venv system
	$(PY) -m pytest -q $(PYTEST_ARGS)

test: lint unit

bench: venv system
	$(PY) benchmarks/bench_cpu_tier.py
	$(PY) benchmarks/bench_disk_tier.py
	$(PY) benchmarks/bench_redis_tier.py
	$(PY) benchmarks/bench_grpc_tier.py
	$(PY) benchmarks/load_server.py
	$(PY) benchmarks/bench_vllm_ttft.py

clean:
	rm -rf $(VENV) .pytest_cache .ruff_cache build *.egg-info
