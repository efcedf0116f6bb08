#!/usr/bin/env bash
# Install what budgetq needs on a fresh machine: redis-server (Debian package, when missing), a virtualenv in the
# checkout (.venv; VENV=none: the Python on PATH) and the project with its test extra in it; with BUDGETQ_TEST_DEPS=1 (`make test`) also chromium, which only the dashboard's
# browser test needs. Safe to run again: it skips what is already there.
set -euo pipefail
cd "$(dirname "$0")/.."

# apt_install COMMAND PACKAGE: install the Debian package when COMMAND is missing.
apt_install() {
  command -v "$1" >/dev/null 2>&1 && return 0
  if command -v apt-get >/dev/null 2>&1; then
    echo "bootstrap: installing $2 with apt-get" >&2
    SUDO=""
    [ "$(id -u)" -eq 0 ] || SUDO="sudo"
    $SUDO apt-get update -qq
    DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq "$2" >/dev/null
  else
    echo "bootstrap: $1 is missing and apt-get is not available; install $2" >&2
    exit 1
  fi
}

apt_install redis-server redis-server
if [ "${BUDGETQ_TEST_DEPS:-0}" = "1" ]; then
  apt_install chromium chromium
fi

PY="${PYTHON:-python3}"
# The project's own virtualenv (VENV, .venv by default; the Makefile puts its bin/ first on PATH): made once with
# the Python given, then everything below installs into it. VENV=none installs into that Python itself.
VENV="${VENV:-.venv}"
if [ "$VENV" != "none" ]; then
  if [ ! -x "$VENV/bin/python" ]; then
    echo "bootstrap: creating the virtualenv $VENV" >&2
    "$PY" -m venv "$VENV"  # the Python on PATH: the venv's own bin/ is not there yet
  fi
  PY="$VENV/bin/python"
  BIN="$VENV/bin/"
else
  BIN=""
fi
# Reinstall unless this very checkout is the one installed (an editable install of another clone would
# otherwise be what the tests import). Checked from / as well, where the current directory is not on sys.path: an
# editable install made before a top-level package was added (render/) does not map it, and a worker or `produce`
# started outside the checkout could not import it.
here="$(pwd -P)"
if ! "$PY" -c "import sys, budget, pytest, hypothesis, pytest_timeout, xdist, msgspec, sglang_router, ruff; sys.exit(not budget.__file__.startswith('$here/'))" \
     >/dev/null 2>&1 || ! command -v "${BIN}produce" >/dev/null 2>&1 || ! command -v "${BIN}rq" >/dev/null 2>&1 \
   || ! (cd / && "$PY" -c "import sys, render; sys.exit(not render.__file__.startswith('$here/'))" >/dev/null 2>&1); then
  echo "bootstrap: pip install -e '.[test]'" >&2
  "$PY" -m pip install -q -e '.[test]'
fi

# SGLang's own request schema for the contract test (tests/sglang_schema.py), never a runtime dependency:
# the wheel without its dependencies (torch, CUDA kernels...); the test extra brings msgspec, all it needs.
# Only with BUDGETQ_TEST_DEPS=1 (make test, CI), so `make demo` stays light; the test fails without it.
SGLANG_SCHEMA_VERSION=0.5.23
if [ "${BUDGETQ_TEST_DEPS:-0}" = "1" ] && \
   ! "$PY" -c "import importlib.metadata as m, sys; sys.exit(m.version('sglang') != '$SGLANG_SCHEMA_VERSION')" \
     >/dev/null 2>&1; then
  echo "bootstrap: pip install --no-deps sglang==$SGLANG_SCHEMA_VERSION (schema only, for the tests)" >&2
  "$PY" -m pip install -q --no-deps "sglang==$SGLANG_SCHEMA_VERSION"
fi

# The trainers' data code for the consumer test (tests/e2e/test_trainers.py): SpecForge's and speculators' own
# preprocessing reads budgetq's exports. Their wheels without their dependencies (CUDA kernels, vLLM clients,
# trackers...), as the SGLang wheel above; the test extra brings the light modules their data code imports
# (httpx, openai). Their data code needs torch: the CPU wheel (192 MB, 761 MB installed, about a minute), --no-deps
# into a directory of its own that only the test's trainer subprocess puts on its path, so that no budgetq
# process imports it (transformers would, at every tokenizer load). Only with BUDGETQ_TEST_DEPS=1.
SPECFORGE_VERSION=0.2.0
SPECULATORS_VERSION=0.9.0
TRAINER_TORCH_VERSION=2.13.0+cpu
TRAINER_TORCH_DIR="${BUDGETQ_TRAINER_TORCH:-${XDG_CACHE_HOME:-$HOME/.cache}/budgetq/trainer-torch-$TRAINER_TORCH_VERSION}"
if [ "${BUDGETQ_TEST_DEPS:-0}" = "1" ]; then
  if ! "$PY" -c "import importlib.metadata as m, sys; sys.exit(m.version('specforge') != '$SPECFORGE_VERSION' or m.version('speculators') != '$SPECULATORS_VERSION')" \
       >/dev/null 2>&1; then
    echo "bootstrap: pip install --no-deps specforge==$SPECFORGE_VERSION speculators==$SPECULATORS_VERSION (data code only, for the tests)" >&2
    "$PY" -m pip install -q --no-deps "specforge==$SPECFORGE_VERSION" "speculators==$SPECULATORS_VERSION"
  fi
  # torch's own pure-Python dependencies that the venv does not already have (sympy, mpmath, networkx) go
  # beside it: --no-deps keeps its CUDA packages out, and without them `import torch` fails in the trainers.
  if [ ! -f "$TRAINER_TORCH_DIR/.complete-with-deps" ]; then
    echo "bootstrap: pip install --no-deps --target $TRAINER_TORCH_DIR torch==$TRAINER_TORCH_VERSION sympy mpmath networkx (for the trainers' data code only)" >&2
    rm -rf "$TRAINER_TORCH_DIR"
    "$PY" -m pip install -q --no-deps --target "$TRAINER_TORCH_DIR" "torch==$TRAINER_TORCH_VERSION" sympy mpmath networkx
    touch "$TRAINER_TORCH_DIR/.complete-with-deps"
  fi
fi
