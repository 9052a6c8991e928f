#!/usr/bin/env bash
# On a GPU machine: builds reshard, runs the GPU tests of reshard.torch (DTensor state dicts, PEs
# sharing the GPU, gloo process group), then the DTensor refit benchmark (FSDP2 Llama-3-8B shape,
# 16 layers, on PEs 0-1 -> TP 2 on PEs 2-3, all on one GPU) with MPS off and on. Logs and JSON
# lines go to $OUT (default build-gpu/logs). TESTS=0 skips the tests, MPS=0 the runs with MPS;
# MPS=only the runs with MPS alone; ENGINES="auto ce sm" runs the benchmark with each CUDA engine,
# SAME_DEVICES="kernel delegate stream" (with MPS) with each order of same-GPU copies.
# DTENSOR_RUNS="PEs:trainer PEs:source ..." (default "4:2:fsdp") sets the benchmark's shapes, e.g.
# "8:4:fsdp 8:4:fsdp_tp 4:2:fsdp" on 4 GPUs (colocated, then trainer and engine on GPUs apart).
set -uo pipefail
cd "$(dirname "$0")/.."
source scripts/gpu-env.sh
bash scripts/gpu-build.sh || exit 1
commit=$(bash scripts/commit-label.sh)
export PYTHONPATH=$PWD/build-gpu/python
status=0
if [[ ${TESTS:-1} != 0 ]]; then
  timeout 400 python3 -m pytest tests/python -q -rs -k "${PYTESTS:-torch}" >"$OUT/pytest-torch.log" 2>&1 ||
    status=1
  grep -E "passed|failed|^FAILED|^SKIPPED" "$OUT/pytest-torch.log" | tail -12
fi
bench() {
  for run in ${DTENSOR_RUNS:-4:2:fsdp}; do
    IFS=: read -r pes trainer source <<<"$run"
    log="$OUT/dtensor-refit-$1-${ENGINE:-auto}-${SAME_DEVICE:-auto}-$pes-$trainer-$source.txt"
    RESHARD_CUDA_SAME_DEVICE=${SAME_DEVICE:-auto} RESHARD_CUDA_ENGINE=${ENGINE:-auto} timeout 240 \
      python3 -m reshard.launch -n "$pes" tools/bench/dtensor_refit_bench.py --trainer "$trainer" \
      --source "$source" --layers "${LAYERS:-16}" --json "$OUT/dtensor-refit.jsonl" \
      --commit "$commit" >"$log" 2>&1 || status=1
    echo "== MPS $1, CUDA engine ${ENGINE:-auto}, same-GPU order ${SAME_DEVICE:-auto}, $run"
    grep -vE "^\s*$" "$log" | sed 's/^\[rank 0\] //' | tail -8
  done
}
if [[ ${MPS:-1} != only ]]; then
  for ENGINE in ${ENGINES:-auto}; do bench off; done
fi
export CUDA_MPS_PIPE_DIRECTORY=/tmp/mps CUDA_MPS_LOG_DIRECTORY=/tmp/mpslog
mkdir -p $CUDA_MPS_PIPE_DIRECTORY $CUDA_MPS_LOG_DIRECTORY
if [[ ${MPS:-1} != 0 ]] && nvidia-cuda-mps-control -d; then
  for ENGINE in ${ENGINES:-auto}; do
    for SAME_DEVICE in ${SAME_DEVICES:-auto}; do bench on; done
  done
  unset SAME_DEVICE
  echo quit | nvidia-cuda-mps-control
fi
tar -C "$OUT" -czf "$OUT/../gpu-torch-refit-logs.tgz" . && mv "$OUT/../gpu-torch-refit-logs.tgz" "$OUT/"
exit $status
