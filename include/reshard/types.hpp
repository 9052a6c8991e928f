// Vocabulary types shared by every layer: PEs, task ids and caller-owned buffers.
#pragma once

#include <array>
#include <chrono>
#include <cstddef>
#include <cstdint>
#include <string>

namespace reshard {

using PeId = int;
using TaskId = std::uint64_t;

enum class MemoryKind : std::uint8_t { kHost, kCuda };

// A caller-owned region of memory. reshard never allocates or frees it; requests address byte
// ranges inside it, and the range checks are made against `bytes`.
struct Buffer {
  void* data = nullptr;
  std::size_t bytes = 0;
  MemoryKind kind = MemoryKind::kHost;
  int device = -1;  // CUDA device ordinal for kCuda, -1 for host memory

  static Buffer host(void* data, std::size_t bytes) { return {data, bytes, MemoryKind::kHost, -1}; }
  static Buffer cuda(void* data, std::size_t bytes, int device) {
    return {data, bytes, MemoryKind::kCuda, device};
  }
};

std::string describe(const Buffer& buffer);

// A byte range laid out as rows: `rows()` rows of `row_bytes` contiguous bytes, row r starting at
// `pos` plus the offset its index reaches through `extent` / `stride` (row-major over `dims`
// outer dimensions, strides in bytes). Its bytes travel in row order, so a column block of a
// row-major matrix is sent or received in place: no packing into a contiguous buffer, and a
// sender's rows need not look like its receiver's. `dims == 0` is one contiguous run of
// `row_bytes` bytes.
struct StridedRange {
  // Outer dimensions over the rows (a tensor's dimensions but its last; a block of a tensor of
  // kMaxDims dimensions, layout.hpp, needs at most kMaxDims - 1 of them).
  static constexpr int kMaxOuterDims = 7;
  std::size_t pos = 0;
  std::uint64_t row_bytes = 0;
  int dims = 0;
  std::array<std::uint64_t, kMaxOuterDims> extent{};
  std::array<std::uint64_t, kMaxOuterDims> stride{};

  static StridedRange contiguous(std::size_t pos, std::size_t bytes) { return {pos, bytes}; }
  // `rows` rows of `row_bytes`, `pitch` bytes apart (a 2-D box, as cudaMemcpy2D takes it).
  static StridedRange matrix(std::size_t pos, std::uint64_t rows, std::uint64_t row_bytes,
                             std::uint64_t pitch) {
    StridedRange range{pos, row_bytes, 1};
    range.extent[0] = rows;
    range.stride[0] = pitch;
    return range;
  }

  std::uint64_t rows() const;
  std::uint64_t bytes() const { return rows() * row_bytes; }
  // Offset from `pos` of the first byte of `row`.
  std::uint64_t row_offset(std::uint64_t row) const;
  // Offset from `pos` just past the last byte any row covers (0 when empty).
  std::uint64_t reach() const;
  // The same bytes in the fewest dimensions: rows that follow each other without a gap merge
  // into longer ones, dimensions of extent 1 drop out. All rows adjacent: dims == 0.
  StridedRange simplified() const;
  bool is_contiguous() const { return simplified().dims == 0; }
};

// Human-readable byte counts for messages and tables ("4 KiB", "1.5 MiB").
std::string format_bytes(std::uint64_t bytes);
// A duration in seconds for messages ("600 s", "2.5 s").
std::string format_seconds(std::chrono::milliseconds duration);

// Parses "4096", "4KiB", "4K", "1.5MiB", "2G" into bytes; throws kInvalidArgument otherwise.
std::uint64_t parse_bytes(const std::string& text);

}  // namespace reshard
