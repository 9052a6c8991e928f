#!/usr/bin/env bash
# On a GPU machine: configures and builds build-gpu (Release, every GPU transport this machine can
# build, and the Python package where nanobind is importable: its GPU tests use PyTorch). Logs go to
# $OUT (default build-gpu/logs); GoogleTest and CLI11 may come from .deps/ where the machine lacks
# them. Used by gpu-validate.sh and gpu-colocated.sh.
set -euo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-build-gpu/logs}
mkdir -p "$OUT"
args=(-DCMAKE_BUILD_TYPE=Release -DCMAKE_CUDA_ARCHITECTURES=native)
[[ -d .deps/cli11 ]] && args+=(-DCMAKE_PREFIX_PATH="$PWD/.deps/cli11")
[[ -d .deps/googletest ]] && args+=(-DRESHARD_GTEST_SOURCE="$PWD/.deps/googletest")
command -v ninja >/dev/null && args+=(-G Ninja)
python3 -m nanobind --cmake_dir >/dev/null 2>&1 &&
  args+=(-DRESHARD_BUILD_PYTHON=ON -DPython_EXECUTABLE="$(command -v python3)")
{ nvidia-smi -L; nvcc --version | tail -1; } >"$OUT/machine.txt" 2>&1 || true
cmake -S . -B build-gpu "${args[@]}" >"$OUT/configure.log" 2>&1 || { cat "$OUT/configure.log"; exit 1; }
cmake --build build-gpu -j "$(nproc)" >"$OUT/build.log" 2>&1 || { tail -50 "$OUT/build.log"; exit 1; }
