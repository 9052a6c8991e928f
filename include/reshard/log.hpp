// Leveled logging to stderr, prefixed with the PE so interleaved multi-process output stays
// legible.
#pragma once

#include <sstream>
#include <string>

namespace reshard {

enum class LogLevel { kTrace = 0, kDebug = 1, kInfo = 2, kWarn = 3, kError = 4 };

LogLevel parse_log_level(const std::string& name);  // TRACE/DEBUG/INFO/WARN/ERROR, any case
const char* log_level_name(LogLevel level);

void set_log_level(LogLevel level);
LogLevel log_level();
void set_log_pe(int pe);
bool log_enabled(LogLevel level);
void log_message(LogLevel level, const std::string& message);

}  // namespace reshard

#define RESHARD_LOG(level, expr)                                                     \
  do {                                                                               \
    if (::reshard::log_enabled(::reshard::LogLevel::level)) {                        \
      std::ostringstream reshard_log_stream_;                                        \
      reshard_log_stream_ << expr;                                                   \
      ::reshard::log_message(::reshard::LogLevel::level, reshard_log_stream_.str()); \
    }                                                                                \
  } while (0)
