#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <fstream>
#include <memory>

#include "bench/bench.hpp"
#include "bench/workloads.hpp"
#include "reshard/error.hpp"

namespace reshard::bench {
namespace {

using Clock = std::chrono::steady_clock;

struct AlignedBytes {
  explicit AlignedBytes(std::size_t bytes)
      : size(bytes),
        data(static_cast<std::byte*>(
            std::aligned_alloc(64, std::max<std::size_t>(64, (bytes + 63) / 64 * 64)))) {
    if (!data)
      throw_error(ErrorCode::kSystem, "out of memory for a " + format_bytes(bytes) + " buffer");
  }
  ~AlignedBytes() { std::free(data); }
  std::span<std::byte> span() const { return {data, size}; }
  std::size_t size;
  std::byte* data;
};

struct Row {
  std::string workload;
  int pes = 0;
  std::uint64_t requests = 0;
  std::uint64_t bound_bytes = 0;
  double seconds_per_run = 0;
  double memcpy_seconds = 0;
  double verify_seconds_per_run = 0;
  double bound_ratio = 0;
  std::uint32_t rounds = 0;
  std::uint64_t wrong_bytes = 0;
};

Row bench_workload(Bootstrap& bootstrap, CopyService& service, const Workload& workload,
                   const CopyBenchOptions& options) {
  const PeId me = bootstrap.rank();
  AlignedBytes send_buffer(workload.send_buffer_bytes[me]);
  AlignedBytes recv_buffer(workload.recv_buffer_bytes[me]);
  const Buffer src = Buffer::host(send_buffer.data, send_buffer.size);
  const Buffer dst = Buffer::host(recv_buffer.data, recv_buffer.size);
  for (const WorkItem& item : workload.items) {
    if (item.src == me)
      service.register_send(item.task, src, item.src_offset, item.bytes, item.dst);
    if (item.dst == me) {
      service.register_receive(item.task, dst, item.dst_offset, item.bytes, item.src);
    }
  }
  const ScheduleReport report = service.schedule();

  Row row;
  row.workload = workload.name;
  row.pes = workload.n_pes;
  row.requests = workload.items.size();
  row.bound_bytes = report.lower_bound_bytes;
  row.bound_ratio = report.bound_ratio();
  row.rounds = report.rounds;

  // Verified run before timing, and again after with fresh source bytes: run() must re-read them.
  auto verified_run = [&](std::uint32_t iteration) {
    prepare_buffers(workload, me, iteration, send_buffer.span(), recv_buffer.span());
    bootstrap.barrier();
    service.run();
    bootstrap.barrier();  // every sender done before the receive buffer is judged
    return verify_receive_buffer(workload, me, iteration, recv_buffer.span());
  };
  std::uint64_t wrong = verified_run(1);
  for (int i = 0; i < options.warmup; ++i) service.run();

  Progress progress("bench " + workload.name, me == 0, std::chrono::seconds(2));
  bootstrap.barrier();
  const auto start = Clock::now();
  for (int i = 0; i < options.iterations; ++i) {
    service.run();
    progress.note(std::to_string(i + 1) + "/" + std::to_string(options.iterations) + " runs");
  }
  bootstrap.barrier();
  const double elapsed = std::chrono::duration<double>(Clock::now() - start).count();
  row.seconds_per_run = max_over_pes(bootstrap, elapsed) / options.iterations;
  wrong += verified_run(2);
  if (options.verify) {
    // The same runs in verify mode: checksums on both sides and one all-gather per run.
    service.set_verify(true);
    bootstrap.barrier();
    const auto verify_start = Clock::now();
    for (int i = 0; i < options.iterations; ++i) service.run();
    bootstrap.barrier();
    const double verify_elapsed =
        std::chrono::duration<double>(Clock::now() - verify_start).count();
    row.verify_seconds_per_run = max_over_pes(bootstrap, verify_elapsed) / options.iterations;
    service.set_verify(false);
  }

  // The host ceiling: every PE copies the bound's bytes with one memcpy, all at once.
  const std::size_t copy_bytes = std::max<std::uint64_t>(report.lower_bound_bytes, 1);
  AlignedBytes copy_from(copy_bytes), copy_to(copy_bytes);
  std::memset(copy_from.data, 1, copy_bytes);
  std::memset(copy_to.data, 0, copy_bytes);
  bootstrap.barrier();
  const auto copy_start = Clock::now();
  for (int i = 0; i < options.iterations; ++i)
    std::memcpy(copy_to.data, copy_from.data, copy_bytes);
  bootstrap.barrier();
  const double copy_elapsed = std::chrono::duration<double>(Clock::now() - copy_start).count();
  row.memcpy_seconds = max_over_pes(bootstrap, copy_elapsed) / options.iterations;

  for (std::uint64_t pe_wrong : gather_from_pes(bootstrap, wrong)) row.wrong_bytes += pe_wrong;
  service.clear_requests();
  return row;
}

double gbps(std::uint64_t bytes, double seconds) { return seconds > 0 ? bytes / seconds / 1e9 : 0; }

// The table is printed a row at a time, as each workload finishes (a long run shows progress).
void print_header(const CopyBenchOptions& options, int pes, const char* transport) {
  std::printf("reshard bench: transport %s, %d PEs, size %s, %d timed runs after %d warm-up\n",
              transport, pes, format_bytes(options.size).c_str(), options.iterations,
              options.warmup);
  std::printf("%-8s %9s %11s %11s %10s %10s %9s %8s %7s %s%s\n", "workload", "requests", "bytes/PE",
              "time/run", "GB/s/PE", "memcpy", "vs copy", "sched", "rounds",
              options.verify ? "verify-mode " : "", "verified");
  std::fflush(stdout);
}

void print_row(const Row& r, const CopyBenchOptions& options) {
  const double achieved = gbps(r.bound_bytes, r.seconds_per_run);
  const double ceiling = gbps(r.bound_bytes, r.memcpy_seconds);
  char verify_cell[32] = "";
  if (options.verify) {
    std::snprintf(verify_cell, sizeof verify_cell, "%9.2fx  ",
                  r.seconds_per_run > 0 ? r.verify_seconds_per_run / r.seconds_per_run : 0.0);
  }
  std::printf(
      "%-8s %9llu %11s %9.1f us %10.2f %10.2f %8.2fx %7.3fx %7u %s%s\n", r.workload.c_str(),
      static_cast<unsigned long long>(r.requests), format_bytes(r.bound_bytes).c_str(),
      r.seconds_per_run * 1e6, achieved, ceiling, ceiling > 0 ? achieved / ceiling : 0.0,
      r.bound_ratio, r.rounds, verify_cell,
      r.wrong_bytes == 0 ? "yes" : (std::to_string(r.wrong_bytes) + " WRONG BYTES").c_str());
  std::fflush(stdout);
}

void print_footer(const CopyBenchOptions& options) {
  std::printf(
      "bytes/PE: the lower bound, max over PEs of bytes sent or received; GB/s/PE: that over "
      "time/run;\nmemcpy: one memcpy of the same bytes on every PE at once, measured in this run; "
      "sched: simulated makespan / lower bound%s.\n",
      options.verify ? "; verify-mode: time/run with checksums on, over time/run without" : "");
}

void append_json(const std::string& path, const std::vector<Row>& rows,
                 const CopyBenchOptions& options, const char* transport) {
  std::ofstream out(path, std::ios::app);
  if (!out) throw_error(ErrorCode::kSystem, "cannot write benchmark results to " + path);
  const auto now = std::chrono::system_clock::to_time_t(std::chrono::system_clock::now());
  char date[32];
  std::strftime(date, sizeof date, "%Y-%m-%dT%H:%M:%SZ", std::gmtime(&now));
  for (const Row& r : rows) {
    out << "{\"bench\":\"copy\",\"date\":\"" << date << "\",\"versions\":\"" << component_versions()
        << "\",\"transport\":\"" << transport << "\",\"workload\":\"" << r.workload
        << "\",\"pes\":" << r.pes << ",\"size\":" << options.size << ",\"requests\":" << r.requests
        << ",\"bound_bytes\":" << r.bound_bytes << ",\"seconds_per_run\":" << r.seconds_per_run
        << ",\"memcpy_seconds\":" << r.memcpy_seconds << ",\"sched_ratio\":" << r.bound_ratio
        << ",\"rounds\":" << r.rounds << ",\"wrong_bytes\":" << r.wrong_bytes;
    if (options.verify) out << ",\"verify_seconds_per_run\":" << r.verify_seconds_per_run;
    out << "}\n";
  }
}

}  // namespace

std::uint64_t run_copy_bench(std::shared_ptr<Bootstrap> bootstrap,
                             const CopyBenchOptions& options) {
  CopyService service(bootstrap, bench_service_options(options.transport));
  service.init(LogLevel::kWarn);
  std::vector<Row> rows;
  std::uint64_t wrong = 0;
  const bool printing = bootstrap->rank() == 0;
  if (printing) print_header(options, bootstrap->size(), "host");
  for (const std::string& kind : options.workloads) {
    const Workload workload = make_workload(kind, bootstrap->size(), options.size, options.seed);
    rows.push_back(bench_workload(*bootstrap, service, workload, options));
    wrong += rows.back().wrong_bytes;
    if (printing) print_row(rows.back(), options);
  }
  if (printing) {
    print_footer(options);
    if (!options.json_path.empty()) append_json(options.json_path, rows, options, "host");
    std::fflush(stdout);
  }
  service.finalize();
  return wrong;
}

}  // namespace reshard::bench
