# Sourced by the build scripts: the GPU architectures to build the kernels for here, as CMake's
# CMAKE_CUDA_ARCHITECTURES takes them, in $cuda_architectures: those of the GPUs this machine has
# (native), sm_90 where it has none (CI compiles the GPU code without running it), or CUDAARCHS
# where set. Building for every supported GPU (the CMake default without it) takes several times
# as long.
if [[ -n ${CUDAARCHS:-} ]]; then
  cuda_architectures=$CUDAARCHS
elif nvidia-smi -L >/dev/null 2>&1; then
  cuda_architectures=native
else
  cuda_architectures=90
fi
