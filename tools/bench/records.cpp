// What every benchmark record carries besides its measurements.
#include <ctime>
#include <string>

#include "bench/bench.hpp"
#include "core/env.hpp"

namespace reshard::bench {

std::string utc_date() {
  const std::time_t now = std::time(nullptr);
  char text[32];
  std::strftime(text, sizeof text, "%Y-%m-%d", std::gmtime(&now));
  return text;
}

CopyServiceOptions bench_service_options(TransportKind transport) {
  CopyServiceOptions options = CopyServiceOptions::from_environment();
  options.transport = transport;
  if (!env::get("RESHARD_NCCL_NONBLOCKING")) options.nccl.nonblocking = false;
  return options;
}

}  // namespace reshard::bench
