#!/usr/bin/env bash
# reshard as a shared library (-DBUILD_SHARED_LIBS=ON, the host transport only: quick to build):
# installed into a temporary prefix, the example built against it links libreshard alone (MPI
# stays inside), the installed launcher finds libreshard beside it and runs the example on 3
# processes, and the library carries its version. Usage: shared_library_test.sh SOURCE GENERATOR
# [CMAKE_PREFIX_PATH]
set -euo pipefail
source=$1 generator=$2 prefix_path=${3:-}
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
step() {  # name, then the command; its output is shown only when it fails
  local name=$1
  shift
  "$@" >"$tmp/$name.log" 2>&1 || { echo "$name failed:"; tail -30 "$tmp/$name.log"; exit 1; }
}
step configure cmake -S "$source" -B "$tmp/build" -G "$generator" -DCMAKE_BUILD_TYPE=Release \
  -DBUILD_SHARED_LIBS=ON -DRESHARD_WITH_CUDA=OFF -DRESHARD_BUILD_TESTS=OFF \
  -DCMAKE_PREFIX_PATH="$prefix_path"
step build cmake --build "$tmp/build" --target reshard reshard-run
step install cmake --install "$tmp/build" --prefix "$tmp/prefix"
library=$(ls "$tmp"/prefix/lib*/libreshard.so.*.*.*)
[[ -L $(dirname "$library")/libreshard.so ]] || { echo "no libreshard.so link"; exit 1; }
step example-configure cmake -S "$source/examples" -B "$tmp/examples" -G "$generator" \
  -DCMAKE_BUILD_TYPE=Release -DCMAKE_PREFIX_PATH="$tmp/prefix"
step example-build cmake --build "$tmp/examples"
needed=$(readelf -d "$tmp/examples/ring_exchange" | grep NEEDED)
grep -q "libreshard.so" <<<"$needed" || { echo "the example does not link libreshard.so"; exit 1; }
if grep -qE "libmpi|libnccl|libnvshmem" <<<"$needed"; then
  echo "the example links reshard's own dependencies: $needed"
  exit 1
fi
step run "$tmp/prefix/bin/reshard-run" -n 3 "$tmp/examples/ring_exchange"
grep -q "PE 1 received" "$tmp/run.log" || { cat "$tmp/run.log"; echo "the example moved nothing"; exit 1; }
echo "the shared library installs, links alone and runs"
