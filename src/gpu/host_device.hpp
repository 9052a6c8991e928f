// RESHARD_HD marks a function that host code and CUDA kernels share (number formats, flag layouts,
// descriptors): __host__ __device__ and inlined where nvcc compiles it, plain inline elsewhere, so
// CPU-only builds include the same headers.
#pragma once

#if defined(__CUDACC__)
#define RESHARD_HD __host__ __device__ __forceinline__
#else
#define RESHARD_HD inline
#endif

// Before a loop of a RESHARD_HD function that device code should keep rolled (a rare path whose
// unrolled copies would cost the kernels around it registers); nothing in host code.
#if defined(__CUDA_ARCH__)
#define RESHARD_DEVICE_ROLLED _Pragma("unroll 1")
#else
#define RESHARD_DEVICE_ROLLED
#endif
