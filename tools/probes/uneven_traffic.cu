// Probe: what fraction of a device-to-device copy's rate can a kernel reach when it writes more
// (or fewer) bytes than it reads, as a bfloat16 -> float32 cast does (2 bytes read, 4 written)?
//
// A plain streaming kernel (16-byte loads, several in flight per thread, grid-stride, one resident
// wave) runs at three read:write ratios: 1:1 (a copy), 1:2 (widening: each 16 bytes read become
// 32 written, as bf16 -> fp32) and 2:1 (narrowing, as fp32 -> bf16), on buffers far larger than
// L2. Each rate counts bytes read + written, and is given as a fraction of cudaMemcpyAsync's rate
// (device to device, the same bytes read + written) timed in the same run. The conversion kernels'
// fractions in `reshard bench-convert` are measured against the same copy: where this probe's
// widening kernel stays below a fraction, no cast kernel can do better there. A column-block copy
// (half of each row read, written dense) shows what reading a TP slice in place costs, and an
// MXFP8-shaped one (the same reads; FP8 data and scales written into the same block of their
// matrices) the most an MXFP8 conversion of such blocks can reach; the copy engine's pitched copy
// of each column block (cudaMemcpy2DAsync) says whether the pattern, not the kernel, sets that.
//
// Build and run on a GPU machine:
//   nvcc -O3 -arch=sm_90 -o /tmp/uneven tools/probes/uneven_traffic.cu
//   /tmp/uneven [MiB read by the 1:1 copy = 1024] [repeats = 20]
#include <cuda_runtime.h>

#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <vector>

#define CHECK(call)                                                   \
  do {                                                                \
    const cudaError_t e = (call);                                     \
    if (e != cudaSuccess) {                                           \
      std::fprintf(stderr, "%s: %s\n", #call, cudaGetErrorString(e)); \
      std::exit(1);                                                   \
    }                                                                 \
  } while (0)

constexpr int kThreads = 256;

// `groups` of `In` 16-byte vectors read, each group written as `Out` vectors (In 1, Out 2:
// widening; In 2, Out 1: narrowing); kInFlight groups loaded before any is stored.
template <int In, int Out, int kInFlight = 4, bool kWarpStores = false>
__global__ void __launch_bounds__(kThreads)
    stream_kernel(const uint4* __restrict__ src, uint4* __restrict__ dst, std::size_t groups) {
  const std::size_t stride = std::size_t{gridDim.x} * blockDim.x;
  for (std::size_t g0 = std::size_t{blockIdx.x} * blockDim.x + threadIdx.x; g0 < groups;
       g0 += stride * kInFlight) {
    uint4 v[kInFlight][In];
#pragma unroll
    for (int k = 0; k < kInFlight; ++k) {
      const std::size_t g = g0 + k * stride;
#pragma unroll
      for (int i = 0; i < In; ++i) v[k][i] = g < groups ? src[g * In + i] : uint4{};
    }
#pragma unroll
    for (int k = 0; k < kInFlight; ++k) {
      const std::size_t g = g0 + k * stride;
      if (g >= groups) continue;
      uint4 folded = v[k][0];
#pragma unroll
      for (int i = 1; i < In; ++i) {
        folded.x ^= v[k][i].x, folded.y ^= v[k][i].y, folded.z ^= v[k][i].z, folded.w ^= v[k][i].w;
      }
#pragma unroll
      for (int o = 0; o < Out; ++o) {
        // kWarpStores: each store instruction of the warp covers 32 consecutive vectors (the
        // warp's groups being consecutive); else each thread stores its Out vectors in a row.
        const std::size_t at =
            kWarpStores ? (g - threadIdx.x % 32) * Out + o * 32 + threadIdx.x % 32 : g * Out + o;
        dst[at] = make_uint4(folded.x + o, folded.y, folded.z, folded.w);
      }
    }
  }
}

// Calls store(i, vector) for each vector i of a column block (the first `row_vectors` 16-byte
// vectors of each source row, rows `stride_vectors` apart), kInFlight loaded before any is stored.
template <typename Store>
__device__ __forceinline__ void for_each_column_block_vector(const uint4* __restrict__ src,
                                                             std::size_t vectors,
                                                             unsigned row_vectors,
                                                             unsigned stride_vectors, Store store) {
  constexpr int kInFlight = 4;
  const std::size_t stride = std::size_t{gridDim.x} * blockDim.x;
  for (std::size_t v0 = std::size_t{blockIdx.x} * blockDim.x + threadIdx.x; v0 < vectors;
       v0 += stride * kInFlight) {
    uint4 v[kInFlight];
#pragma unroll
    for (int k = 0; k < kInFlight; ++k) {
      const std::size_t i = v0 + k * stride;
      v[k] = i < vectors ? src[i / row_vectors * stride_vectors + i % row_vectors] : uint4{};
    }
#pragma unroll
    for (int k = 0; k < kInFlight; ++k) {
      const std::size_t i = v0 + k * stride;
      if (i < vectors) store(i, v[k]);
    }
  }
}

// A column block copied densely (as a conversion reads a row-parallel weight's TP slice).
__global__ void __launch_bounds__(kThreads)
    column_block_kernel(const uint4* __restrict__ src, uint4* __restrict__ dst, std::size_t vectors,
                        unsigned row_vectors, unsigned stride_vectors) {
  for_each_column_block_vector(src, vectors, row_vectors, stride_vectors,
                               [&](std::size_t i, const uint4& v) { dst[i] = v; });
}

// MXFP8's traffic over a column block with none of its arithmetic: each 16-byte vector of the
// block (`row_vectors` of each bfloat16 source row, rows twice that apart) becomes 8 bytes in the
// same block of a byte matrix (rows 16 row_vectors bytes apart), and every 64 bytes read one byte
// in the same block of the scale matrix (rows row_vectors / 2 bytes apart): the bytes an MXFP8
// conversion of that block reads and writes, where it writes them.
__global__ void __launch_bounds__(kThreads)
    mx_column_block_kernel(const uint4* __restrict__ src, uint2* __restrict__ data,
                           unsigned char* __restrict__ scale, std::size_t vectors,
                           unsigned row_vectors) {
  for_each_column_block_vector(
      src, vectors, row_vectors, 2 * row_vectors, [&](std::size_t i, const uint4& v) {
        const std::size_t row = i / row_vectors, in_row = i % row_vectors;
        // The high byte of each bfloat16 (a stand-in for its FP8 encoding).
        const unsigned lo = __byte_perm(v.x, v.y, 0x7531), hi = __byte_perm(v.z, v.w, 0x7531);
        data[row * 2 * row_vectors + in_row] = make_uint2(lo, hi);
        if (in_row % 4 == 0) scale[row * (2 * row_vectors / 4) + in_row / 4] = lo & 0xff;
      });
}

template <typename Body>
double median_seconds(int repeats, Body body) {
  cudaEvent_t start, stop;
  CHECK(cudaEventCreate(&start));
  CHECK(cudaEventCreate(&stop));
  body();  // warm-up
  std::vector<double> times;
  for (int r = 0; r < repeats; ++r) {
    CHECK(cudaEventRecord(start));
    body();
    CHECK(cudaEventRecord(stop));
    CHECK(cudaEventSynchronize(stop));
    float ms = 0;
    CHECK(cudaEventElapsedTime(&ms, start, stop));
    times.push_back(ms / 1e3);
  }
  std::sort(times.begin(), times.end());
  return times[times.size() / 2];
}

int main(int argc, char** argv) {
  const std::size_t mib = argc > 1 ? std::strtoull(argv[1], nullptr, 10) : 1024;
  const int repeats = argc > 2 ? std::atoi(argv[2]) : 20;
  const std::size_t bytes = mib << 20;  // read by the 1:1 copy
  void *a = nullptr, *b = nullptr;
  CHECK(cudaMalloc(&a, 2 * bytes));
  CHECK(cudaMalloc(&b, 2 * bytes));
  CHECK(cudaMemset(a, 1, 2 * bytes));
  cudaDeviceProp prop{};
  CHECK(cudaGetDeviceProperties(&prop, 0));
  int per_sm = 0;
  CHECK(cudaOccupancyMaxActiveBlocksPerMultiprocessor(&per_sm, stream_kernel<1, 2>, kThreads, 0));
  const unsigned grid = static_cast<unsigned>(prop.multiProcessorCount * per_sm);
  const double memcpy_s = median_seconds(
      repeats, [&] { CHECK(cudaMemcpyAsync(b, a, bytes, cudaMemcpyDeviceToDevice)); });
  const double memcpy_rate = 2.0 * bytes / memcpy_s;
  std::printf("%s: cudaMemcpyAsync of %zu MiB: %.0f GB/s read + written\n", prop.name, mib,
              memcpy_rate / 1e9);
  std::printf("%-28s %10s %12s %8s\n", "kernel (read : written)", "time", "GB/s r+w", "of copy");
  const auto report = [&](const char* name, double seconds, double moved) {
    std::printf("%-28s %8.1f us %12.0f %8.2f\n", name, seconds * 1e6, moved / seconds / 1e9,
                moved / seconds / memcpy_rate);
  };
  const std::size_t vectors = bytes / 16;
  const auto* src = static_cast<const uint4*>(a);
  auto* dst = static_cast<uint4*>(b);
  // One stream_kernel variant: `groups` of its reads, `moved` bytes read + written.
  const auto run = [&](const char* name, auto kernel, double moved) {
    report(name, median_seconds(repeats, [&] { kernel<<<grid, kThreads>>>(src, dst, vectors); }),
           moved);
  };
  run("copy (1 : 1)", stream_kernel<1, 1>, 2.0 * bytes);
  run("widening (1 : 2, bf16->fp32)", stream_kernel<1, 2>, 3.0 * bytes);
  run("narrowing (2 : 1, fp32->bf16)", stream_kernel<2, 1>, 3.0 * bytes);
  run("widening, warp-wide stores", stream_kernel<1, 2, 4, true>, 3.0 * bytes);
  run("widening, 8 loads in flight", stream_kernel<1, 2, 8>, 3.0 * bytes);
  // Column blocks: half of each row read (rows of 4 KiB in 8 KiB, as the left half of a
  // 4096-column bfloat16 matrix; rows of 128 bytes in 256, as of a 128-column one), written dense;
  // then MXFP8's traffic on the same blocks (FP8 data and scales written in place), the most a
  // conversion of them can reach, beside bench-convert's mxfp8 column-block rows.
  auto* data = static_cast<uint2*>(b);
  auto* scales = static_cast<unsigned char*>(b) + bytes;  // the second half of b
  for (const unsigned row_bytes : {4096u, 128u}) {
    const unsigned row_vectors = row_bytes / 16;
    char name[64];
    std::snprintf(name, sizeof name, "column block, rows %u of %u B", row_bytes, 2 * row_bytes);
    report(name,
           median_seconds(repeats,
                          [&] {
                            column_block_kernel<<<grid, kThreads>>>(src, dst, vectors, row_vectors,
                                                                    2 * row_vectors);
                          }),
           2.0 * bytes);
    // The copy engine on the same block (a pitched copy): whether another engine reads such
    // rows faster than a kernel can, or the access pattern itself costs what the kernel loses.
    std::snprintf(name, sizeof name, "  copy engine, rows %u of %u B", row_bytes, 2 * row_bytes);
    const std::size_t rows = bytes / row_bytes;
    report(name,
           median_seconds(repeats,
                          [&] {
                            CHECK(cudaMemcpy2DAsync(b, row_bytes, a, 2 * row_bytes, row_bytes, rows,
                                                    cudaMemcpyDeviceToDevice));
                          }),
           2.0 * bytes);
    std::snprintf(name, sizeof name, "MXFP8-shaped, rows %u of %u B", row_bytes, 2 * row_bytes);
    report(name,
           median_seconds(repeats,
                          [&] {
                            mx_column_block_kernel<<<grid, kThreads>>>(src, data, scales, vectors,
                                                                       row_vectors);
                          }),
           bytes + bytes / 2 + bytes / 64.0);
  }
  CHECK(cudaGetLastError());
  return 0;
}
