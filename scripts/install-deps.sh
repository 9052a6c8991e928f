#!/usr/bin/env bash
# Installs what reshard builds with, where it is missing: a C++20 compiler, CMake >= 3.24, Ninja,
# CLI11, GoogleTest, and Open MPI (optional: it enables the MPI bootstrap). Debian/Ubuntu with
# apt-get as root, or pip for CMake and Ninja; otherwise it says what to install.
set -euo pipefail

missing=()
have_header() { echo "#include <$1>" | ${CXX:-c++} -std=c++20 -x c++ -fsyntax-only - 2>/dev/null; }
command -v c++ >/dev/null || missing+=(g++)
have_header CLI/CLI.hpp || missing+=(libcli11-dev)
have_header gtest/gtest.h || missing+=(libgtest-dev)
command -v mpicxx >/dev/null || missing+=(libopenmpi-dev openmpi-bin)

if ((${#missing[@]})); then
  if [[ $(id -u) == 0 ]] && command -v apt-get >/dev/null; then
    echo "reshard: installing ${missing[*]}"
    apt-get update -qq
    DEBIAN_FRONTEND=noninteractive apt-get install -y -qq "${missing[@]}" >/dev/null
  else
    echo "reshard: please install: ${missing[*]} (Debian/Ubuntu package names)" >&2
    exit 1
  fi
fi

cmake_ok() {
  command -v cmake >/dev/null &&
    [[ $(printf '%s\n3.24\n' "$(cmake --version | head -1 | awk '{print $3}')" | sort -V | head -1) == 3.24 ]]
}
if ! cmake_ok || ! command -v ninja >/dev/null; then
  echo "reshard: installing cmake and ninja with pip"
  python3 -m pip install -q "cmake>=3.24" ninja
fi

# With a CUDA compiler, the NCCL transport is built too: NCCL's headers and library come from the
# system or from the nvidia-nccl-cu13 wheel.
have_nccl() {
  [[ -f /usr/include/nccl.h ]] || python3 -c "import nvidia.nccl" 2>/dev/null
}
if command -v nvcc >/dev/null && ! have_nccl; then
  echo "reshard: installing NCCL (nvidia-nccl-cu13) with pip"
  python3 -m pip install -q nvidia-nccl-cu13 || echo "reshard: NCCL not installed; the NCCL transport will be skipped" >&2
fi

# And the NVSHMEM transport: the host library from the nvidia-nvshmem-cu13 wheel, pinned to the
# version the GPU machines run (host and device libraries must match).
if command -v nvcc >/dev/null && ! python3 -c "import nvidia.nvshmem" 2>/dev/null; then
  echo "reshard: installing NVSHMEM (nvidia-nvshmem-cu13==3.4.5) with pip"
  python3 -m pip install -q nvidia-nvshmem-cu13==3.4.5 ||
    echo "reshard: NVSHMEM not installed; the NVSHMEM transport will be skipped" >&2
fi
