#include "reshard/types.hpp"

#include <gtest/gtest.h>

#include "reshard/error.hpp"
#include "reshard/log.hpp"

namespace reshard {
namespace {

TEST(Types, ParsesByteCounts) {
  EXPECT_EQ(parse_bytes("4096"), 4096u);
  EXPECT_EQ(parse_bytes("4KiB"), 4096u);
  EXPECT_EQ(parse_bytes("1.5 MiB"), 1572864u);
  EXPECT_EQ(parse_bytes("2g"), 2147483648u);
  EXPECT_THROW(parse_bytes("lots"), Error);
  EXPECT_THROW(parse_bytes("3 parsecs"), Error);
  EXPECT_THROW(parse_bytes("-1"), Error);
}

TEST(Types, FormatsByteCounts) {
  EXPECT_EQ(format_bytes(0), "0 B");
  EXPECT_EQ(format_bytes(4096), "4 KiB");
  EXPECT_EQ(format_bytes(1572864), "1.5 MiB");
}

TEST(Types, ParsesLogLevels) {
  EXPECT_EQ(parse_log_level("trace"), LogLevel::kTrace);
  EXPECT_EQ(parse_log_level("WARN"), LogLevel::kWarn);
  EXPECT_THROW(parse_log_level("LOUD"), Error);
}

}  // namespace
}  // namespace reshard
