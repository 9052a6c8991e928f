// Synthetic resharding workloads, generated identically on every PE from (kind, PEs, size, seed),
// and the byte patterns that let every transferred byte be verified.
#pragma once

#include <cstdint>
#include <span>
#include <string>
#include <vector>

#include "reshard/types.hpp"

namespace reshard::bench {

struct WorkItem {
  TaskId task = 0;
  PeId src = 0;
  PeId dst = 0;
  std::uint64_t bytes = 0;
  std::uint64_t src_offset = 0;  // in the source PE's send buffer
  std::uint64_t dst_offset = 0;  // in the destination PE's receive buffer
};

struct Workload {
  std::string name;
  int n_pes = 0;
  std::vector<WorkItem> items;
  std::vector<std::uint64_t> send_buffer_bytes;  // per PE
  std::vector<std::uint64_t> recv_buffer_bytes;  // per PE
};

// "uniform": every PE sends `size` bytes to every PE (itself included: a local copy).
// "random": sparse random pairs, 1-4 requests each, sizes up to 2x `size`, unaligned offsets and
//           gaps between destination ranges.
// "small": 256 requests of 8 B - 4 KiB per PE to random peers.
// "refit": a Llama-shaped model of about 8 x `size` bytes per PE, sharded over all PEs
//          (tensor-parallel, trainer side) and re-sharded onto half as many PEs, twice (two
//          inference replicas).
Workload make_workload(const std::string& kind, int n_pes, std::uint64_t size, std::uint64_t seed);
const std::vector<std::string>& workload_kinds();

// The byte every position of a task's data holds in a given iteration.
void fill_pattern(std::span<std::byte> out, TaskId task, std::uint64_t offset,
                  std::uint32_t iteration);
// Number of bytes in `data` that differ from the pattern.
std::uint64_t count_pattern_mismatches(std::span<const std::byte> data, TaskId task,
                                       std::uint64_t offset, std::uint32_t iteration);

constexpr std::byte kPoison{0xA5};

// Fills this PE's sources for `iteration`, poisons its receive buffer.
void prepare_buffers(const Workload& workload, PeId me, std::uint32_t iteration,
                     std::span<std::byte> send_buffer, std::span<std::byte> recv_buffer);
// Bytes of this PE's receive buffer that are wrong: received ranges that differ from the pattern,
// and bytes outside every received range that are no longer poison.
std::uint64_t verify_receive_buffer(const Workload& workload, PeId me, std::uint32_t iteration,
                                    std::span<const std::byte> recv_buffer);

}  // namespace reshard::bench
