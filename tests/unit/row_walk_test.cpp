// The index arithmetic of the batched kernels, on the host: FastDivisor against the division it
// replaces, RowWalk against BoxView::row_start for blocks of random tensors.
#include "execution/row_walk.hpp"

#include <gtest/gtest.h>

#include <random>

namespace reshard::execution {
namespace {

TEST(FastDivisor, DividesEvery32BitNumberLikeTheDivision) {
  std::mt19937_64 rng(5);
  std::vector<std::uint32_t> divisors = {1,
                                         2,
                                         3,
                                         5,
                                         7,
                                         8,
                                         24,
                                         100,
                                         641,
                                         1u << 20,
                                         (1u << 31) - 1,
                                         1u << 31,
                                         (1u << 31) + 1,
                                         0xfffffffeu,
                                         0xffffffffu};
  for (int i = 0; i < 200; ++i)
    divisors.push_back(static_cast<std::uint32_t>(rng() >> (rng() % 32)) | 1);
  for (std::uint32_t d : divisors) {
    const FastDivisor f = FastDivisor::of(d);
    std::vector<std::uint32_t> numbers = {0,           1,           d - 1,       d,          d + 1,
                                          0x7fffffffu, 0x80000000u, 0xfffffffeu, 0xffffffffu};
    for (std::uint32_t k : {2u, 3u, 1000u}) numbers.push_back(d * k - 1), numbers.push_back(d * k);
    for (int j = 0; j < 2000; ++j) numbers.push_back(static_cast<std::uint32_t>(rng()));
    for (std::uint32_t n : numbers) {
      ASSERT_EQ(f.divide(n), n / d) << n << " / " << d;
    }
  }
}

TEST(RowWalk, FindsEveryRowOfRandomBlocksLikeTheView) {
  std::mt19937 rng(9);
  int even = 0;
  for (int trial = 0; trial < 3000; ++trial) {
    const int dims = 1 + static_cast<int>(rng() % 5);
    std::vector<std::int64_t> shape(dims);
    Box box{dims, {}, {}};
    for (int d = 0; d < dims; ++d) {
      shape[d] = 1 + rng() % 6;
      box.offset[d] = rng() % shape[d];
      // Often the whole extent, so some blocks' rows are evenly spaced across dimensions.
      box.extent[d] = rng() % 2 ? shape[d] - box.offset[d] : 1 + rng() % (shape[d] - box.offset[d]);
      if (box.extent[d] == shape[d] - box.offset[d] && rng() % 2) {
        box.offset[d] = 0;
        box.extent[d] = shape[d];
      }
    }
    const BoxView view = view_of(box, shape, rng() % 2 == 0);
    std::vector<BoxView> uneven;
    const RowWalk walk = RowWalk::of(view, uneven);
    ASSERT_EQ(uneven.size(), walk.view < 0 ? 0u : 1u);
    even += walk.view < 0 && view.outer_dims > 1;
    for (std::int64_t row = 0; row < view.rows; ++row) {
      ASSERT_EQ(walk.row_start(row, uneven.data()), view.row_start(row))
          << "row " << row << " of block " << box.str() << " (stride " << walk.stride << ")";
    }
  }
  EXPECT_GT(even, 100);  // the trials reached the multi-dimensional even case
}

}  // namespace
}  // namespace reshard::execution
