#!/bin/sh
# Runs a test with this PE's GPUs listed from a GPU of its own: rank r sees every GPU it may use
# (CUDA_VISIBLE_DEVICES where set, else every GPU nvidia-smi lists), rotated so that its device 0
# is the (r mod G)-th, and uses device 0. Every PE then works under the same ordinal on different
# GPUs (as processes given one GPU each by CUDA_VISIBLE_DEVICES, which Ray and many launchers do),
# and on a GPU the same as a PE that sees it under another ordinal: reshard must tell peers on the
# same GPU by the GPU itself. Without nvidia-smi the test runs as it is (and skips where there is
# no GPU).
if [ -n "${CUDA_VISIBLE_DEVICES:-}" ]; then
  gpus=$(echo "$CUDA_VISIBLE_DEVICES" | tr ',' ' ')
else
  gpus=$(nvidia-smi -L 2>/dev/null | sed -n 's/^GPU \([0-9]*\):.*/\1/p' | tr '\n' ' ')
fi
count=$(echo "$gpus" | wc -w)
if [ "$count" -gt 0 ]; then
  first=$((${LOCAL_RANK:-0} % count))
  head="" tail=""
  i=0
  for gpu in $gpus; do
    if [ "$i" -lt "$first" ]; then tail="$tail${tail:+,}$gpu"; else head="$head${head:+,}$gpu"; fi
    i=$((i + 1))
  done
  export CUDA_VISIBLE_DEVICES="$head${tail:+,}$tail" RESHARD_DEVICE=0
fi
exec "$@"
