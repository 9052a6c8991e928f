// The device side of a run's copies, for the copy kernels (copy_kernels.cu includes it, alone):
// vectors in flight per thread, pieces of any alignment, the rows of a copy descriptor, and the
// descriptor a byte of a group's stream falls in.
#pragma once

#include <cstdint>

#include "gpu/copy_kernels.hpp"

namespace reshard::cuda {
namespace {

// Copies n elements of V with kUnroll loads in flight per thread before their stores; `lane` of
// `width` threads (a whole CTA, or one warp).
template <typename V, int kUnroll>
__device__ __forceinline__ void copy_vectors(const V* __restrict__ src, V* __restrict__ dst,
                                             std::uint64_t n, std::uint32_t lane,
                                             std::uint32_t width) {
  const std::uint64_t stride = width;
  std::uint64_t i = lane;
  for (; i + (kUnroll - 1) * stride < n; i += kUnroll * stride) {
    V values[kUnroll];
#pragma unroll
    for (int k = 0; k < kUnroll; ++k) values[k] = __ldg(src + i + k * stride);
#pragma unroll
    for (int k = 0; k < kUnroll; ++k) dst[i + k * stride] = values[k];
  }
  for (; i < n; i += stride) dst[i] = __ldg(src + i);
}

template <typename V, int kUnroll>
__device__ __forceinline__ void copy_aligned(const unsigned char* src, unsigned char* dst,
                                             std::uint64_t bytes, std::uint32_t lane,
                                             std::uint32_t width) {
  constexpr std::uint64_t kSize = sizeof(V);
  // Bytes before src (and so dst) reaches a multiple of the vector size, then the vectors, then
  // the tail: every CTA stays on the vector path whatever the caller's offsets.
  const std::uint64_t misalign = reinterpret_cast<std::uintptr_t>(src) % kSize;
  const std::uint64_t head = misalign == 0 ? 0 : min(kSize - misalign, bytes);
  for (std::uint64_t i = lane; i < head; i += width) dst[i] = src[i];
  const std::uint64_t vectors = (bytes - head) / kSize;
  copy_vectors<V, kUnroll>(reinterpret_cast<const V*>(src + head), reinterpret_cast<V*>(dst + head),
                           vectors, lane, width);
  const std::uint64_t done = head + vectors * kSize;
  for (std::uint64_t i = done + lane; i < bytes; i += width) dst[i] = src[i];
}

__device__ void copy_piece(const unsigned char* src, unsigned char* dst, std::uint64_t bytes,
                           int unroll, std::uint32_t lane, std::uint32_t width) {
  const std::uintptr_t relative =
      reinterpret_cast<std::uintptr_t>(src) ^ reinterpret_cast<std::uintptr_t>(dst);
  if (relative % 16 == 0) {
    if (unroll == 4)
      copy_aligned<uint4, 4>(src, dst, bytes, lane, width);
    else
      copy_aligned<uint4, 8>(src, dst, bytes, lane, width);
  } else if (relative % 8 == 0) {
    copy_aligned<uint2, 8>(src, dst, bytes, lane, width);
  } else if (relative % 4 == 0) {
    copy_aligned<unsigned int, 8>(src, dst, bytes, lane, width);
  } else {
    copy_aligned<unsigned char, 8>(src, dst, bytes, lane, width);
  }
}

// Bytes [from, to) of a descriptor's rows, 16-byte vectors only (every address, length and pitch
// a multiple of 16): each of the team's threads walks its vectors with a running (row, column)
// instead of dividing per vector, kUnroll loads in flight before their stores.
template <int kUnroll>
__device__ __forceinline__ void copy_row_vectors(const CopyDescriptor& d, std::uint64_t from,
                                                 std::uint64_t to, std::uint32_t lane,
                                                 std::uint32_t width) {
  const auto* src = reinterpret_cast<const uint4*>(d.src);
  auto* dst = reinterpret_cast<uint4*>(d.dst);
  const std::uint64_t row = d.row_bytes / 16, src_pitch = d.src_pitch / 16,
                      dst_pitch = d.dst_pitch / 16;
  const std::uint64_t end = to / 16;
  std::uint64_t v = from / 16 + lane;
  if (v >= end) return;
  const std::uint64_t step_rows = width / row, step_cols = width % row;
  std::uint64_t r = v / row, c = v % row;
  auto advance = [&] {
    c += step_cols;
    r += step_rows;
    if (c >= row) {
      c -= row;
      ++r;
    }
  };
  for (; v + (kUnroll - 1) * static_cast<std::uint64_t>(width) < end; v += kUnroll * width) {
    uint4 values[kUnroll];
    std::uint64_t at[kUnroll];
#pragma unroll
    for (int k = 0; k < kUnroll; ++k) {
      values[k] = __ldg(src + r * src_pitch + c);
      at[k] = r * dst_pitch + c;
      advance();
    }
#pragma unroll
    for (int k = 0; k < kUnroll; ++k) dst[at[k]] = values[k];
  }
  for (; v < end; v += width) {
    dst[r * dst_pitch + c] = __ldg(src + r * src_pitch + c);
    advance();
  }
}

// Bytes [from, to) of a descriptor's rows (see CopyDescriptor), by a team of `width` threads.
__device__ void copy_rows(const CopyDescriptor& d, std::uint64_t from, std::uint64_t to, int unroll,
                          std::uint32_t lane, std::uint32_t width) {
  const std::uintptr_t any = reinterpret_cast<std::uintptr_t>(d.src) |
                             reinterpret_cast<std::uintptr_t>(d.dst) | d.row_bytes | d.src_pitch |
                             d.dst_pitch | from | to;
  if (any % 16 == 0) {
    if (unroll == 4)
      copy_row_vectors<4>(d, from, to, lane, width);
    else
      copy_row_vectors<8>(d, from, to, lane, width);
    return;
  }
  // Rows not in whole vectors: a warp of the team per row, with copy_piece's alignment handling.
  const std::uint32_t warp = lane / 32, warps = max(1u, width / 32);
  const std::uint64_t first_row = from / d.row_bytes, last_row = (to - 1) / d.row_bytes;
  for (std::uint64_t r = first_row + warp; r <= last_row; r += warps) {
    const std::uint64_t begin = max(from, r * d.row_bytes) - r * d.row_bytes;
    const std::uint64_t end = min(to, (r + 1) * d.row_bytes) - r * d.row_bytes;
    copy_piece(d.src + r * d.src_pitch + begin, d.dst + r * d.dst_pitch + begin, end - begin,
               unroll, lane % 32, min(32u, width));
  }
}

// First descriptor of `first[0..count)` whose range ends after `at` (descriptors are sorted by
// their offset in the group's byte stream and do not overlap).
__device__ std::uint32_t descriptor_at(const CopyDescriptor* first, std::uint32_t count,
                                       std::uint64_t at) {
  std::uint32_t lo = 0, hi = count;
  while (hi - lo > 1) {
    const std::uint32_t mid = (lo + hi) / 2;
    if (first[mid].offset <= at)
      lo = mid;
    else
      hi = mid;
  }
  return lo;
}

}  // namespace
}  // namespace reshard::cuda
