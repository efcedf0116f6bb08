.PHONY: setup install demo test typecheck chaos compose-smoke sglang-cpu-smoke clean distclean

# Everything runs in a virtualenv inside this checkout (VENV, made by scripts/bootstrap.sh), so `make demo` and
# `make test` never re-point another environment's packages at this clone; its bin/ goes first on PATH, so the
# `rq`, `produce` and `python3` the tests start are the venv's. VENV=none uses the Python on PATH as it is.
VENV ?= .venv
ifneq ($(VENV),none)
export PATH := $(abspath $(VENV))/bin:$(PATH)
endif
PYTHON ?= python3
export VENV

# Idempotent: redis-server via apt-get when missing, the venv when missing, and `pip install -e '.[test]'` into it
# unless this checkout is installed there.
setup:
	PYTHON=$(PYTHON) bash scripts/bootstrap.sh

install: setup

# Private redis-server, sglang-sim and 3 rq workers on 127.0.0.1, then produce on demo/data.
demo: setup
	$(PYTHON) -m demo.run

# What CI runs (.ci/run): ruff, mypy, then the whole suite. BUDGETQ_TEST_DEPS=1 also installs what only tests need
# (chromium, for tests/redis/test_dashboard.py's browser test), so `make demo` stays light. The suite runs on
# TEST_WORKERS pytest-xdist processes (mostly waiting on real processes, so more than the cores), handed out one test
# at a time, e2e tests first (tests/conftest.py). No test asserts a speed (speed targets live in bench/,
# docs/performance.md), so none has to run alone.
TEST_WORKERS ?= 4

test:
	BUDGETQ_TEST_DEPS=1 PYTHON=$(PYTHON) bash scripts/bootstrap.sh
	$(PYTHON) -m ruff check .
	$(PYTHON) -m mypy
	$(PYTHON) -m pytest -q -n $(TEST_WORKERS) --dist load --maxschedchunk 1

typecheck:
	$(PYTHON) -m mypy

# Fault injection, full form (20,000 prompts, 4 workers; heavy: ~30 min): tests/chaos/, whose "ci" form
# tests/chaos/test_chaos.py runs in `make test`. See docs/reliability.md.
chaos:
	$(PYTHON) -m tests.chaos --full

# docker-compose.yml with real containers (rootful podman + podman-compose, installed when missing): build,
# sim profile, the deployment doc's quick start, output and dashboard-auth checks, teardown. Opt-in, not CI:
# root, 4-5 min and ~1.3 GB cold. See docs/deployment.md "Smoke test with real containers".
compose-smoke:
	$(PYTHON) -m bench.compose_smoke $(SMOKE_ARGS)

clean:
	rm -rf .demo out .pytest_cache .mypy_cache build  # the venv stays: make distclean
	find budget producer render worker sglang_sim demo tests -name __pycache__ -type d -prune -exec rm -rf {} +

distclean: clean
	rm -rf .venv

# The real SGLang engine (PyPI's sglang 0.5.23) on this machine's CPU with a tiny random Qwen3, budgetq end to end
# against it (real rq workers, kill -9, --generations 2, exports), the contract recorded to FIXTURES
# (FIXTURES=tests/fixtures/sglang_real re-records the repository's, which tests/unit/test_sim_contract_real.py replays).
# Opt-in, not CI: cold ~15 min on an idle machine (a ~10 min C++ build of SGLang's CPU kernels), 40-70 min measured
# on busy shared ones (everything under nice 19), ~7 GB under SGLANG_CPU_CACHE; warm 7-11 min measured there.
# KERNEL_SRC: SGLang's python/sglang/kernels/aot tree (bench/sglang_cpu_env.py says how to bring it in with fetch).
# See docs/simulator.md "Against the real engine".
SGLANG_CPU_CACHE ?= /work/cache/sglang-cpu
KERNEL_SRC ?= $(SGLANG_CPU_CACHE)/src/python/sglang/kernels/aot
FIXTURES ?= $(SGLANG_CPU_CACHE)/fixtures

sglang-cpu-smoke:
	$(PYTHON) -m bench.sglang_cpu_smoke --cache $(SGLANG_CPU_CACHE) --kernel-src $(KERNEL_SRC) \
		--record-fixtures $(FIXTURES) $(SMOKE_ARGS)
