// The copy descriptors the CUDA and NVSHMEM transports build from a plan's spans: appending the
// rows of strided ranges folds them into 2-D descriptors, and every byte must still go from where
// its span said to where its span said, in stream order.
#include <gtest/gtest.h>

#include <cstdint>
#include <random>
#include <vector>

#include "gpu/device_work.hpp"

namespace reshard::cuda {
namespace {

struct Piece {
  std::uint64_t src, dst, bytes;
};

// (src, dst) of every byte the descriptors copy, in stream order (addresses as offsets from a
// null base, never dereferenced).
std::vector<std::pair<std::uint64_t, std::uint64_t>> bytes_of(
    const std::vector<CopyDescriptor>& list) {
  std::vector<std::pair<std::uint64_t, std::uint64_t>> out;
  std::uint64_t stream = 0;
  for (const CopyDescriptor& d : list) {
    EXPECT_EQ(d.offset, stream);
    stream += d.bytes;
    const auto src = reinterpret_cast<std::uintptr_t>(d.src);
    const auto dst = reinterpret_cast<std::uintptr_t>(d.dst);
    for (std::uint64_t i = 0; i < d.bytes; ++i) {
      if (!d.has_rows()) {
        out.emplace_back(src + i, dst + i);
        continue;
      }
      EXPECT_EQ(d.bytes % d.row_bytes, 0u);
      const std::uint64_t r = i / d.row_bytes, c = i % d.row_bytes;
      out.emplace_back(src + r * d.src_pitch + c, dst + r * d.dst_pitch + c);
    }
  }
  return out;
}

std::vector<std::pair<std::uint64_t, std::uint64_t>> bytes_of(const std::vector<Piece>& pieces) {
  std::vector<std::pair<std::uint64_t, std::uint64_t>> out;
  for (const Piece& p : pieces)
    for (std::uint64_t i = 0; i < p.bytes; ++i) out.emplace_back(p.src + i, p.dst + i);
  return out;
}

std::vector<CopyDescriptor> append_all(const std::vector<Piece>& pieces, std::size_t first = 0,
                                       std::vector<CopyDescriptor> list = {}) {
  std::uint64_t stream = 0;
  for (const Piece& p : pieces) {
    append_copy(list, first, stream, reinterpret_cast<const unsigned char*>(p.src),
                reinterpret_cast<unsigned char*>(p.dst), p.bytes);
  }
  return list;
}

TEST(CopyDescriptors, RowsOfAColumnBlockBecomeOneDescriptor) {
  // 64 rows of 4 KiB from a contiguous shard into every other 4 KiB of an 8 KiB-wide matrix.
  std::vector<Piece> rows;
  for (std::uint64_t r = 0; r < 64; ++r)
    rows.push_back({0x10000 + r * 4096, 0x900000 + r * 8192, 4096});
  const auto list = append_all(rows);
  ASSERT_EQ(list.size(), 1u);
  EXPECT_EQ(list[0].row_bytes, 4096u);
  EXPECT_EQ(list[0].src_pitch, 4096u);
  EXPECT_EQ(list[0].dst_pitch, 8192u);
  EXPECT_EQ(list[0].bytes, 64u * 4096);
  EXPECT_EQ(bytes_of(list), bytes_of(rows));
}

TEST(CopyDescriptors, ContiguousPiecesMergeAndOtherGroupsAreLeftAlone) {
  const std::vector<Piece> pieces{{100, 5000, 10}, {110, 5010, 30}, {140, 5040, 2}};
  const auto list = append_all(pieces);
  ASSERT_EQ(list.size(), 1u);
  EXPECT_FALSE(list[0].has_rows());
  EXPECT_EQ(list[0].bytes, 42u);
  // A descriptor of another group before `first` is never extended.
  std::vector<CopyDescriptor> earlier{
      {reinterpret_cast<const unsigned char*>(58), reinterpret_cast<unsigned char*>(4958), 42, 0}};
  const auto both = append_all(pieces, 1, earlier);
  ASSERT_EQ(both.size(), 2u);
  EXPECT_EQ(both[0].bytes, 42u);
}

// Random spans (strided runs, contiguous runs, repeats of a row length that do not line up):
// whatever folds, every byte keeps its source and destination.
TEST(CopyDescriptors, RandomSpansKeepEveryByteInPlace) {
  std::mt19937_64 rng(7);
  for (int trial = 0; trial < 300; ++trial) {
    std::vector<Piece> pieces;
    std::uint64_t src = 1 << 20, dst = 1 << 30;
    for (int run = 0; run < 1 + static_cast<int>(rng() % 6); ++run) {
      const std::uint64_t row = 1 + rng() % 64, rows = 1 + rng() % 20;
      const std::uint64_t src_pitch = row + rng() % 3 * (rng() % 40);
      const std::uint64_t dst_pitch = row + rng() % 3 * (rng() % 40);
      for (std::uint64_t r = 0; r < rows; ++r) {
        // Now and then a row is cut in two, as a chunk boundary cuts it.
        if (rng() % 8 == 0 && row > 1) {
          const std::uint64_t cut = 1 + rng() % (row - 1);
          pieces.push_back({src + r * src_pitch, dst + r * dst_pitch, cut});
          pieces.push_back({src + r * src_pitch + cut, dst + r * dst_pitch + cut, row - cut});
        } else {
          pieces.push_back({src + r * src_pitch, dst + r * dst_pitch, row});
        }
      }
      src += rows * src_pitch + rng() % 100;
      dst += rows * dst_pitch + rng() % 100;
    }
    const auto list = append_all(pieces);
    EXPECT_LE(list.size(), pieces.size());
    ASSERT_EQ(bytes_of(list), bytes_of(pieces)) << "trial " << trial;
  }
}

}  // namespace
}  // namespace reshard::cuda
