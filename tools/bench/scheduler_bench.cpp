#include <chrono>
#include <cmath>
#include <cstdio>
#include <random>

#include "bench/bench.hpp"
#include "reshard/scheduler.hpp"

namespace reshard::bench {

double run_scheduler_bench(const SchedulerBenchOptions& options) {
  std::mt19937_64 rng(options.seed);
  std::vector<Transfer> transfers;
  transfers.reserve(options.requests);
  for (std::uint64_t i = 0; i < options.requests; ++i) {
    const PeId src = static_cast<PeId>(rng() % options.pes);
    const PeId dst = static_cast<PeId>(rng() % options.pes);
    // Log-uniform sizes from 1 B to 4 MiB, as a mix of biases, norms and weight shards.
    const auto bytes = static_cast<std::uint64_t>(std::exp2((rng() % 2200) / 100.0));
    transfers.push_back({i, src, dst, bytes});
  }
  SchedulerOptions scheduler;
  scheduler.chunk_bytes = options.chunk_bytes;
  scheduler.max_peers_per_round = options.max_peers_per_round;
  double best = 1e30;
  Schedule schedule;
  for (int r = 0; r < options.repeats; ++r) {
    const auto start = std::chrono::steady_clock::now();
    schedule = build_schedule(transfers, options.pes, scheduler);
    best = std::min(
        best, std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count());
  }
  std::printf("scheduler: %llu requests over %d PEs, chunk %llu B, k=%d\n",
              static_cast<unsigned long long>(options.requests), options.pes,
              static_cast<unsigned long long>(options.chunk_bytes), options.max_peers_per_round);
  std::printf(
      "  best of %d: %s on one core | %zu batches in %u rounds | makespan / lower "
      "bound %.4f\n",
      options.repeats, format_seconds(best).c_str(), schedule.batches.size(), schedule.rounds,
      schedule.bound_ratio());
  return best;
}

}  // namespace reshard::bench
