#!/usr/bin/env bash
# On a GPU machine: builds reshard and measures colocated runs, PEs sharing each GPU as RL jobs run
# trainer and engine: the small all-to-all sweep and model refits at 2 and 4 PEs per GPU, with the
# same-device orders (RESHARD_CUDA_SAME_DEVICE: delegate, the default without MPS; stream; kernel),
# without and with MPS. --tests runs the GPU tests first (and the CUDA and NVSHMEM suites again under
# MPS, where every PE's kernel must be resident at once).
# Logs and JSON lines go to $OUT (default build-gpu/logs). Usage: gpu-colocated.sh [--tests];
# MPS="off on" (none: no benchmarks), ORDERS="delegate stream kernel", PES="2 4" (PEs per GPU), TESTS (a
# ctest -R pattern) and FAULTS (a gtest filter of the dead-peer tests) narrow the sweep;
# TRANSFORMS="none mxfp8 mxfp8-receiver fp8-block" and BUDGETS="default unlimited" (staging
# budgets, or sizes such as 1GiB) widen the refits.
set -euo pipefail
cd "$(dirname "$0")/.."
source scripts/gpu-env.sh
bash scripts/gpu-build.sh
commit=$(bash scripts/commit-label.sh)
gpus=$(nvidia-smi -L | wc -l)
status=0
if [[ "${1:-}" == "--tests" ]]; then
  ctest --test-dir build-gpu -L gpu -R "${TESTS:-.}" --output-on-failure --timeout 300 \
    >"$OUT/gpu-tests.log" 2>&1 || status=$?
  grep -E "Test +#|tests passed|Failure|FAILED|what\(\)" "$OUT/gpu-tests.log" | tail -60
  build-gpu/tests/reshard_unit_tests --gtest_filter="${FAULTS:-*GpuFaults*}" >"$OUT/gpu-faults.log" 2>&1 ||
    status=1
  grep -E "^\[  (PASSED|FAILED|SKIPPED|     OK) " "$OUT/gpu-faults.log" | head -20
  shift
  MPS_TESTS=1
fi
mps_on() {
  export CUDA_MPS_PIPE_DIRECTORY=/tmp/mps CUDA_MPS_LOG_DIRECTORY=/tmp/mpslog
  mkdir -p $CUDA_MPS_PIPE_DIRECTORY $CUDA_MPS_LOG_DIRECTORY
  nvidia-cuda-mps-control -d
}
mps_off() {
  echo quit | nvidia-cuda-mps-control || true
  unset CUDA_MPS_PIPE_DIRECTORY CUDA_MPS_LOG_DIRECTORY
  sleep 1
}
for mps in ${MPS:-off on}; do
  [[ $mps == none ]] && continue  # MPS=none: the tests only
  [[ $mps == on ]] && mps_on
  if [[ $mps == on && -n "${MPS_TESTS:-}" ]]; then
    # Under MPS the PEs' kernels must all be resident at once (the CUDA and NVSHMEM transports
    # share the GPU's wave among them): the CUDA and NVSHMEM suites show it.
    ctest --test-dir build-gpu -L gpu \
      -R "gpu_reshard_cuda_4|gpu_cuda_(sm|ce|auto)_4_pes|gpu_(reshard_)?nvshmem_(2|4)_pes" \
      --output-on-failure --timeout 300 >"$OUT/gpu-tests-mps.log" 2>&1 || status=$?
    grep -E "Test +#|tests passed" "$OUT/gpu-tests-mps.log" | tail -8
  fi
  # Under MPS NVSHMEM's kernels run side by side too (without MPS it takes time slices: slow).
  engines=(sm ce)
  [[ $mps == on ]] && engines+=(nvshmem)
  for order in ${ORDERS:-delegate stream kernel}; do
    for pes in ${PES:-2 4}; do
      n=$((pes * gpus))
      echo "== all-to-all, $n PEs on $gpus GPU(s), MPS $mps, same-device order $order"
      RESHARD_CUDA_SAME_DEVICE=$order timeout 200 build-gpu/reshard bench-gpu --np "$n" \
        -e "${engines[@]}" -s 4KiB 64KiB 1MiB 16MiB --json "$OUT/bench-gpu.jsonl" --commit "$commit" 2>&1 |
        tee -a "$OUT/bench-gpu-$mps-$order.txt" | grep -vE "^\s*$" | tail -12 || status=1
      for model in "llama3-8b 16" "qwen3-30b-a3b 12"; do
        set -- $model
        for transform in ${TRANSFORMS:-none}; do
          for budget in ${BUDGETS:-default}; do
            budget_args=()
            [[ $budget != default ]] && budget_args=(--staging-budget "$budget")
            echo "== refit $1 ($2 layers), $n PEs, MPS $mps, order $order, transform $transform," \
              "staging budget $budget"
            RESHARD_CUDA_SAME_DEVICE=$order timeout 200 build-gpu/reshard bench-refit -n "$n" \
              -m "$1" --layers "$2" -t cuda --transform "$transform" "${budget_args[@]}" \
              --json "$OUT/bench-refit.jsonl" --commit "$commit" 2>&1 |
              tee -a "$OUT/bench-refit-$mps-$order.txt" | tail -7 || status=1
          done
        done
      done
    done
  done
  [[ $mps == on ]] && mps_off
done
exit $status
