#!/usr/bin/env bash
# Builds the libFuzzer harnesses (scheduler, planner, the refit's phases) with clang under
# AddressSanitizer and UndefinedBehaviorSanitizer and runs each for RESHARD_FUZZ_SECONDS (default
# 60). A crash, a sanitizer report or a violated guarantee fails it and leaves the input in
# build-fuzz/findings.
# Installs clang with apt-get where it is missing (as root).
set -euo pipefail
cd "$(dirname "$0")/.."
if ! command -v clang++ >/dev/null; then
  if [[ $(id -u) == 0 ]] && command -v apt-get >/dev/null; then
    echo "reshard: installing clang (libFuzzer)"
    apt-get update -qq
    DEBIAN_FRONTEND=noninteractive apt-get install -y -qq clang >/dev/null
  else
    echo "reshard: fuzzing needs clang++ with libFuzzer" >&2
    exit 1
  fi
fi
seconds=${RESHARD_FUZZ_SECONDS:-60}
args=(-DCMAKE_BUILD_TYPE=RelWithDebInfo -DCMAKE_CXX_COMPILER=clang++
      -DRESHARD_SANITIZE=fuzzer-no-link,address,undefined -DRESHARD_BUILD_FUZZERS=ON
      -DRESHARD_WITH_CUDA=OFF -DRESHARD_WITH_MPI=OFF -DRESHARD_BUILD_TESTS=OFF
      -DRESHARD_BUILD_TOOLS=OFF)
command -v ninja >/dev/null && args+=(-G Ninja)
cmake -S . -B build-fuzz "${args[@]}" >/dev/null
cmake --build build-fuzz -j "$(nproc)" --target scheduler_fuzz planner_fuzz phases_fuzz >/dev/null
mkdir -p build-fuzz/findings
status=0
for harness in scheduler planner phases; do
  mkdir -p "build-fuzz/corpus/$harness"
  echo "fuzzing the $harness for ${seconds} s"
  if ! UBSAN_OPTIONS=halt_on_error=1:print_stacktrace=1 \
       "build-fuzz/${harness}_fuzz" -max_total_time="$seconds" -print_final_stats=1 \
       -artifact_prefix="build-fuzz/findings/${harness}-" "build-fuzz/corpus/$harness" \
       >"build-fuzz/${harness}.log" 2>&1; then
    status=1
    tail -40 "build-fuzz/${harness}.log"
  fi
  grep -E "stat::number_of_executed_units|stat::peak_rss_mb" "build-fuzz/${harness}.log" || true
done
exit $status
