# Sourced by the GPU scripts (after cd to the project root): what every process they start on the
# GPU machines runs with — NVLink multicast off (it can take a shared host's GPUs down) — and the
# folder their logs go to ($OUT, default build-gpu/logs).
export NCCL_NVLS_ENABLE=0 NVSHMEM_DISABLE_NVLS=1 TORCH_SYMM_MEM_DISABLE_MULTICAST=1
export OUT=${OUT:-build-gpu/logs}
mkdir -p "$OUT"
