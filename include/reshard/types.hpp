// Vocabulary types shared by every layer: PEs, task ids and caller-owned buffers.
#pragma once

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

// Human-readable byte counts for messages and tables ("4 KiB", "1.5 MiB").
std::string format_bytes(std::uint64_t bytes);

// Parses "4096", "4KiB", "4K", "1.5MiB", "2G" into bytes; throws kInvalidArgument otherwise.
std::uint64_t parse_bytes(const std::string& text);

}  // namespace reshard
