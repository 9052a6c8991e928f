#!/bin/sh
# Runs a test with two PEs on each GPU: rank r uses the (r / 2 mod G)-th GPU it may use
# (CUDA_VISIBLE_DEVICES where set, else every GPU nvidia-smi lists) as its device 0. With two GPUs
# or more, every PE then has a peer on its own GPU and peers on others (colocated trainer and
# engine processes across NVLink). Without nvidia-smi the test runs as it is (and skips where there
# is no GPU).
if [ -n "${CUDA_VISIBLE_DEVICES:-}" ]; then
  gpus=$(echo "$CUDA_VISIBLE_DEVICES" | tr ',' ' ')
else
  gpus=$(nvidia-smi -L 2>/dev/null | sed -n 's/^GPU \([0-9]*\):.*/\1/p' | tr '\n' ' ')
fi
count=$(echo "$gpus" | wc -w)
if [ "$count" -gt 0 ]; then
  index=$(((${LOCAL_RANK:-0} / 2) % count))
  i=0
  for gpu in $gpus; do
    [ "$i" -eq "$index" ] && export CUDA_VISIBLE_DEVICES="$gpu" RESHARD_DEVICE=0
    i=$((i + 1))
  done
fi
exec "$@"
