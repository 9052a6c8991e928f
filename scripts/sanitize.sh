#!/usr/bin/env bash
# The CPU tests under sanitizers: AddressSanitizer + UndefinedBehaviorSanitizer over every CPU
# test (build-asan/), ThreadSanitizer over the bootstrap, host transport and copy-service tests
# (build-tsan/). CUDA is left out of these builds (the GPU code is checked with compute-sanitizer
# on the GPU machines). Any report fails the run.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/install-deps.sh
jobs=$(nproc)
common=(-G Ninja -DCMAKE_BUILD_TYPE=RelWithDebInfo -DRESHARD_WITH_CUDA=OFF -DRESHARD_WITH_MPI=OFF)

cmake -S . -B build-asan "${common[@]}" -DRESHARD_SANITIZE=address,undefined >/dev/null
cmake --build build-asan
ASAN_OPTIONS=detect_leaks=1:abort_on_error=1:detect_stack_use_after_return=1 \
UBSAN_OPTIONS=halt_on_error=1:print_stacktrace=1 \
  ctest --test-dir build-asan --output-on-failure -j "$jobs" --timeout 900 -LE "gpu|soak"

cmake -S . -B build-tsan "${common[@]}" -DRESHARD_SANITIZE=thread >/dev/null
cmake --build build-tsan
TSAN_OPTIONS=halt_on_error=1:second_deadlock_stack=1 \
  ctest --test-dir build-tsan --output-on-failure -j "$jobs" --timeout 900 \
  -R "bootstrap|host_transport|copy_service|Bootstrap|HostTransport|Faults"
