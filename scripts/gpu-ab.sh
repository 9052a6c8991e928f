#!/usr/bin/env bash
# On a GPU machine: whether this checkout is slower than an earlier commit. Builds both (this one
# with scripts/gpu-build.sh, BASE's reshard program from `git archive BASE`), then times the
# same benchmarks with each build in alternating runs on the same machine: the model refits
# (bench-refit, NCCL or the hand loop timed in each run), then the all-to-all sweep (bench-gpu).
# One PE per GPU, or PES_PER_GPU PEs sharing each (colocated; 2 on a one-GPU machine). Records go
# to $OUT/ab.jsonl (commit fields tell the builds apart), logs to $OUT (default build-gpu/logs).
#   scripts/gpu-ab.sh BASE
# BASE is a commit, or a tarball of one (`git archive BASE | gzip > base-BASE.tgz`, labelled
# "BASE" from its name) for machines whose copy of the checkout lacks that history: the GPU
# machines get the working tree, and its .git may be older than the tree (label the head with
# RESHARD_COMMIT there). Or "env:VAR=VALUE[,VAR=VALUE...]": this build against itself run with
# those variables set (an option's A/B without a second build), labelled "HEAD+VAR=VALUE...".
# REFITS: "model:layers:transport:transform[:only] ..." or "none" (layers 0: the model's; only: the
# transform's --transform-only, e.g. "fp8-block-receiver:layers."; default on
# several GPUs: Llama and Qwen at full depth on cuda, Llama on nvshmem and with MXFP8; on one GPU:
# Llama 16 and Qwen 12 layers, Llama with MXFP8); REPEATS: runs of each build (default 2); SIZES:
# bench-gpu sizes ("" skips the sweep); CONVERT: bench-convert arguments ("all" for the whole
# sweep, or e.g. "-c mxfp8 --layouts column-block") to time the conversion kernels too.
set -uo pipefail
cd "$(dirname "$0")/.." || exit 1
base=${1:?usage: scripts/gpu-ab.sh BASE (a commit to compare this checkout with)}
source scripts/gpu-env.sh
head=$(bash scripts/commit-label.sh)
base_src="build-gpu/ab-base-src"
base_env=()
if [[ $base == env:* ]]; then
  IFS=, read -ra base_env <<<"${base#env:}"
  base="$head+$(IFS=+; echo "${base_env[*]}")"
elif [[ -f $base ]]; then
  tarball=$base
  base=$(basename "$tarball")
  base=${base%.tgz}
  base=${base%.tar.gz}
  base=${base#base-}
  extract() { tar -xzf "$tarball" -C "$base_src"; }
else
  base=$(git rev-parse --short "$base") || exit 1
  extract() { git archive "$base" | tar -x -C "$base_src"; }
fi
bash scripts/gpu-build.sh &
head_build=$!
if ((${#base_env[@]} == 0)); then
  # A later call for the same BASE keeps its build.
  if [[ $(cat "$base_src/.commit" 2>/dev/null) != "$base" ]]; then
    rm -rf "$base_src" && mkdir -p "$base_src" && extract && echo "$base" >"$base_src/.commit" ||
      exit 1
  fi
  args=(-DCMAKE_BUILD_TYPE=Release -DRESHARD_BUILD_TESTS=OFF)
  [[ -d .deps/cli11 ]] && args+=(-DCMAKE_PREFIX_PATH="$PWD/.deps/cli11")
  command -v ninja >/dev/null && args+=(-G Ninja)
  { cmake -S "$base_src" -B "$base_src/build" "${args[@]}" >"$OUT/ab-base-configure.log" 2>&1 &&
    cmake --build "$base_src/build" -j "$(nproc)" --target reshard-cli >"$OUT/ab-base-build.log" 2>&1; } ||
    { tail -20 "$OUT/ab-base-build.log" "$OUT/ab-base-configure.log" 2>/dev/null; exit 1; }
fi
wait "$head_build" || exit 1
gpus=$(nvidia-smi -L | wc -l)
# One GPU: PEs share it (colocated), at the depths the colocated benchmarks use.
if ((gpus == 1)); then
  n=$((${PES_PER_GPU:-2}))
  default_refits="llama3-8b:16:cuda:none qwen3-30b-a3b:12:cuda:none llama3-8b:16:cuda:mxfp8"
else
  n=$((gpus * ${PES_PER_GPU:-1}))
  default_refits="llama3-8b:0:cuda:none qwen3-30b-a3b:0:cuda:none llama3-8b:0:nvshmem:none
    llama3-8b:0:cuda:mxfp8"
fi
status=0
bench() {  # build (head or base), then the reshard arguments
  local build=$1 bin=build-gpu/reshard commit=$head environment=()
  shift
  if [[ $build == base ]]; then
    commit=$base
    if ((${#base_env[@]})); then environment=("${base_env[@]}"); else bin=$base_src/build/reshard; fi
  fi
  echo "== $commit: reshard $*"
  env "${environment[@]}" timeout 300 "$bin" "$@" --json "$OUT/ab.jsonl" --commit "$commit" \
    >"$OUT/ab-last.txt" 2>&1 ||
    { echo "   failed (exit $?): $OUT/ab-$build.txt"; tail -2 "$OUT/ab-last.txt"; status=1; }
  cat "$OUT/ab-last.txt" >>"$OUT/ab-$build.txt"
  # (The base build may be older: its rows may still carry the launcher's "[rank 0] ".)
  grep -E "median of|baseline|ceiling in this run|per-peer|^(\[rank 0\] )?[0-9]+ [KMG]iB" \
    "$OUT/ab-last.txt" | sed -E 's/^(\[rank 0\] *)?/   /'
}
refits=${REFITS:-$default_refits}
[[ $refits == none ]] && refits=""
for refit in $refits; do
  IFS=: read -r model layers transport transform only <<<"$refit"
  for ((r = 0; r < ${REPEATS:-2}; ++r)); do
    for build in head base; do
      bench "$build" bench-refit -n "$n" -m "$model" --layers "$layers" -t "$transport" \
        --transform "$transform" ${only:+--transform-only "$only"} -i 10
    done
  done
done
read -ra sizes <<<"${SIZES-4KiB 64KiB 1MiB 16MiB 256MiB}"
if ((${#sizes[@]})); then
  for build in head base; do
    bench "$build" bench-gpu -n "$n" -s "${sizes[@]}"
  done
fi
# The conversion kernels (one GPU), REPEATS alternating runs of each build, then each case's
# fraction of the copy rate per build, side by side.
if [[ -n "${CONVERT:-}" ]]; then
  read -ra convert_args <<<"${CONVERT#all}"
  for ((r = 0; r < ${REPEATS:-2}; ++r)); do
    for build in head base; do
      bench "$build" bench-convert "${convert_args[@]}"
    done
  done
  python3 - "$OUT/ab.jsonl" "$head" "$base" <<'PY'
import collections, json, sys
path, *builds = sys.argv[1:]
runs = collections.defaultdict(list)
for line in open(path):
    r = json.loads(line)
    if r.get("bench") == "convert" and r["commit"] in builds:
        runs[(r["tensors"], r["layout"], r["conversion"])].append((r["commit"], r["fraction_of_copy"]))
print(f"{'tensors':34} {'layout':13} {'conversion':15} " + "  ".join(f"{b:>20}" for b in builds))
for case, results in runs.items():
    cells = ["/".join(f"{f:.3f}" for c, f in results if c == b) for b in builds]
    print(f"{case[0]:34} {case[1]:13} {case[2]:15} " + "  ".join(f"{c:>20}" for c in cells))
PY
fi
exit $status
