// Verify mode's checksum fed in pieces (GPU ranges arrive through a host chunk) must equal the
// checksum of the whole range in one call, or a correct GPU transfer would be reported corrupt.
#include "core/checksum.hpp"

#include <gtest/gtest.h>

#include <random>
#include <vector>

namespace reshard {
namespace {

TEST(Checksum, PiecesOfAnySizeGiveTheWholeRangesValue) {
  std::mt19937_64 rng(7);
  for (int trial = 0; trial < 300; ++trial) {
    std::vector<std::byte> data(rng() % 5000);
    for (auto& b : data) b = static_cast<std::byte>(rng());
    const std::uint64_t whole = checksum64(data.data(), data.size());
    Checksum64 pieces(data.size());
    for (std::size_t at = 0; at < data.size();) {
      const std::size_t n = std::min<std::size_t>(data.size() - at, rng() % 97);
      pieces.update(data.data() + at, n);
      at += n;
    }
    ASSERT_EQ(pieces.digest(), whole) << "size " << data.size() << " trial " << trial;
  }
}

TEST(Checksum, OneFlippedBitOrAMovedByteChangesIt) {
  std::vector<std::byte> data(1000);
  for (std::size_t i = 0; i < data.size(); ++i) data[i] = static_cast<std::byte>(i * 31 + 7);
  const std::uint64_t clean = checksum64(data.data(), data.size());
  for (std::size_t i : {0ul, 31ul, 32ul, 511ul, 999ul}) {
    data[i] ^= std::byte{0x10};
    EXPECT_NE(checksum64(data.data(), data.size()), clean) << "byte " << i;
    data[i] ^= std::byte{0x10};
  }
  std::swap(data[3], data[700]);
  EXPECT_NE(checksum64(data.data(), data.size()), clean);
  // The length counts: a range and its prefix differ even where the extra bytes are zero.
  std::vector<std::byte> zeros(64, std::byte{0});
  EXPECT_NE(checksum64(zeros.data(), 63), checksum64(zeros.data(), 64));
}

}  // namespace
}  // namespace reshard
