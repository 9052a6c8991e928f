#!/usr/bin/env bash
# Configures and builds reshard into build/ (Release), the kernels for this machine's GPUs
# (scripts/cuda-architectures.sh). Extra arguments go to CMake.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/install-deps.sh
source scripts/cuda-architectures.sh
cmake -S . -B build -G Ninja -DCMAKE_BUILD_TYPE=Release \
  -DCMAKE_CUDA_ARCHITECTURES="$cuda_architectures" "$@" >/dev/null
cmake --build build
