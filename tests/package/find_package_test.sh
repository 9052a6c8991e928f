#!/usr/bin/env bash
# find_package(reshard) from an installed copy: installs BUILD into a temporary prefix, builds
# examples/ against it as an outside project would, and runs the example on 3 processes with the
# installed launcher. Usage: find_package_test.sh BUILD SOURCE GENERATOR
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
