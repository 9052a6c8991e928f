#include "reshard/error.hpp"

#include <cerrno>
#include <cstring>
#include <unordered_set>

namespace reshard {

const char* error_code_name(ErrorCode code) {
  switch (code) {
    case ErrorCode::kInvalidArgument:
      return "invalid argument";
    case ErrorCode::kInvalidState:
      return "invalid state";
    case ErrorCode::kValidation:
      return "validation";
    case ErrorCode::kTimeout:
      return "timeout";
    case ErrorCode::kPeerFailure:
      return "peer failure";
    case ErrorCode::kSystem:
      return "system";
    case ErrorCode::kUnsupported:
      return "unsupported";
    case ErrorCode::kIntegrity:
      return "integrity";
    case ErrorCode::kInterrupted:
      return "interrupted";
  }
  return "unknown";
}

std::vector<std::uint64_t> Error::unique_in_order(std::vector<std::uint64_t> tasks) {
  std::unordered_set<std::uint64_t> seen;
  std::erase_if(tasks, [&](std::uint64_t task) { return !seen.insert(task).second; });
  return tasks;
}

void throw_error(ErrorCode code, const std::string& message) {
  throw Error(code, "reshard: " + message);
}

void throw_system_error(const std::string& what) {
  const int saved = errno;
  throw_error(ErrorCode::kSystem, what + ": " + std::strerror(saved));
}

}  // namespace reshard
