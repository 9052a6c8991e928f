// RESHARD_HD marks a function that host code and CUDA kernels share (number formats, flag layouts,
// descriptors): __host__ __device__ and inlined where nvcc compiles it, plain inline elsewhere, so
// CPU-only builds include the same headers.
#pragma once

#if defined(__CUDACC__)
#define RESHARD_HD __host__ __device__ __forceinline__
#else
#define RESHARD_HD inline
#endif
