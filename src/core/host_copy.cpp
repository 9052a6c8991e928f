#include "core/host_copy.hpp"

#include <algorithm>
#include <chrono>
#include <cstring>
#include <vector>

namespace reshard {
namespace {

// Sizes memcpy may copy with `rep movsb` (glibc's threshold is 2-8 KiB; from a few hundred KiB on
// it switches to its own vector or non-temporal loops again).
constexpr std::size_t kChoiceFrom = 2048;
constexpr std::size_t kChoiceBelow = std::size_t{256} << 10;

// The fastest of a few timed copies of 64 KiB, in seconds.
template <typename Copy>
double fastest_copy(std::vector<std::byte>& to, const std::vector<std::byte>& from, Copy copy) {
  double best = 1e9;
  for (int repeat = 0; repeat < 16; ++repeat) {
    const auto start = std::chrono::steady_clock::now();
    copy(to.data(), from.data(), to.size());
    best = std::min(
        best, std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count());
  }
  return best;
}

bool vectors_faster_here() {
  std::vector<std::byte> from(64 << 10, std::byte{1}), to(64 << 10, std::byte{2});
  const double by_memcpy =
      fastest_copy(to, from, [](void* d, const void* s, std::size_t n) { std::memcpy(d, s, n); });
  const double by_vectors = fastest_copy(to, from, copy_bytes_by_vectors);
  return by_vectors < 0.8 * by_memcpy;  // memcpy unless clearly slower
}

}  // namespace

// Fixed 64-byte memcpys compile to vector moves; the loop is kept a loop (GCC would otherwise turn
// it back into a call of memcpy).
#if defined(__GNUC__) && !defined(__clang__)
__attribute__((optimize("no-tree-loop-distribute-patterns")))
#endif
void copy_bytes_by_vectors(void* dst, const void* src, std::size_t bytes) {
  auto* to = static_cast<std::byte*>(dst);
  const auto* from = static_cast<const std::byte*>(src);
  std::size_t at = 0;
  for (; at + 64 <= bytes; at += 64) std::memcpy(to + at, from + at, 64);
  if (at < bytes) std::memcpy(to + at, from + at, bytes - at);
}

bool copy_bytes_uses_vectors() {
  static const bool vectors = vectors_faster_here();
  return vectors;
}

void copy_bytes(void* dst, const void* src, std::size_t bytes) {
  if (bytes >= kChoiceFrom && bytes < kChoiceBelow && copy_bytes_uses_vectors()) {
    copy_bytes_by_vectors(dst, src, bytes);
    return;
  }
  std::memcpy(dst, src, bytes);
}

}  // namespace reshard
