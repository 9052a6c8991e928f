#!/usr/bin/env bash
# On a GPU machine: builds reshard, runs the GPU tests of the bound refit (C++ and Python), then
# times the same refits from C++ (`reshard bench-refit`: execute, rerun, bound Refit::run, the
# one-process copy ceiling of the same bytes) and from Python (tools/bench/python_refit_bench.py:
# execute_reshard_plan, rerun_reshard_plan, reshard.bind().run() with PyTorch tensors), PEs
# sharing one GPU as colocated RL jobs run. Logs and JSON lines go to $OUT (default
# build-gpu/logs). REFITS="qwen3-30b-a3b:12:2 llama3-8b:16:2 qwen3-30b-a3b:24:4" (model:layers:PEs)
# narrows the sweep; TESTS=0 skips the tests.
set -uo pipefail
cd "$(dirname "$0")/.."
export NCCL_NVLS_ENABLE=0 NVSHMEM_DISABLE_NVLS=1 TORCH_SYMM_MEM_DISABLE_MULTICAST=1
export OUT=${OUT:-build-gpu/logs}
bash scripts/gpu-build.sh || exit 1
commit=$(bash scripts/commit-label.sh)
export PYTHONPATH=$PWD/build-gpu/python
status=0
if [[ ${TESTS:-1} != 0 ]]; then
  for transport in cuda nvshmem; do
    RESHARD_TEST_TRANSPORT=$transport RESHARD_TEST_MEMORY=cuda timeout 300 \
      build-gpu/reshard-run -n 2 build-gpu/tests/reshard_plan_tests \
      --gtest_filter='BoundRefit.*:ReshardReuse.*:ReshardErrors.*' >"$OUT/plan-$transport.log" 2>&1 ||
      status=1
    echo "C++ bound-refit tests, $transport, 2 PEs on one GPU: $(grep -E '^\[rank 0\] \[  (PASSED|FAILED)' "$OUT/plan-$transport.log" | tr '\n' ' ')"
  done
  timeout 400 python3 -m pytest tests/python -q -rs -k "gpu and (bound or stream)" \
    >"$OUT/pytest-gpu.log" 2>&1 || status=1
  grep -E "replay|passed|failed|Error" "$OUT/pytest-gpu.log" | tail -8
fi
for refit in ${REFITS:-qwen3-30b-a3b:12:2 llama3-8b:16:2 qwen3-30b-a3b:24:4}; do
  IFS=: read -r model layers pes <<<"$refit"
  echo "== $model, $layers layers, $pes PEs on one GPU"
  timeout 240 build-gpu/reshard bench-refit -n "$pes" -m "$model" --layers "$layers" -t cuda \
    --json "$OUT/bench-refit.jsonl" --commit "$commit" >"$OUT/refit-$model-$layers-$pes.txt" 2>&1 ||
    status=1
  grep -E "median|ceiling" "$OUT/refit-$model-$layers-$pes.txt" | sed 's/^\[rank 0\] //'
  timeout 300 python3 -m reshard.launch -n "$pes" tools/bench/python_refit_bench.py \
    --model "$model" --layers "$layers" --json "$OUT/python-refit.jsonl" \
    >"$OUT/python-$model-$layers-$pes.txt" 2>&1 || status=1
  grep -vE "^\s*$" "$OUT/python-$model-$layers-$pes.txt" | sed 's/^\[rank 0\] //' | tail -7
done
exit $status
