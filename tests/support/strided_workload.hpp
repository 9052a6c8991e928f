// Random strided requests for the copy service's tests: every task moves a byte stream whose
// sender and receiver each cut it into rows of their own (any row length that makes up the same
// total, up to three outer dimensions, gaps between rows), between random PEs or within one.
// Every PE derives the same workload from the seed. Bytes in the gaps must never be written.
#pragma once

#include <cstddef>
#include <cstdint>
#include <random>
#include <vector>

#include "reshard/types.hpp"

namespace reshard::testing_support {

struct StridedTask {
  TaskId task = 0;
  PeId src = 0, dst = 0;
  StridedRange send, receive;  // in the sender's and the receiver's buffer
};

struct StridedWorkload {
  std::vector<StridedTask> tasks;
  std::vector<std::size_t> send_bytes, receive_bytes;  // buffer size per PE
};

// A layout of `bytes` bytes: rows of a random divisor of it (at most kMaxRows of them), split
// over up to three dimensions with gaps, placed at `at` (which moves past it).
inline StridedRange random_rows(std::uint64_t bytes, std::size_t& at, std::mt19937_64& rng) {
  constexpr std::uint64_t kMaxRows = 4096;
  std::vector<std::uint64_t> divisors;
  for (std::uint64_t d = 1; d * d <= bytes; ++d) {
    if (bytes % d != 0) continue;
    for (std::uint64_t row : {d, bytes / d})
      if (bytes / row <= kMaxRows) divisors.push_back(row);
  }
  const std::uint64_t row = divisors[rng() % divisors.size()];
  std::uint64_t rows = bytes / row;
  StridedRange range{at, row};
  if (rows == 1 && rng() % 2 == 0) {
    at += row + rng() % 8;
    return range;  // contiguous
  }
  // Split rows into up to three extents, innermost last.
  std::vector<std::uint64_t> extents;
  for (int d = 0; d < 2 && rows > 1; ++d) {
    std::vector<std::uint64_t> factors;
    for (std::uint64_t f = 1; f <= rows; ++f)  // rows <= kMaxRows
      if (rows % f == 0) factors.push_back(f);
    const std::uint64_t f = factors[rng() % factors.size()];
    extents.insert(extents.begin(), f);
    rows /= f;
  }
  extents.insert(extents.begin(), rows);
  range.dims = static_cast<int>(extents.size());
  std::uint64_t stride = row + rng() % 3 * (1 + rng() % 16);  // some without gaps
  for (int d = range.dims - 1; d >= 0; --d) {
    range.extent[d] = extents[d];
    range.stride[d] = stride;
    stride = stride * extents[d] + rng() % 3 * (1 + rng() % 8);
  }
  at += range.reach() + rng() % 8;
  return range;
}

inline StridedWorkload make_strided_workload(int n_pes, std::uint64_t seed, int tasks,
                                             std::uint64_t max_bytes) {
  std::mt19937_64 rng(seed);
  StridedWorkload w;
  w.send_bytes.assign(n_pes, 0);
  w.receive_bytes.assign(n_pes, 0);
  for (int t = 0; t < tasks; ++t) {
    StridedTask task;
    task.task = 1000 + static_cast<TaskId>(t);
    task.src = static_cast<PeId>(rng() % n_pes);
    task.dst = static_cast<PeId>(rng() % n_pes);
    // Mostly composite sizes (many ways to cut them), some primes and single bytes.
    std::uint64_t bytes = 1 + rng() % max_bytes;
    if (rng() % 4 != 0) bytes = (bytes / 12 + 1) * 12;
    task.send = random_rows(bytes, w.send_bytes[task.src], rng);
    task.receive = random_rows(bytes, w.receive_bytes[task.dst], rng);
    w.tasks.push_back(task);
  }
  return w;
}

// Byte `i` of task `task`'s stream in run `iteration`.
inline std::byte stream_byte(TaskId task, std::uint64_t i, std::uint32_t iteration) {
  return static_cast<std::byte>((task * 131 + i * 7 + iteration * 29 + (i >> 8)) & 0xff);
}
constexpr std::byte kUntouched{0xEE};

// Calls visit(offset in the buffer, offset in the stream, bytes) for every row of `range`.
template <typename Visit>
void for_each_row(const StridedRange& range, Visit visit) {
  std::uint64_t streamed = 0;
  for (std::uint64_t row = 0, rows = range.rows(); row < rows; ++row) {
    visit(range.pos + range.row_offset(row), streamed, range.row_bytes);
    streamed += range.row_bytes;
  }
}

// This PE's buffer on one side for `iteration`: every stream byte of its sends (`sending`) or
// receives in its rows, kUntouched in the gaps. The send buffer to fill, or what the receive
// buffer must hold after the run.
inline std::vector<std::byte> strided_buffer(const StridedWorkload& w, PeId me,
                                             std::uint32_t iteration, bool sending) {
  std::vector<std::byte> buffer(sending ? w.send_bytes[me] : w.receive_bytes[me], kUntouched);
  for (const StridedTask& t : w.tasks) {
    if ((sending ? t.src : t.dst) != me) continue;
    for_each_row(sending ? t.send : t.receive,
                 [&](std::uint64_t at, std::uint64_t streamed, std::uint64_t bytes) {
                   for (std::uint64_t i = 0; i < bytes; ++i)
                     buffer[at + i] = stream_byte(t.task, streamed + i, iteration);
                 });
  }
  return buffer;
}
inline std::vector<std::byte> strided_send_buffer(const StridedWorkload& w, PeId me,
                                                  std::uint32_t iteration) {
  return strided_buffer(w, me, iteration, true);
}
inline std::vector<std::byte> strided_expected_receive(const StridedWorkload& w, PeId me,
                                                       std::uint32_t iteration) {
  return strided_buffer(w, me, iteration, false);
}

}  // namespace reshard::testing_support
