#!/usr/bin/env bash
# On a GPU machine: builds reshard and runs the GPU test suite (ctest -L gpu) in groups, one after
# the other, each within its own time limit, so a device call of a few minutes covers a part and
# a hang in one group cannot eat the others; prints one table (tests, passed, failed, skipped,
# seconds per group), a row as each group ends, so a device call cut short still shows what ran.
# GROUPS_TO_RUN="plans-cuda copies-cuda ..." narrows it; GROUP_TIMEOUT (s) bounds each group
# (default 280); MPS=on runs them under an MPS server started for the call. Each GPU test costs 13-17 s of process and CUDA start-up, so the whole suite
# takes about 15 minutes of one H200: run it in two calls, GROUPS_TO_RUN="plans-cuda copies-cuda
# kernels colocated" and then the rest. Logs go to $OUT (default build-gpu/logs).
set -uo pipefail
cd "$(dirname "$0")/.."
source scripts/gpu-env.sh
bash scripts/gpu-build.sh || exit 1
declare -A pattern=(
  [plans-cuda]='^gpu_reshard_cuda_(2|4)_pes$'
  [plans-nvshmem]='^gpu_reshard_nvshmem_(2|4)_pes$'
  [plans-nccl]='^gpu_reshard_nccl_(2|4)_pes$'
  [plans-mixed]='^gpu_reshard_mixed_(2|4)_pes$'
  [copies-cuda]='^gpu_cuda_(sm|ce|auto|ce_four_streams|autotune|sm_pairwise)_(2|4)_pes$'
  [copies-nvshmem]='^gpu_nvshmem[a-z_]*_(2|4)_pes$'
  [copies-nccl]='^gpu_nccl[a-z_]*_(2|4)_pes$'
  [mixed]='^gpu_mixed_cuda_(nccl|nvshmem)_(2|4)_pes$'
  [colocated]='two_pes_per_gpu|^gpu_cuda_rotated_gpus'
  [kernels]='^gpu_transform_kernels$|^gpu_device_waits$'
  # The fault tests (a PE killed, stopped, late; runs given up and run again) on the CUDA
  # transport; the other transports' are in the GoogleTest binary too, GpuFaults.*/<transport>.
  [faults-cuda]='^Transports/GpuFaults\..*/cuda(_ce)?_(2|4)_pes$'
)
order="plans-cuda copies-cuda kernels colocated plans-nvshmem copies-nvshmem mixed plans-mixed
  plans-nccl copies-nccl"
if [[ ${MPS:-off} == on ]]; then
  export CUDA_MPS_PIPE_DIRECTORY=/tmp/mps CUDA_MPS_LOG_DIRECTORY=/tmp/mpslog
  mkdir -p $CUDA_MPS_PIPE_DIRECTORY $CUDA_MPS_LOG_DIRECTORY
  nvidia-cuda-mps-control -d
  trap 'echo quit | nvidia-cuda-mps-control' EXIT
fi
status=0
printf '%-15s | %5s | %6s | %6s | %7s | %7s |\n' group tests passed failed skipped seconds
for group in ${GROUPS_TO_RUN:-$order}; do
  log="$OUT/suite-$group${MPS:+-mps-$MPS}.log"
  start=$(date +%s)
  # The fault tests are GoogleTest cases of the unit tests, without the gpu label.
  labels=(-L gpu)
  [[ $group == faults-* ]] && labels=()
  timeout "${GROUP_TIMEOUT:-280}" ctest --test-dir build-gpu "${labels[@]}" -R "${pattern[$group]}" \
    --output-on-failure --timeout "${GROUP_TIMEOUT:-280}" >"$log" 2>&1
  rc=$?
  seconds=$(($(date +%s) - start))
  total=$(grep -cE "^ *[0-9]+/[0-9]+ Test +#" "$log")
  passed=$(grep -cE "^ *[0-9]+/[0-9]+ Test +#.* Passed" "$log")
  skipped=$(grep -cE "^ *[0-9]+/[0-9]+ Test +#.*Skipped" "$log")
  failed=$((total - passed - skipped))
  note=""
  [[ $rc == 124 ]] && note="group timed out after ${GROUP_TIMEOUT:-280} s"
  [[ $rc != 0 ]] && status=1
  printf '%-15s | %5d | %6d | %6d | %7d | %7d | %s\n' "$group" "$total" "$passed" "$failed" \
    "$skipped" "$seconds" "$note"
done
grep -hE "\(Failed\)|\(Timeout\)" "$OUT"/suite-*.log | sort -u | head -20
exit $status
