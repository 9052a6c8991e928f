#!/usr/bin/env bash
# Quick start, the main job: builds reshard and runs `reshard bench` (4 processes on the host
# shared-memory transport by default). Arguments go to `reshard bench`, e.g. --np 8 --size 4MiB.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/build.sh
exec build/reshard bench "$@"
