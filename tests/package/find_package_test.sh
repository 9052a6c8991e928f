#!/usr/bin/env bash
# reshard in another project's build: find_package(reshard) from an installed copy (installs BUILD
# into a temporary prefix, builds examples/ against it, runs the example on 3 processes with the
# installed launcher), then add_subdirectory of the sources (configured: only the library and the
# example are targets, no tests or tools). Usage: find_package_test.sh BUILD SOURCE GENERATOR
set -euo pipefail
build=$1 source=$2 generator=$3
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
cmake --install "$build" --prefix "$tmp/prefix" >"$tmp/install.log" || { cat "$tmp/install.log"; exit 1; }
if ! cmake -S "$source/examples" -B "$tmp/examples" -G "$generator" -DCMAKE_BUILD_TYPE=Release \
  -DCMAKE_PREFIX_PATH="$tmp/prefix" >"$tmp/configure.log" 2>&1; then
  cat "$tmp/configure.log"
  exit 1
fi
cmake --build "$tmp/examples" >"$tmp/build.log" 2>&1 || { cat "$tmp/build.log"; exit 1; }
"$tmp/prefix/bin/reshard-run" -n 3 "$tmp/examples/ring_exchange"
# The installed CLI finds its plotting script (it draws where python3 has matplotlib).
if ! "$tmp/prefix/bin/reshard" bench plot "$source/results/host-cpu-2cores.jsonl" \
  --out "$tmp/plots" >"$tmp/plot.log" 2>&1 && ! grep -q "plotting needs matplotlib" "$tmp/plot.log"; then
  cat "$tmp/plot.log"
  exit 1
fi

if ! cmake -S "$source/examples" -B "$tmp/subproject" -G "$generator" \
  -DRESHARD_SOURCE="$source" >"$tmp/subproject.log" 2>&1; then
  cat "$tmp/subproject.log"
  exit 1
fi
# Every target CMake made, one folder each (whatever the generator).
targets=$(cat "$tmp/subproject/CMakeFiles/TargetDirectories.txt")
grep -q "/ring_exchange.dir" <<<"$targets" || { echo "add_subdirectory: no ring_exchange target"; exit 1; }
if grep -qE "/(reshard-cli|reshard_unit_tests)\.dir" <<<"$targets"; then
  echo "add_subdirectory built reshard's tools or tests by default"
  exit 1
fi
echo "find_package and add_subdirectory both work"
