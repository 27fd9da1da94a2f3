# The two commands a newcomer runs: `make demo` and `make test`. Each sets itself up.
VENV ?= .venv
PY := $(VENV)/bin/python

.PHONY: venv system demo test check lint docs wheel unit user-envs bench bench-peer gpu-check fuzz clean

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

# The documentation site (mkdocs.yml, docs/) into build/site; strict: a broken link, a missing
# anchor or a page left out of the nav fails it.
docs: venv
	$(VENV)/bin/mkdocs build --strict --quiet --site-dir build/site

# The inner loop (CONTRIBUTING.md): lint and every test that starts no vLLM engine, spread
# over the cores (a file's tests on one worker: they share its servers). A process that
# starts an engine fails under it (tests/engine_guard): a test that needs one carries
# @pytest.mark.engine, and `make test` runs it.
# Workers: one per core for the whole suite (a third on a 2-core machine starved its engines
# beside the environments' matrix); at least three for `make check`, whose tests start no
# engine and spend part of their time waiting on servers (8 min on 2 cores with 2, 6 with 3).
WORKERS ?= auto
CHECK_WORKERS ?= $(shell n=$$(nproc 2>/dev/null || echo 2); [ $$n -lt 3 ] && echo 3 || echo $$n)
check: lint system
	PYTHONPATH=tests/engine_guard $(PY) -m pytest -q -m "not engine" -n $(CHECK_WORKERS) --dist loadfile $(PYTEST_ARGS)

unit: venv system
	$(PY) -m pytest -q -n $(TEST_WORKERS) --dist loadfile $(PYTEST_ARGS)

# The wheel as a user installs it: every module in it, `lmtier serve` started from it.
wheel: venv
	@./scripts/check-wheel.sh

# The whole suite, spread over the cores (a file's tests on one worker: they share its
# engines and servers; the longest files first, tests/conftest.py), and beside it lmtier
# installed into engines' own environments (tests/user_envs.py: the environments made or
# reused, then each cell); the matrix's report is printed after the suite's. The engines'
# environments are begun first (tests/pip_envs.py, standard library only), beside the
# venv's own set-up, lint, docs and the wheel: on a fresh machine those leave a core idle,
# and the environments are mostly downloads. The matrix runs a little below the suite's
# priority: it times nothing and has the suite's length to finish in.
TEST_WORKERS ?= $(WORKERS)
PYTHON ?= python3
test: system
	@mkdir -p build/userenv; \
	$(PYTHON) tests/pip_envs.py build/userenv >build/userenv/envs.log 2>&1 & made=$$!; \
	$(MAKE) --no-print-directory lint docs wheel || { pkill -P $$made; kill $$made; exit 1; }; \
	nice -n 5 $(PY) tests/user_envs.py >build/userenv/matrix.log 2>&1 & matrix=$$!; \
	$(PY) -m pytest -q -n $(TEST_WORKERS) --dist loadfile $(PYTEST_ARGS); unit=$$?; \
	wait $$matrix; envs=$$?; wait $$made; \
	cat build/userenv/envs.log build/userenv/matrix.log; \
	exit $$(( unit || envs ))

# lmtier in vLLM's and SGLang's own environments at their protobuf / grpcio versions
# (the table in docs/install.md).
user-envs: wheel system
	$(PY) tests/user_envs.py

# Every benchmark against its same-run reference: benchmarks/results/results.{json,md}, plots.
bench: venv system
	$(PY) benchmarks/run.py

# Optional: LMCache 0.5.6 against lmtier in the same vLLM engine (its own venv, .venv-peer;
# PEER_ARGS, e.g. "--docs 1 --tokens 1024", for a quick run).
bench-peer: system
	@./scripts/setup-peer-venv.sh
	.venv-peer/bin/python benchmarks/bench_peer.py $(PEER_ARGS)

# On a CUDA machine, from a copy of the repository alone (no venv, no network): the GPU
# suite (tests/gpu) and benchmarks/bench_gpu.py; report in $(OUT)/gpu-check.json.
gpu-check:
	@OUT=$${OUT:-gpu-check} ./scripts/gpu-check.sh

# The fuzzing targets with a longer budget than CI's (FUZZ_EXAMPLES examples per target).
FUZZ_EXAMPLES ?= 5000
fuzz: venv system
	FUZZ_EXAMPLES=$(FUZZ_EXAMPLES) $(PY) -m pytest -q tests/test_fuzz.py tests/test_codec.py tests/test_data_channel_input.py

clean:
	rm -rf $(VENV) .pytest_cache .ruff_cache build *.egg-info
