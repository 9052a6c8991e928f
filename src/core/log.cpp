#include "reshard/log.hpp"

#include <algorithm>
#include <atomic>
#include <cctype>
#include <cstdio>

#include "reshard/error.hpp"

namespace reshard {
namespace {
std::atomic<int> g_level{static_cast<int>(LogLevel::kInfo)};
std::atomic<int> g_pe{-1};
}  // namespace

LogLevel parse_log_level(const std::string& name) {
  std::string upper = name;
  std::transform(upper.begin(), upper.end(), upper.begin(),
                 [](unsigned char c) { return static_cast<char>(std::toupper(c)); });
  if (upper == "TRACE") return LogLevel::kTrace;
  if (upper == "DEBUG") return LogLevel::kDebug;
  if (upper == "INFO") return LogLevel::kInfo;
  if (upper == "WARN" || upper == "WARNING") return LogLevel::kWarn;
  if (upper == "ERROR") return LogLevel::kError;
  throw_error(ErrorCode::kInvalidArgument,
              "unknown log level '" + name + "' (use TRACE, DEBUG, INFO, WARN or ERROR)");
}

const char* log_level_name(LogLevel level) {
  switch (level) {
    case LogLevel::kTrace:
      return "TRACE";
    case LogLevel::kDebug:
      return "DEBUG";
    case LogLevel::kInfo:
      return "INFO";
    case LogLevel::kWarn:
      return "WARN";
    case LogLevel::kError:
      return "ERROR";
  }
  return "?";
}

void set_log_level(LogLevel level) { g_level = static_cast<int>(level); }
LogLevel log_level() { return static_cast<LogLevel>(g_level.load()); }
void set_log_pe(int pe) { g_pe = pe; }
bool log_enabled(LogLevel level) { return static_cast<int>(level) >= g_level.load(); }

void log_message(LogLevel level, const std::string& message) {
  const int pe = g_pe.load();
  if (pe >= 0) {
    std::fprintf(stderr, "[reshard %s PE %d] %s\n", log_level_name(level), pe, message.c_str());
  } else {
    std::fprintf(stderr, "[reshard %s] %s\n", log_level_name(level), message.c_str());
  }
}

}  // namespace reshard
