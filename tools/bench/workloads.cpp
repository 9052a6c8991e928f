#include "bench/workloads.hpp"

#include <algorithm>
#include <cstring>
#include <random>

#include "reshard/error.hpp"

namespace reshard::bench {
namespace {

std::uint64_t splitmix(std::uint64_t x) {
  x += 0x9e3779b97f4a7c15ull;
  x = (x ^ (x >> 30)) * 0xbf58476d1ce4e5b9ull;
  x = (x ^ (x >> 27)) * 0x94d049bb133111ebull;
  return x ^ (x >> 31);
}

std::uint64_t pattern_word(TaskId task, std::uint64_t word, std::uint32_t iteration) {
  return splitmix(task * 0x100000001b3ull ^ (static_cast<std::uint64_t>(iteration) << 52) ^
                  splitmix(word));
}

// Lays items out in per-PE buffers: offsets are assigned in item order, with `gap(rng)` spare
// bytes before each destination range so stray writes are caught.
template <typename Gap>
void assign_offsets(Workload& w, std::mt19937_64& rng, Gap gap) {
  w.send_buffer_bytes.assign(w.n_pes, 0);
  w.recv_buffer_bytes.assign(w.n_pes, 0);
  for (WorkItem& item : w.items) {
    item.src_offset = w.send_buffer_bytes[item.src];
    w.send_buffer_bytes[item.src] += item.bytes;
    w.recv_buffer_bytes[item.dst] += gap(rng);
    item.dst_offset = w.recv_buffer_bytes[item.dst];
    w.recv_buffer_bytes[item.dst] += item.bytes;
  }
  for (auto& bytes : w.recv_buffer_bytes) bytes += gap(rng);
}

Workload uniform(int n, std::uint64_t size) {
  Workload w{"uniform", n, {}, {}, {}};
  for (int s = 0; s < n; ++s) {
    for (int d = 0; d < n; ++d) {
      w.items.push_back({static_cast<TaskId>(s) * n + d, s, d, size, 0, 0});
    }
  }
  std::mt19937_64 rng(0);
  assign_offsets(w, rng, [](std::mt19937_64&) { return std::uint64_t{0}; });
  return w;
}

Workload random_sparse(int n, std::uint64_t size, std::mt19937_64& rng) {
  Workload w{"random", n, {}, {}, {}};
  TaskId task = 1000;
  for (int s = 0; s < n; ++s) {
    for (int d = 0; d < n; ++d) {
      // About half the pairs talk; each PE always sends to its ring neighbour.
      if (n > 1 && d != (s + 1) % n && rng() % 2 == 0) continue;
      const int requests = 1 + static_cast<int>(rng() % 4);
      for (int r = 0; r < requests; ++r) {
        const std::uint64_t bytes = 1 + rng() % std::max<std::uint64_t>(2 * size / requests, 1);
        w.items.push_back({task, s, d, bytes, 0, 0});
        task += 1 + rng() % 7;  // task ids need not be dense
      }
    }
  }
  std::shuffle(w.items.begin(), w.items.end(), rng);
  assign_offsets(w, rng, [](std::mt19937_64& g) { return g() % 64; });
  return w;
}

Workload many_small(int n, std::mt19937_64& rng) {
  Workload w{"small", n, {}, {}, {}};
  TaskId task = 0;
  for (int s = 0; s < n; ++s) {
    for (int r = 0; r < 256; ++r) {
      const int d = static_cast<int>(rng() % n);
      w.items.push_back({task++, s, d, 8 + rng() % 4089, 0, 0});
    }
  }
  assign_offsets(w, rng, [](std::mt19937_64& g) { return g() % 16; });
  return w;
}

// Llama-like parameter shapes in bf16, scaled so the model is about 8 x `size` bytes per PE.
Workload refit(int n, std::uint64_t size) {
  Workload w{"refit", n, {}, {}, {}};
  const std::uint64_t target = 8 * size * n;
  const std::uint64_t hidden = 4096, ffn = 14336, kv = 1024, vocab = 128256;
  std::vector<std::uint64_t> params = {vocab * hidden * 2};  // embedding
  const std::uint64_t per_layer[] = {hidden * hidden, hidden * kv,  hidden * kv,  hidden * hidden,
                                     hidden * ffn,    hidden * ffn, ffn * hidden, hidden};
  for (int layer = 0; layer < 32; ++layer) {
    for (std::uint64_t elements : per_layer) params.push_back(elements * 2);
  }
  params.push_back(vocab * hidden * 2);  // output head
  std::uint64_t total = 0;
  for (auto p : params) total += p;
  const double scale = static_cast<double>(target) / total;
  const int dst_group = std::max(n / 2, 1);
  const int replicas = n >= 2 ? 2 : 1;
  TaskId task = 0;
  for (std::uint64_t& p : params) {
    p = std::max<std::uint64_t>(static_cast<std::uint64_t>(p * scale) / (2 * n) * (2 * n), 2 * n);
    // Source shard i of n holds [i*p/n, (i+1)*p/n); destination shard j of dst_group likewise.
    for (int replica = 0; replica < replicas; ++replica) {
      for (int j = 0; j < dst_group; ++j) {
        const std::uint64_t lo = p * j / dst_group, hi = p * (j + 1) / dst_group;
        for (int i = 0; i < n; ++i) {
          const std::uint64_t slo = p * i / n, shi = p * (i + 1) / n;
          const std::uint64_t a = std::max(lo, slo), b = std::min(hi, shi);
          if (a >= b) continue;
          w.items.push_back({task++, i, replica * dst_group + j, b - a, 0, 0});
        }
      }
    }
  }
  std::mt19937_64 rng(0);
  assign_offsets(w, rng, [](std::mt19937_64&) { return std::uint64_t{0}; });
  return w;
}

}  // namespace

const std::vector<std::string>& workload_kinds() {
  static const std::vector<std::string> kinds = {"uniform", "random", "small", "refit"};
  return kinds;
}

Workload make_workload(const std::string& kind, int n_pes, std::uint64_t size, std::uint64_t seed) {
  if (n_pes < 1) throw_error(ErrorCode::kInvalidArgument, "a workload needs at least one PE");
  std::mt19937_64 rng(seed);
  if (kind == "uniform") return uniform(n_pes, size);
  if (kind == "random") return random_sparse(n_pes, size, rng);
  if (kind == "small") return many_small(n_pes, rng);
  if (kind == "refit") return refit(n_pes, size);
  throw_error(ErrorCode::kInvalidArgument,
              "unknown workload '" + kind + "' (uniform, random, small, refit)");
}

namespace {

// Calls visit(index, expected_bytes, count) over `length` bytes of a task's pattern from `offset`,
// one 8-byte pattern word at a time.
template <typename Visit>
void for_each_pattern_piece(std::size_t length, TaskId task, std::uint64_t offset,
                            std::uint32_t iteration, Visit visit) {
  std::size_t i = 0;
  while (i < length) {
    const std::uint64_t position = offset + i;
    const std::uint64_t word = pattern_word(task, position / 8, iteration);
    const std::size_t first = position % 8;
    const std::size_t take = std::min<std::size_t>(8 - first, length - i);
    visit(i, reinterpret_cast<const std::byte*>(&word) + first, take);
    i += take;
  }
}

}  // namespace

void fill_pattern(std::span<std::byte> out, TaskId task, std::uint64_t offset,
                  std::uint32_t iteration) {
  for_each_pattern_piece(out.size(), task, offset, iteration,
                         [&](std::size_t i, const std::byte* expected, std::size_t take) {
                           std::memcpy(out.data() + i, expected, take);
                         });
}

std::uint64_t count_pattern_mismatches(std::span<const std::byte> data, TaskId task,
                                       std::uint64_t offset, std::uint32_t iteration) {
  std::uint64_t wrong = 0;
  for_each_pattern_piece(data.size(), task, offset, iteration,
                         [&](std::size_t i, const std::byte* expected, std::size_t take) {
                           for (std::size_t k = 0; k < take; ++k)
                             wrong += data[i + k] != expected[k];
                         });
  return wrong;
}

void prepare_buffers(const Workload& workload, PeId me, std::uint32_t iteration,
                     std::span<std::byte> send_buffer, std::span<std::byte> recv_buffer) {
  for (const WorkItem& item : workload.items) {
    if (item.src == me) {
      fill_pattern(send_buffer.subspan(item.src_offset, item.bytes), item.task, 0, iteration);
    }
  }
  std::fill(recv_buffer.begin(), recv_buffer.end(), kPoison);
}

std::uint64_t verify_receive_buffer(const Workload& workload, PeId me, std::uint32_t iteration,
                                    std::span<const std::byte> recv_buffer) {
  std::uint64_t wrong = 0;
  std::vector<bool> covered(recv_buffer.size(), false);
  for (const WorkItem& item : workload.items) {
    if (item.dst != me) continue;
    wrong += count_pattern_mismatches(recv_buffer.subspan(item.dst_offset, item.bytes), item.task,
                                      0, iteration);
    std::fill(covered.begin() + item.dst_offset, covered.begin() + item.dst_offset + item.bytes,
              true);
  }
  for (std::size_t i = 0; i < recv_buffer.size(); ++i) {
    wrong += !covered[i] && recv_buffer[i] != kPoison;
  }
  return wrong;
}

}  // namespace reshard::bench
