// What every benchmark record carries besides its measurements.
#include <ctime>
#include <string>

#include "bench/bench.hpp"

namespace reshard::bench {

std::string utc_date() {
  const std::time_t now = std::time(nullptr);
  char text[32];
  std::strftime(text, sizeof text, "%Y-%m-%d", std::gmtime(&now));
  return text;
}

}  // namespace reshard::bench
