#!/bin/sh
# Runs a test with this PE's GPUs listed from one chosen for it, used as its device 0:
#   place_pes.sh rotated CMD...   rank r sees every GPU it may use rotated so that its device 0 is
#     the (r mod G)-th: every PE works under the same ordinal on different GPUs (as processes given
#     one GPU each by CUDA_VISIBLE_DEVICES, which Ray and many launchers do), and on a GPU the same
#     as a PE that sees it under another ordinal: reshard must tell peers on one GPU by the GPU.
#   place_pes.sh pairs CMD...     rank r sees only the (r / 2 mod G)-th: two PEs on each GPU, so on
#     two GPUs or more every PE has a peer on its own GPU and peers on others (colocated trainer
#     and engine processes across NVLink).
# The GPUs a PE may use: CUDA_VISIBLE_DEVICES where set, else every GPU nvidia-smi lists. Without
# nvidia-smi the test runs as it is (and skips where there is no GPU).
mode=$1
shift
case $mode in
  rotated | pairs) ;;
  *) echo "place_pes.sh: unknown placement '$mode' (rotated or pairs)" >&2; exit 2 ;;
esac
if [ -n "${CUDA_VISIBLE_DEVICES:-}" ]; then
  gpus=$(echo "$CUDA_VISIBLE_DEVICES" | tr ',' ' ')
else
  gpus=$(nvidia-smi -L 2>/dev/null | sed -n 's/^GPU \([0-9]*\):.*/\1/p' | tr '\n' ' ')
fi
count=$(echo "$gpus" | wc -w)
if [ "$count" -gt 0 ]; then
  if [ "$mode" = rotated ]; then
    first=$((${LOCAL_RANK:-0} % count))
  else
    first=$(((${LOCAL_RANK:-0} / 2) % count))
  fi
  head="" tail=""
  i=0
  for gpu in $gpus; do
    if [ "$i" -lt "$first" ]; then tail="$tail${tail:+,}$gpu"; else head="$head${head:+,}$gpu"; fi
    i=$((i + 1))
  done
  list="$head${tail:+,}$tail"
  [ "$mode" = pairs ] && list=${list%%,*}
  export CUDA_VISIBLE_DEVICES="$list" RESHARD_DEVICE=0
fi
exec "$@"
