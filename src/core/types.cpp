#include "reshard/types.hpp"

#include <cctype>
#include <cmath>
#include <cstdio>
#include <sstream>

#include "reshard/error.hpp"

namespace reshard {

std::string describe(const Buffer& buffer) {
  std::ostringstream out;
  out << (buffer.kind == MemoryKind::kHost ? "host" : "cuda:" + std::to_string(buffer.device))
      << " buffer " << buffer.data << " of " << buffer.bytes << " bytes";
  return out.str();
}

std::string format_bytes(std::uint64_t bytes) {
  static const char* const kUnits[] = {"B", "KiB", "MiB", "GiB", "TiB"};
  double value = static_cast<double>(bytes);
  int unit = 0;
  while (value >= 1024.0 && unit < 4) {
    value /= 1024.0;
    ++unit;
  }
  char text[32];
  if (unit == 0 || value == std::floor(value)) {
    std::snprintf(text, sizeof text, "%.0f %s", value, kUnits[unit]);
  } else {
    std::snprintf(text, sizeof text, "%.1f %s", value, kUnits[unit]);
  }
  return text;
}

std::uint64_t parse_bytes(const std::string& text) {
  std::size_t used = 0;
  double number = 0;
  try {
    number = std::stod(text, &used);
  } catch (const std::exception&) {
    throw_error(ErrorCode::kInvalidArgument, "cannot read a byte count from '" + text + "'");
  }
  std::string suffix;
  for (std::size_t i = used; i < text.size(); ++i) {
    if (!std::isspace(static_cast<unsigned char>(text[i]))) {
      suffix += static_cast<char>(std::toupper(static_cast<unsigned char>(text[i])));
    }
  }
  double scale = 1;
  if (suffix.empty() || suffix == "B") {
    scale = 1;
  } else if (suffix == "K" || suffix == "KB" || suffix == "KIB") {
    scale = 1024.0;
  } else if (suffix == "M" || suffix == "MB" || suffix == "MIB") {
    scale = 1024.0 * 1024;
  } else if (suffix == "G" || suffix == "GB" || suffix == "GIB") {
    scale = 1024.0 * 1024 * 1024;
  } else {
    throw_error(ErrorCode::kInvalidArgument,
                "unknown byte unit in '" + text + "' (use B, KiB, MiB or GiB)");
  }
  if (number < 0) throw_error(ErrorCode::kInvalidArgument, "negative byte count '" + text + "'");
  return static_cast<std::uint64_t>(std::llround(number * scale));
}

}  // namespace reshard
