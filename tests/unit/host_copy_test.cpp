// copy_bytes and its vector-move path against memcpy's result, byte for byte, at every size and
// alignment around their thresholds; the bytes around the destination stay untouched.
#include "core/host_copy.hpp"

#include <gtest/gtest.h>

#include <cstddef>
#include <cstdint>
#include <random>
#include <vector>

namespace reshard {
namespace {

using Copy = void (*)(void*, const void*, std::size_t);

void expect_copies_exactly(Copy copy, std::size_t bytes, std::size_t src_offset,
                           std::size_t dst_offset, std::mt19937& rng) {
  std::vector<std::uint8_t> src(bytes + 128), dst(bytes + 128), want;
  for (auto& b : src) b = static_cast<std::uint8_t>(rng());
  for (auto& b : dst) b = static_cast<std::uint8_t>(rng());
  want = dst;
  for (std::size_t i = 0; i < bytes; ++i) want[dst_offset + i] = src[src_offset + i];
  copy(dst.data() + dst_offset, src.data() + src_offset, bytes);
  ASSERT_EQ(dst, want) << bytes << " bytes from offset " << src_offset << " to offset "
                       << dst_offset;
}

TEST(HostCopy, CopiesEverySizeAndAlignmentExactly) {
  std::mt19937 rng(5);
  std::vector<std::size_t> sizes;
  for (std::size_t n = 0; n <= 300; ++n) sizes.push_back(n);
  for (std::size_t n :
       {1023, 1024, 2047, 2048, 2049, 4095, 4096, 65536 + 7, 262143, 262144, 262145, 1 << 20}) {
    sizes.push_back(n);
  }
  for (int i = 0; i < 40; ++i) sizes.push_back(2048 + rng() % (300 << 10));
  for (const Copy copy : {Copy{copy_bytes}, Copy{copy_bytes_by_vectors}}) {
    for (const std::size_t bytes : sizes) {
      expect_copies_exactly(copy, bytes, rng() % 64, rng() % 64, rng);
    }
  }
}

}  // namespace
}  // namespace reshard
