#!/usr/bin/env bash
# On a GPU machine: builds reshard, runs the GPU tests of the bound refit (C++ and Python), then
# times the same refits from C++ (`reshard bench-refit`: execute, rerun, bound Refit::run, the
# one-process copy ceiling of the same bytes) and from Python (tools/bench/python_refit_bench.py:
# execute_reshard_plan, rerun_reshard_plan, reshard.bind().run() with PyTorch tensors), PEs
# sharing one GPU as colocated RL jobs run. Logs and JSON lines go to $OUT (default
# build-gpu/logs). REFITS="qwen3-30b-a3b:12:2 llama3-8b:16:2 qwen3-30b-a3b:24:4" (model:layers:PEs)
# narrows the sweep; TESTS=0 skips the tests, TESTS=ctest runs only the GPU_TESTS ctest pattern;
# STAGED=1 times the staged refit too (stage(), the commit() pause); LAYER_GROUPS=1 the refit bound
# with groups="layers" (a whole run, a group at a time); GRAPH=1 the run captured in a CUDA graph
# and replayed from Python, by torch.cuda.graph and by BoundRefit.capture_graph (host time of a
# replay, the graph's nodes by kind); bench-refit times RefitGraph::replay on the cuda transport.
set -uo pipefail
cd "$(dirname "$0")/.."
source scripts/gpu-env.sh
bash scripts/gpu-build.sh || exit 1
commit=$(bash scripts/commit-label.sh)
export PYTHONPATH=$PWD/build-gpu/python
status=0
if [[ ${TESTS:-1} != 0 ]]; then
  # The GPU suites these refits stand on (GPU_TESTS: a ctest -R pattern), and the dead-peer tests.
  ctest --test-dir build-gpu -L gpu -R "${GPU_TESTS:-gpu_reshard_(cuda|nvshmem|mixed)_(2|4)_pes|gpu_device_waits|gpu_cuda_(sm|ce)_(2|4)_pes|gpu_nvshmem_(2|4)_pes}" \
    --output-on-failure --timeout 300 >"$OUT/gpu-tests.log" 2>&1 || status=1
  grep -E "tests passed|\(Failed|\(Timeout|records:" "$OUT/gpu-tests.log" | tail -8
  if [[ ${TESTS:-1} == 1 ]]; then  # TESTS=ctest: the ctest pattern only (PYTESTS: a pytest -k)
    build-gpu/tests/reshard_unit_tests --gtest_filter='*GpuFaults*' >"$OUT/gpu-faults.log" 2>&1 ||
      status=1
    grep -E "^\[  (PASSED|FAILED) " "$OUT/gpu-faults.log" | head -4
    timeout 500 python3 -m pytest tests/python -q -rs -s -k "${PYTESTS:-gpu}" >"$OUT/pytest-gpu.log" 2>&1 ||
      status=1
    grep -E "replay . host time" "$OUT/pytest-gpu.log" | head -6
    grep -E "passed|failed|^FAILED" "$OUT/pytest-gpu.log" | tail -8
  fi
fi
for refit in ${REFITS:-qwen3-30b-a3b:12:2 llama3-8b:16:2 qwen3-30b-a3b:24:4}; do
  IFS=: read -r model layers pes <<<"$refit"
  echo "== $model, $layers layers, $pes PEs on $(nvidia-smi -L | wc -l) GPU(s)"
  timeout 240 build-gpu/reshard bench-refit -n "$pes" -m "$model" --layers "$layers" -t cuda \
    --json "$OUT/bench-refit.jsonl" --commit "$commit" >"$OUT/refit-$model-$layers-$pes.txt" 2>&1 ||
    status=1
  grep -E "median|ceiling" "$OUT/refit-$model-$layers-$pes.txt" | sed 's/^\[rank 0\] //'
  timeout 300 python3 -m reshard.launch -n "$pes" tools/bench/python_refit_bench.py \
    --model "$model" --layers "$layers" --json "$OUT/python-refit.jsonl" --commit "$commit" \
    --iters "${PY_ITERS:-20}" ${STAGED:+--staged} ${LAYER_GROUPS:+--groups} ${GRAPH:+--graph} \
    >"$OUT/python-$model-$layers-$pes.txt" 2>&1 || status=1
  grep -vE "^\s*$" "$OUT/python-$model-$layers-$pes.txt" | sed 's/^\[rank 0\] //' | tail -8
done
# One archive of the logs (the device call brings back few files).
tar -C "$OUT" -czf "$OUT/../gpu-bound-refit-logs.tgz" . && mv "$OUT/../gpu-bound-refit-logs.tgz" "$OUT/"
exit $status
