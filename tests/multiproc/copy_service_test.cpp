// Runs on every PE under reshard-run (ctest starts it at 1, 2, 3, 4 and 8 PEs). Every test is
// collective: all PEs run the same tests in the same order.
#include <gtest/gtest.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <memory>
#include <span>
#include <string>
#include <thread>
#include <vector>

#include "bench/workloads.hpp"
#include "core/env.hpp"
#include "reshard/reshard.hpp"
#include "service/service_slot.hpp"
#include "service/test_hooks.hpp"
#include "support/pe_tests.hpp"
#include "support/phase_workload.hpp"
#include "support/strided_workload.hpp"

namespace reshard {
namespace {

using testing_support::all_pes;
using testing_support::bootstrap;

std::unique_ptr<CopyService> make_service() { return testing_support::make_test_service("host"); }

struct Buffers {
  std::vector<std::byte> send;
  std::vector<std::byte> recv;
};

Buffers register_workload(CopyService& service, const bench::Workload& w) {
  const PeId me = service.my_pe();
  Buffers b{std::vector<std::byte>(w.send_buffer_bytes[me]),
            std::vector<std::byte>(w.recv_buffer_bytes[me])};
  const Buffer src = Buffer::host(b.send.data(), b.send.size());
  const Buffer dst = Buffer::host(b.recv.data(), b.recv.size());
  for (const bench::WorkItem& item : w.items) {
    if (item.src == me)
      service.register_send(item.task, src, item.src_offset, item.bytes, item.dst);
    if (item.dst == me)
      service.register_receive(item.task, dst, item.dst_offset, item.bytes, item.src);
  }
  return b;
}

// Runs once with sources filled for `iteration`; returns the wrong bytes on this PE.
std::uint64_t run_and_verify(CopyService& service, const bench::Workload& w, Buffers& b,
                             std::uint32_t iteration) {
  bench::prepare_buffers(w, service.my_pe(), iteration, b.send, b.recv);
  bootstrap()->barrier();
  service.run();
  bootstrap()->barrier();
  return bench::verify_receive_buffer(w, service.my_pe(), iteration, b.recv);
}

class Workloads : public testing::TestWithParam<std::tuple<std::string, std::uint64_t>> {};

TEST_P(Workloads, EveryByteArrivesOnEveryRunAndNothingElseIsWritten) {
  const auto& [kind, size] = GetParam();
  auto service = make_service();
  for (std::uint64_t seed : {1, 2}) {
    const auto w = bench::make_workload(kind, service->n_pes(), size, seed);
    Buffers b = register_workload(*service, w);
    const ScheduleReport report = service->schedule();
    EXPECT_GE(report.makespan_bytes, report.lower_bound_bytes);
    // Three runs of one schedule, each with fresh source bytes.
    for (std::uint32_t iteration = 1; iteration <= 3; ++iteration) {
      const std::uint64_t wrong = run_and_verify(*service, w, b, iteration);
      EXPECT_EQ(wrong, 0u) << kind << " size " << size << " seed " << seed << " run " << iteration;
    }
    service->clear_requests();
  }
  service->finalize();
}

INSTANTIATE_TEST_SUITE_P(HostTransport, Workloads,
                         testing::Combine(testing::Values("uniform", "random", "small", "refit"),
                                          testing::Values(std::uint64_t{1}, std::uint64_t{4097},
                                                          std::uint64_t{(1 << 20) + 3})));

// The job's bootstrap (TCP under reshard-run, MPI's ranks under mpirun: ctest runs this suite
// both ways): the last PE comes to a collective 3 s after the others gave it up (2 s timeout);
// every PE fails that one alike, retryably, naming the late PE, and the next collective gathers
// every PE's part of it. (MPI's own collectives, which the MPI bootstrap used before, cannot be
// given up: the late rank's part met the next collective.)
TEST(Bootstrap, ACollectiveALatePeMissedFailsAlikeAndTheNextOneWorks) {
  Bootstrap& job = *bootstrap();
  if (job.size() < 2) GTEST_SKIP() << "needs a late peer";
  const int me = job.rank(), late = job.size() - 1;
  job.barrier();
  job.set_timeout(std::chrono::seconds(2));
  std::vector<std::string> outcomes;
  for (int round = 0; round < 2; ++round) {
    if (me == late && round == 0) std::this_thread::sleep_for(std::chrono::seconds(3));
    const std::string mine = std::to_string(me) + "." + std::to_string(round);
    try {
      std::string joined;
      for (const auto& part : job.all_gather(std::as_bytes(std::span(mine))))
        joined += std::string(reinterpret_cast<const char*>(part.data()), part.size()) + " ";
      outcomes.push_back(joined);
    } catch (const CollectiveAbandoned& error) {
      EXPECT_TRUE(error.retryable()) << error.what();
      EXPECT_EQ(error.late(), std::vector<int>{late}) << error.what();
      outcomes.push_back("abandoned");
    }
  }
  job.set_timeout(env::timeout());
  std::string expected;
  for (int pe = 0; pe < job.size(); ++pe) expected += std::to_string(pe) + ".1 ";
  EXPECT_EQ(outcomes, (std::vector<std::string>{"abandoned", expected}));
  job.barrier();
  EXPECT_TRUE(all_pes(!HasFailure()));
}

TEST(CopyService, ManySchedulesOfRandomWorkloadsOnOneService) {
  auto service = make_service();
  for (std::uint64_t seed = 10; seed < 40; ++seed) {
    const auto w =
        bench::make_workload(seed % 2 ? "random" : "small", service->n_pes(), 1 + seed * 997, seed);
    Buffers b = register_workload(*service, w);
    service->schedule();
    EXPECT_EQ(run_and_verify(*service, w, b, static_cast<std::uint32_t>(seed)), 0u) << seed;
    service->clear_requests();
  }
}

// Verify mode: clean runs pass; a byte flipped after a transfer is reported on every PE with the
// task that carried it, and the service stays usable.
TEST(VerifyMode, CleanRunsPassAndCorruptionIsNamedOnEveryPe) {
  auto service = make_service();
  service->set_verify(true);
  const auto w = bench::make_workload("random", service->n_pes(), 4099, 5);
  Buffers b = register_workload(*service, w);
  service->schedule();
  for (std::uint32_t iteration = 1; iteration <= 2; ++iteration)
    EXPECT_EQ(run_and_verify(*service, w, b, iteration), 0u);
  // The last request with bytes in it; every PE picks the same.
  TaskId victim = 0;
  for (const bench::WorkItem& item : w.items)
    if (item.bytes > 0) victim = item.task;
  test_hooks::ServiceProbe::corrupt_receives_after_run(*service, victim);
  std::string message;
  std::vector<std::uint64_t> tasks;
  try {
    run_and_verify(*service, w, b, 3);
  } catch (const Error& error) {
    EXPECT_EQ(error.code(), ErrorCode::kIntegrity);
    message = error.what();
    tasks = error.tasks();
  }
  test_hooks::ServiceProbe::corrupt_receives_after_run(*service, std::nullopt);
  EXPECT_NE(message.find("task " + std::to_string(victim) + " "), std::string::npos) << message;
  EXPECT_EQ(tasks, std::vector<std::uint64_t>{victim});
  EXPECT_EQ(run_and_verify(*service, w, b, 4), 0u);  // still usable, and clean again
  EXPECT_TRUE(all_pes(!HasFailure()));
}

// Stress: random schedules (kinds, sizes, seeds), each run several times and checked byte for
// byte, half of them in verify mode, for RESHARD_STRESS_SECONDS (default 10) per PE count.
TEST(Stress, RandomSchedulesWithRepeatedRunsStayExact) {
  const char* seconds_text = std::getenv("RESHARD_STRESS_SECONDS");
  const double budget = seconds_text ? std::atof(seconds_text) : 10.0;
  auto service = make_service();
  const auto start = std::chrono::steady_clock::now();
  const char* kinds[] = {"uniform", "random", "small", "refit"};
  std::uint64_t schedules = 0, runs = 0;
  for (std::uint64_t seed = 1000;; ++seed) {
    const double elapsed =
        std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
    // Every PE stops at the same schedule, on time or at the first failure anywhere.
    if (!all_pes(elapsed < budget && !HasFailure())) break;
    const std::uint64_t size = 1 + (seed * 2654435761u) % (1u << (seed % 18));
    const auto w = bench::make_workload(kinds[seed % 4], service->n_pes(), size, seed);
    service->set_verify(seed % 2 == 0);
    Buffers b = register_workload(*service, w);
    service->schedule();
    ++schedules;
    for (std::uint32_t iteration = 0; iteration < 1 + seed % 3; ++iteration, ++runs) {
      EXPECT_EQ(run_and_verify(*service, w, b, iteration), 0u)
          << kinds[seed % 4] << " size " << size << " seed " << seed << " run " << iteration;
    }
    service->clear_requests();
  }
  if (service->my_pe() == 0)
    std::printf("stress: %llu schedules, %llu runs\n", static_cast<unsigned long long>(schedules),
                static_cast<unsigned long long>(runs));
  EXPECT_GT(schedules, 0u);
}

// A setting that shapes the schedule, set on one PE only: every PE still builds the same schedule
// (the smallest chunk any PE allows), so the bytes arrive and the reports agree.
TEST(CopyService, PesAgreeOnTheScheduleWhenOnlyOneSetsTheChunk) {
  const int me = bootstrap()->rank();
  if (me == 0) ::setenv("RESHARD_CHUNK_BYTES", "4KiB", 1);
  auto service = make_service();
  const auto w = bench::make_workload("uniform", service->n_pes(), 100000, 5);
  Buffers b = register_workload(*service, w);
  const ScheduleReport report = service->schedule();
  if (me == 0) ::unsetenv("RESHARD_CHUNK_BYTES");
  for (std::uint32_t iteration = 1; iteration <= 2; ++iteration)
    EXPECT_EQ(run_and_verify(*service, w, b, iteration), 0u) << "run " << iteration;
  // 100,000 bytes per pair in batches of at most 4 KiB: 25 per pair, on every PE's report.
  const int n = service->n_pes();
  const std::uint64_t pairs = static_cast<std::uint64_t>(n) * (n - 1);
  EXPECT_EQ(report.batches, pairs * 25);
  const std::uint64_t mine[2] = {report.batches, report.rounds};
  const auto reports = bootstrap()->all_gather(std::as_bytes(std::span(mine)));
  for (int pe = 0; pe < n; ++pe)
    EXPECT_TRUE(reports[pe] == reports[0]) << "PE " << pe << " differs";
  service->finalize();
}

// Options are per service: two services of one process, one cutting batches at 4 KiB and one at
// the transport's own size, each schedule as its options say, although the environment says
// something else again when they are made (a service made from options does not read it).
TEST(CopyService, TwoServicesInOneProcessKeepTheirOwnOptions) {
  CopyServiceOptions small = CopyServiceOptions::from_environment();
  small.transport = testing_support::transport_under_test("host");
  small.chunk_bytes = 4096;
  small.log_level = LogLevel::kWarn;
  CopyServiceOptions plain = small;
  plain.chunk_bytes.reset();
  ::setenv("RESHARD_CHUNK_BYTES", "8KiB", 1);
  CopyService cut(bootstrap(), small), whole(bootstrap(), plain);
  cut.init();
  whole.init();
  ::unsetenv("RESHARD_CHUNK_BYTES");
  EXPECT_EQ(cut.options().chunk_bytes, 4096u);
  EXPECT_FALSE(whole.options().chunk_bytes.has_value());
  const auto w = bench::make_workload("uniform", cut.n_pes(), 100000, 5);
  Buffers cut_buffers = register_workload(cut, w), whole_buffers = register_workload(whole, w);
  const ScheduleReport cut_report = cut.schedule(), whole_report = whole.schedule();
  const int n = cut.n_pes();
  const std::uint64_t pairs = static_cast<std::uint64_t>(n) * (n - 1);
  EXPECT_EQ(cut_report.batches, pairs * 25);  // 100,000 bytes per pair, 4 KiB at a time
  if (n > 1) EXPECT_LT(whole_report.batches, pairs * 13);  // fewer than 8 KiB batches need
  for (std::uint32_t iteration = 1; iteration <= 2; ++iteration) {
    EXPECT_EQ(run_and_verify(cut, w, cut_buffers, iteration), 0u) << "run " << iteration;
    EXPECT_EQ(run_and_verify(whole, w, whole_buffers, iteration + 10), 0u) << "run " << iteration;
  }
  EXPECT_TRUE(all_pes(!HasFailure()));
}

TEST(CopyService, ReportsProperties) {
  auto service = make_service();
  EXPECT_TRUE(service->initialized());
  EXPECT_EQ(service->my_pe(), bootstrap()->rank());
  EXPECT_EQ(service->n_pes(), bootstrap()->size());
  EXPECT_EQ(service->device(), -1);
  service->finalize();
  EXPECT_FALSE(service->initialized());
}

// Every PE must refuse the same bad request set with the same message.
// schedule() is refused on every PE with `expected` in the message and `tasks` among the tasks
// the error carries.
void expect_refused_everywhere(CopyService& service, const std::string& expected,
                               const std::vector<TaskId>& tasks = {}) {
  std::string message;
  std::vector<TaskId> carried;
  try {
    service.schedule();
  } catch (const Error& error) {
    EXPECT_EQ(error.code(), ErrorCode::kValidation);
    message = error.what();
    carried = error.tasks();
  }
  EXPECT_NE(message.find(expected), std::string::npos) << "got: " << message;
  for (TaskId task : tasks) {
    EXPECT_NE(std::find(carried.begin(), carried.end(), task), carried.end())
        << "task " << task << " not among the error's tasks; message: " << message;
  }
  EXPECT_TRUE(all_pes(message.find(expected) != std::string::npos));
  service.clear_requests();
}

TEST(CopyServiceValidation, RefusesBadRequestSetsOnEveryPeAndStaysUsable) {
  auto service = make_service();
  const PeId me = service->my_pe();
  const int n = service->n_pes();
  const PeId last = n - 1;
  std::vector<std::byte> memory(4096, std::byte{0});
  const Buffer buffer = Buffer::host(memory.data(), memory.size());

  if (me == 0) service->register_send(999, buffer, 0, 16, last);
  expect_refused_everywhere(*service, "task 999: send of 16 bytes from PE 0 to PE " +
                                          std::to_string(last) + " has no matching receive");

  if (me == 0) service->register_send(5, buffer, 0, 100, last);
  if (me == last) service->register_receive(5, buffer, 1000, 99, 0);
  expect_refused_everywhere(*service, "task 5: PE 0 sends 100 bytes but PE " +
                                          std::to_string(last) + " expects 99 bytes");

  if (me == 0) {
    service->register_send(7, buffer, 0, 8, last);
    service->register_send(7, buffer, 8, 8, last);
  }
  if (me == last) service->register_receive(7, buffer, 2000, 8, 0);
  expect_refused_everywhere(*service, "task 7 has more than one send", {7});

  if (me == last) {
    service->register_receive(21, buffer, 100, 50, 0);
    service->register_receive(22, buffer, 140, 50, 0);
  }
  if (me == 0) {
    service->register_send(21, buffer, 0, 50, last);
    service->register_send(22, buffer, 0, 50, last);
  }
  expect_refused_everywhere(*service,
                            "PE " + std::to_string(last) +
                                ": destination ranges of task 21 (50 bytes) and task "
                                "22 (50 bytes) overlap by 10 bytes",
                            {21, 22});

  // Still usable: a valid exchange after the refusals.
  const auto w = bench::make_workload("random", n, 333, 5);
  Buffers b = register_workload(*service, w);
  service->schedule();
  EXPECT_EQ(run_and_verify(*service, w, b, 9), 0u);
}

// PEs in different collective calls at the same point (a program whose ranks call them in a
// different order): every PE fails that meeting alike, naming the calls, with nothing done, and
// calls made in step afterwards work.
TEST(CopyService, PesInDifferentCollectiveCallsFailTheMeetingAlikeAndGoOn) {
  auto service = make_service();
  const PeId me = service->my_pe();
  const int n = service->n_pes();
  if (n < 2) GTEST_SKIP() << "needs 2 PEs";
  const auto w = bench::make_workload("uniform", n, 4096, 3);
  Buffers b = register_workload(*service, w);
  try {
    if (me == 0) {
      service->schedule();
    } else {
      execution::ServiceSlot::meet(*service, {}, "bind()");
    }
    ADD_FAILURE() << "a meeting of different calls went through on PE " << me;
  } catch (const Error& error) {
    const std::string text = error.what();
    EXPECT_EQ(error.code(), ErrorCode::kInvalidState) << text;
    EXPECT_FALSE(error.retryable()) << text;  // the program is to be mended
    EXPECT_NE(text.find(me == 0 ? "schedule() on PE 0 met other calls: PE 1 bind()"
                                : "bind() on PE " + std::to_string(me) +
                                      " met other calls: PE 0 schedule()"),
              std::string::npos)
        << text;
    EXPECT_NE(text.find("nothing took effect"), std::string::npos) << text;
  }
  service->schedule();
  EXPECT_EQ(run_and_verify(*service, w, b, 4), 0u);
}

// Strided ranges: each side cuts the stream into rows of its own; every row lands in place, no
// gap byte is written, over several runs of one schedule, with chunks that cut rows in the middle,
// local tasks among them, and in verify mode.
TEST(StridedRanges, EveryRowLandsInPlaceAndNoGapIsWritten) {
  auto service = make_service();
  const PeId me = service->my_pe();
  EXPECT_TRUE(execution::ServiceSlot::moves_rows_in_place(*service));
  for (std::uint64_t seed = 1; seed <= 12; ++seed) {
    const auto w = testing_support::make_strided_workload(service->n_pes(), seed, 24,
                                                          seed % 3 == 0 ? 40000 : 700);
    // Odd chunk sizes cut rows mid-way; every PE sets the same.
    if (seed % 2 == 0) ::setenv("RESHARD_CHUNK_BYTES", seed % 4 == 0 ? "1000" : "333", 1);
    service->set_verify(seed % 3 == 1);
    std::vector<std::byte> send = testing_support::strided_send_buffer(w, me, 0);
    std::vector<std::byte> receive(w.receive_bytes[me], testing_support::kUntouched);
    const Buffer src = Buffer::host(send.data(), send.size());
    const Buffer dst = Buffer::host(receive.data(), receive.size());
    for (const auto& t : w.tasks) {
      if (t.src == me) service->register_send(t.task, src, t.send, t.dst);
      if (t.dst == me) service->register_receive(t.task, dst, t.receive, t.src);
    }
    service->schedule();
    ::unsetenv("RESHARD_CHUNK_BYTES");
    for (std::uint32_t iteration = 1; iteration <= 3; ++iteration) {
      const auto fresh = testing_support::strided_send_buffer(w, me, iteration);
      std::copy(fresh.begin(), fresh.end(), send.begin());  // in the registered memory
      bootstrap()->barrier();
      service->run();
      bootstrap()->barrier();
      const auto expected = testing_support::strided_expected_receive(w, me, iteration);
      std::size_t wrong = 0, first = 0;
      for (std::size_t i = 0; i < expected.size(); ++i) {
        if (receive[i] != expected[i] && wrong++ == 0) first = i;
      }
      EXPECT_EQ(wrong, 0u) << "seed " << seed << " run " << iteration << ": first wrong byte at "
                           << first;
    }
    service->clear_requests();
  }
  service->set_verify(false);
  EXPECT_TRUE(all_pes(!HasFailure()));
}

// Column blocks of one matrix from two senders interleave without overlapping; rows of one
// receive that overlap each other, and a strided range reaching past its buffer, are refused
// naming the task.
TEST(StridedRanges, InterleavedBlocksAreAcceptedAndOverlapsAndOverreachRefused) {
  auto service = make_service();
  const PeId me = service->my_pe();
  const PeId last = service->n_pes() - 1;
  constexpr std::uint64_t kRows = 64, kRowBytes = 48;
  std::vector<std::byte> source(kRows * kRowBytes);
  for (std::size_t i = 0; i < source.size(); ++i) source[i] = static_cast<std::byte>(i * 13 + me);
  std::vector<std::byte> matrix(kRows * 2 * kRowBytes, testing_support::kUntouched);
  const Buffer src = Buffer::host(source.data(), source.size());
  const Buffer dst = Buffer::host(matrix.data(), matrix.size());
  // PE 0 and PE `last` each send their whole source; PE `last` receives them as the left and
  // the right half of every row of a kRows x 2*kRowBytes matrix.
  for (int half = 0; half < 2; ++half) {
    const PeId sender = half == 0 ? 0 : last;
    const TaskId task = 50 + half;
    if (me == sender) service->register_send(task, src, 0, source.size(), last);
    if (me == last) {
      const std::size_t column = half * kRowBytes;
      service->register_receive(
          task, dst, StridedRange::matrix(column, kRows, kRowBytes, 2 * kRowBytes), sender);
    }
  }
  service->schedule();
  service->run();
  if (me == last) {
    std::size_t wrong = 0;
    for (std::uint64_t r = 0; r < kRows; ++r) {
      for (std::uint64_t c = 0; c < 2 * kRowBytes; ++c) {
        const int from = c < kRowBytes ? 0 : last;
        const std::uint64_t i = r * kRowBytes + c % kRowBytes;
        wrong += matrix[r * 2 * kRowBytes + c] != static_cast<std::byte>(i * 13 + from);
      }
    }
    EXPECT_EQ(wrong, 0u);
  }
  service->clear_requests();

  // Rows 40 bytes apart, 48 long: they overlap each other.
  if (me == 0) service->register_send(60, src, 0, 10 * kRowBytes, last);
  if (me == last) service->register_receive(60, dst, StridedRange::matrix(0, 10, kRowBytes, 40), 0);
  expect_refused_everywhere(*service, "the rows of the destination range of task 60 overlap", {60});

  try {
    service->register_receive(61, dst, StridedRange::matrix(64, kRows, kRowBytes, 2 * kRowBytes),
                              0);
    ADD_FAILURE() << "a strided range past the end of its buffer was accepted";
  } catch (const Error& error) {
    const std::string message = error.what();
    EXPECT_EQ(error.code(), ErrorCode::kInvalidArgument);
    EXPECT_NE(message.find("task 61"), std::string::npos) << message;
    EXPECT_NE(message.find("64 rows of 48 bytes"), std::string::npos) << message;
    EXPECT_NE(message.find("reaches byte 6160, outside"), std::string::npos) << message;
    EXPECT_EQ(error.tasks(), std::vector<TaskId>{61});
  }
  EXPECT_TRUE(all_pes(!HasFailure()));
}

// Phases: every phase receives into the same scratch; after run_phase(p) the scratch holds phase
// p's blocks, so a phase's bytes landed after the previous phase's were read. A PE with nothing
// to move in a phase runs it all the same; run() runs every phase in order; verify mode checks
// each phase's tasks right after it.
TEST(Phases, EachPhaseLandsInTheMemoryTheLastOneUsed) {
  auto service = make_service();
  const PeId me = service->my_pe();
  const testing_support::PhaseWorkload w{.n_pes = service->n_pes()};
  std::vector<std::byte> source(w.send_bytes()), scratch(w.scratch_bytes());
  w.register_on(*service, Buffer::host(source.data(), source.size()),
                Buffer::host(scratch.data(), scratch.size()));
  const ScheduleReport report = service->schedule();
  EXPECT_EQ(report.phases, w.phases());
  EXPECT_EQ(service->phases(), w.phases());
  for (std::uint32_t iteration = 1; iteration <= 3; ++iteration) {
    service->set_verify(iteration == 3);
    const std::vector<std::byte> fill = w.source(me, iteration);
    std::copy(fill.begin(), fill.end(), source.begin());  // in place: the registered memory
    bootstrap()->barrier();
    for (std::uint32_t p = 0; p < w.phases(); ++p) {
      service->run_phase(p);
      EXPECT_EQ(w.wrong_after(me, iteration, p, scratch), 0u)
          << "run " << iteration << " phase " << p;
    }
  }
  service->set_verify(false);
  const std::vector<std::byte> fill = w.source(me, 4);
  std::copy(fill.begin(), fill.end(), source.begin());
  bootstrap()->barrier();
  service->run();  // every phase: the scratch holds the last dense phase's blocks and the tail
  EXPECT_EQ(w.wrong_after(me, 4, w.dense_phases - 1, scratch), 0u);
  EXPECT_EQ(w.wrong_after(me, 4, w.dense_phases, scratch), 0u);
  EXPECT_TRUE(all_pes(!HasFailure()));
}

TEST(Phases, MismatchedPhasesAndPhasesOutOfRangeAreRefused) {
  auto service = make_service();
  const PeId me = service->my_pe();
  const PeId last = service->n_pes() - 1;
  std::vector<std::byte> memory(4096, std::byte{0});
  const Buffer buffer = Buffer::host(memory.data(), memory.size());
  if (me == 0) {
    service->set_phase(1);
    service->register_send(41, buffer, 0, 64, last);
  }
  if (me == last) {
    service->set_phase(2);
    service->register_receive(41, buffer, 1024, 64, 0);
  }
  expect_refused_everywhere(*service,
                            "task 41: PE 0 sends it in phase 1 but PE " + std::to_string(last) +
                                " receives it in phase 2",
                            {41});
  // clear_requests() went back to phase 0: these two meet there.
  if (me == 0) service->register_send(42, buffer, 0, 64, last);
  if (me == last) service->register_receive(42, buffer, 2048, 64, 0);
  EXPECT_EQ(service->schedule().phases, 1u);
  try {
    service->run_phase(1);
    ADD_FAILURE() << "run_phase(1) of a schedule of one phase was accepted";
  } catch (const Error& error) {
    EXPECT_EQ(error.code(), ErrorCode::kInvalidArgument);
    EXPECT_NE(std::string(error.what()).find("the schedule has 1 phase"), std::string::npos)
        << error.what();
  }
  service->run();  // still usable
  EXPECT_THROW(service->set_phase(1u << 20), Error);
  EXPECT_TRUE(all_pes(!HasFailure()));
}

TEST(CopyServiceValidation, RefusesBadArgumentsAtRegistration) {
  auto service = make_service();
  std::vector<std::byte> memory(100);
  const Buffer buffer = Buffer::host(memory.data(), memory.size());
  try {
    service->register_send(3, buffer, 90, 20, 0);
    ADD_FAILURE() << "range outside the buffer was accepted";
  } catch (const Error& error) {
    EXPECT_EQ(error.code(), ErrorCode::kInvalidArgument);
    EXPECT_NE(std::string(error.what()).find("task 3"), std::string::npos) << error.what();
    EXPECT_NE(std::string(error.what()).find("outside"), std::string::npos) << error.what();
  }
  try {
    service->register_receive(4, buffer, 0, 10, service->n_pes());
    ADD_FAILURE() << "a PE out of range was accepted";
  } catch (const Error& error) {
    EXPECT_NE(std::string(error.what()).find("source PE " + std::to_string(service->n_pes())),
              std::string::npos)
        << error.what();
  }
  EXPECT_THROW(service->register_send(5, buffer, 0, 10, -1), Error);
  EXPECT_THROW(service->register_send(6, Buffer::cuda(memory.data(), 100, 0), 0, 10, 0), Error);
  EXPECT_THROW(service->register_send(7, Buffer::host(nullptr, 100), 0, 10, 0), Error);
}

TEST(CopyServiceValidation, RefusesCallsOutOfOrder) {
  std::vector<std::byte> memory(100);
  const Buffer buffer = Buffer::host(memory.data(), memory.size());
  CopyService uninitialised(bootstrap(), TransportKind::kHost);
  EXPECT_THROW(uninitialised.register_send(1, buffer, 0, 1, 0), Error);
  EXPECT_THROW(uninitialised.schedule(), Error);

  auto service = make_service();
  try {
    service->run();
    ADD_FAILURE() << "run() before schedule() was accepted";
  } catch (const Error& error) {
    EXPECT_EQ(error.code(), ErrorCode::kInvalidState);
    EXPECT_NE(std::string(error.what()).find("run() before schedule()"), std::string::npos);
  }
  EXPECT_THROW(service->init(), Error);
  service->finalize();
  EXPECT_THROW(service->register_send(1, buffer, 0, 1, 0), Error);
  EXPECT_THROW(service->run(), Error);
  service->finalize();  // twice is fine
}

}  // namespace
}  // namespace reshard

int main(int argc, char** argv) { return reshard::testing_support::run_pe_tests(argc, argv); }
