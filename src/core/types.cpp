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

std::uint64_t StridedRange::rows() const {
  std::uint64_t rows = 1;
  for (int d = 0; d < dims; ++d) rows *= extent[d];
  return rows;
}

std::uint64_t StridedRange::row_offset(std::uint64_t row) const {
  std::uint64_t offset = 0;
  for (int d = dims - 1; d >= 0; --d) {
    offset += (row % extent[d]) * stride[d];
    row /= extent[d];
  }
  return offset;
}

std::uint64_t StridedRange::reach() const {
  if (bytes() == 0) return 0;
  std::uint64_t last = 0;
  for (int d = 0; d < dims; ++d) last += (extent[d] - 1) * stride[d];
  return last + row_bytes;
}

StridedRange StridedRange::simplified() const {
  StridedRange out{pos, row_bytes};
  for (int d = 0; d < dims; ++d) {
    if (extent[d] == 1) continue;
    out.extent[out.dims] = extent[d];
    out.stride[out.dims] = stride[d];
    ++out.dims;
  }
  // Innermost first: rows as far apart as they are long are one longer row; then an outer
  // dimension whose stride spans exactly its inner one merges into it.
  while (out.dims > 0 && out.stride[out.dims - 1] == out.row_bytes) {
    out.row_bytes *= out.extent[out.dims - 1];
    --out.dims;
  }
  for (int d = out.dims - 1; d > 0; --d) {
    if (out.stride[d - 1] != out.stride[d] * out.extent[d]) continue;
    out.extent[d - 1] *= out.extent[d];
    out.stride[d - 1] = out.stride[d];
    for (int e = d; e + 1 < out.dims; ++e) {
      out.extent[e] = out.extent[e + 1];
      out.stride[e] = out.stride[e + 1];
    }
    --out.dims;
  }
  if (out.rows() * out.row_bytes == 0) return {pos, 0};
  return out;
}

std::string format_seconds(std::chrono::milliseconds duration) {
  std::ostringstream text;
  text << static_cast<double>(duration.count()) / 1000.0 << " s";
  return text.str();
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
