#!/usr/bin/env bash
# Makes build/pyenv, a virtual environment holding what the Python package builds and tests with
# (scikit-build-core, nanobind, pytest, NumPy, JAX, matplotlib, PyTorch's CPU build,
# megatron-core; NCCL's wheel where CUDA is present), and installs the package into it from this
# checkout. Prints nothing on success.
set -euo pipefail
cd "$(dirname "$0")/.."
env_dir=build/pyenv
if [[ ! -x $env_dir/bin/python ]]; then
  if ! python3 -m venv "$env_dir" >/dev/null 2>&1; then
    if [[ $(id -u) == 0 ]] && command -v apt-get >/dev/null; then
      rm -rf "$env_dir"
      apt-get update -qq
      DEBIAN_FRONTEND=noninteractive apt-get install -y -qq python3-venv >/dev/null
      python3 -m venv "$env_dir"
    else
      echo "reshard: python3 -m venv failed; install python3-venv" >&2
      exit 1
    fi
  fi
  # JAX (CPU) checks that its arrays cross through DLPack too.
  # matplotlib: `reshard bench plot` is tested on the recorded results.
  wheels=("scikit-build-core>=0.10" "nanobind>=2.4" pytest numpy jax matplotlib)
  command -v nvcc >/dev/null && wheels+=(nvidia-nccl-cu13 nvidia-nvshmem-cu13==3.4.5)
  "$env_dir/bin/python" -m pip install -q --upgrade pip >/dev/null
  "$env_dir/bin/python" -m pip install -q "${wheels[@]}"
  # PyTorch's CPU build and Megatron-LM's core: the Megatron tests run Megatron's own refit
  # (swap_model_weights) through reshard. Pinned: an unpinned torch would pull a CUDA build of
  # several GB; megatron-core without its extras needs only packaging and einops beside torch.
  # Without them those tests skip.
  if "$env_dir/bin/python" -m pip install -q "torch==2.13.0" packaging einops; then
    "$env_dir/bin/python" -m pip install -q --no-deps "megatron-core==0.16.1" ||
      echo "reshard: megatron-core not installed; its tests will skip" >&2
  else
    echo "reshard: PyTorch not installed; its tests will skip" >&2
  fi
fi
# Without build isolation the build uses the environment's scikit-build-core and nanobind; PATH
# puts its Python first for CMake. The build folder stays under build/ between runs (a plain
# `pip install .` builds in a temporary one), and the kernels are built for this machine's GPUs.
source scripts/cuda-architectures.sh
PATH="$PWD/$env_dir/bin:$PATH" "$env_dir/bin/python" -m pip install -q --no-build-isolation \
  --config-settings=build-dir=build/pip \
  --config-settings=cmake.define.CMAKE_CUDA_ARCHITECTURES="$cuda_architectures" .
