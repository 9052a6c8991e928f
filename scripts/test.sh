#!/usr/bin/env bash
# Quick start, the tests: builds reshard and runs every test (unit, multi-process at 1-8 PEs, MPI,
# faults), then installs the Python package into build/pyenv and runs its pytest suite. GPU tests
# report as skipped on machines without a GPU.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/build.sh
ctest --test-dir build --output-on-failure -j "$(nproc)" --timeout 900
bash scripts/python-env.sh
build/pyenv/bin/python -m pytest tests/python -q -rs
