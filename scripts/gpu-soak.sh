#!/usr/bin/env bash
# On a GPU machine: builds reshard and soaks one bound model refit per transport (`reshard
# bench-soak`: REFITS refits, the slowest PE's median per window, host RSS, device memory and
# /dev/shm in use, a checked refit every so many), PEs sharing the GPUs there are. Prints one line
# per run and a verdict; logs and JSON lines go to $OUT (default build-gpu/logs).
# RUNS="name:PEs:transport:CUDA engine:model:layers ..." narrows the sweep.
set -uo pipefail
cd "$(dirname "$0")/.."
source scripts/gpu-env.sh
bash scripts/gpu-build.sh || exit 1
commit=$(bash scripts/commit-label.sh)
status=0
default_runs="cuda-sm:2:cuda:sm:llama3-8b:16 cuda-ce:2:cuda:ce:llama3-8b:16
  nvshmem:2:nvshmem:-:llama3-8b:16 mixed:4:mixed:-:llama3-8b:16 cuda-sm:4:cuda:sm:llama3-8b:16
  nvshmem:4:nvshmem:-:llama3-8b:16 cuda-auto:2:cuda:auto:qwen3-30b-a3b:12"
for run in ${RUNS:-$default_runs}; do
  IFS=: read -r name pes transport engine model layers <<<"$run"
  env=(RESHARD_CUDA_ENGINE="${engine/-/auto}")
  if [[ $transport == mixed ]]; then
    # Nodes of half the PEs: CUDA IPC within a node, NVSHMEM between them (what crosses nodes).
    transport=auto
    env+=(RESHARD_NODE_SIZE=$((pes / 2)) RESHARD_INTER_NODE_TRANSPORT=nvshmem)
  fi
  log="$OUT/soak-$name-$pes-$model.txt"
  env "${env[@]}" timeout 280 build-gpu/reshard bench-soak -n "$pes" -t "$transport" -m "$model" \
    --layers "$layers" --refits "${REFITS:-2000}" --window "${WINDOW:-250}" \
    --verify-every "${VERIFY_EVERY:-500}" --json "$OUT/soak.jsonl" --commit "$commit" \
    >"$log" 2>&1 || status=1
  verdict=$(grep -h "last window / first" "$log" | sed 's/^\[rank 0\] //')
  printf '%-10s %d PEs %-14s %s\n' "$name" "$pes" "$model" "${verdict:-$(tail -2 "$log")}"
done
exit $status
