#include "core/env.hpp"

#include <cstdlib>

#include "reshard/error.hpp"
#include "reshard/types.hpp"

namespace reshard::env {

std::optional<std::string> get(const char* name) {
  const char* value = std::getenv(name);
  if (value == nullptr || *value == '\0') return std::nullopt;
  return std::string(value);
}

int get_int(const char* name, int fallback) {
  auto value = get(name);
  if (!value) return fallback;
  try {
    std::size_t used = 0;
    int parsed = std::stoi(*value, &used);
    if (used == value->size()) return parsed;
  } catch (const std::exception&) {
  }
  throw_error(ErrorCode::kInvalidArgument,
              std::string(name) + "='" + *value + "' is not an integer");
}

namespace {

std::chrono::milliseconds positive_seconds(const char* name, std::chrono::milliseconds unset) {
  auto value = get(name);
  if (!value) return unset;
  try {
    double seconds = std::stod(*value);
    if (seconds > 0) return std::chrono::milliseconds(static_cast<long long>(seconds * 1000));
  } catch (const std::exception&) {
  }
  throw_error(ErrorCode::kInvalidArgument,
              std::string(name) + "='" + *value + "' is not a positive number of seconds");
}

}  // namespace

std::chrono::milliseconds timeout() {
  return positive_seconds("RESHARD_TIMEOUT_S", std::chrono::milliseconds(30000));
}

std::chrono::milliseconds arrival_timeout() {
  return positive_seconds("RESHARD_ARRIVAL_TIMEOUT_S", std::chrono::milliseconds(600000));
}

std::optional<LogLevel> log_level() {
  auto value = get("RESHARD_LOG_LEVEL");
  if (!value) return std::nullopt;
  return parse_log_level(*value);
}

std::optional<std::uint64_t> staging_budget() {
  auto value = get("RESHARD_STAGING_BUDGET");
  if (!value) return std::nullopt;
  if (*value == "unlimited") return UINT64_MAX;
  try {
    return parse_bytes(*value);
  } catch (const Error& error) {
    throw_error(ErrorCode::kInvalidArgument, "RESHARD_STAGING_BUDGET=" + *value +
                                                 ": not a byte count such as 512MiB, or "
                                                 "'unlimited' (" +
                                                 error.what() + ")");
  }
}

std::optional<std::string> job_id() { return get("RESHARD_JOB_ID"); }

std::optional<std::string> transport() { return get("RESHARD_TRANSPORT"); }

}  // namespace reshard::env
