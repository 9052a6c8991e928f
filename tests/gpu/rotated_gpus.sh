#!/bin/sh
# Runs a test with this PE's GPUs listed from a GPU of its own: rank r sees every GPU, rotated so
# that its device 0 is GPU r mod G, and uses device 0. Every PE then works under the same ordinal
# on different GPUs (as processes given one GPU each by CUDA_VISIBLE_DEVICES, which Ray and many
# launchers do), and on a GPU the same as a PE that sees it under another ordinal: reshard must
# tell peers on the same GPU by the GPU itself. Without nvidia-smi the test runs as it is (and
# skips where there is no GPU).
count=$(nvidia-smi -L 2>/dev/null | grep -c '^GPU')
if [ "${count:-0}" -gt 0 ]; then
  first=$((${LOCAL_RANK:-0} % count))
  list=$first
  i=1
  while [ "$i" -lt "$count" ]; do
    list="$list,$(((first + i) % count))"
    i=$((i + 1))
  done
  export CUDA_VISIBLE_DEVICES="$list" RESHARD_DEVICE=0
fi
exec "$@"
