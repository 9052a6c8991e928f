// GPU transports end to end, one process per GPU under reshard-run (ctest starts it at 2 and 4 PEs
// for each transport and engine). RESHARD_TEST_TRANSPORT picks the transport ("cuda", "nccl",
// "nvshmem", or "auto": with RESHARD_NODE_SIZE, a mixed schedule);
// RESHARD_CUDA_ENGINE the CUDA engine. Without enough GPUs every PE exits with 77, which ctest
// reports as skipped. Every test is collective.
#include <cuda_runtime.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <memory>
#include <span>
#include <stdexcept>
#include <string>
#include <vector>

#include "bench/workloads.hpp"
#include "gpu/cuda_device.hpp"
#include "gpu/stream_memory_ops.hpp"
#include "reshard/reshard.hpp"
#include "service/service_slot.hpp"
#include "service/test_hooks.hpp"
#include "support/gpu_pes.hpp"
#include "support/pe_tests.hpp"
#include "support/phase_workload.hpp"
#include "support/strided_workload.hpp"

namespace reshard {
namespace {

constexpr int kSkipped = 77;
using testing_support::all_pes;
using testing_support::bootstrap;

#define CUDA_OK(call) ASSERT_EQ((call), cudaSuccess) << #call

std::unique_ptr<CopyService> make_service() { return testing_support::make_test_service("cuda"); }

struct DeviceBytes {
  explicit DeviceBytes(std::size_t n, bool stream_ordered_pool = false)
      : size(n), pooled(stream_ordered_pool) {
    const std::size_t bytes = std::max<std::size_t>(n, 1);
    const cudaError_t status =
        pooled ? cudaMallocAsync(&data, bytes, nullptr) : cudaMalloc(&data, bytes);
    if (status != cudaSuccess) throw std::runtime_error("device allocation failed");
    if (pooled) cudaStreamSynchronize(nullptr);
  }
  ~DeviceBytes() {
    if (pooled) {
      cudaFreeAsync(data, nullptr);
      cudaStreamSynchronize(nullptr);
    } else {
      cudaFree(data);
    }
  }
  Buffer buffer(int device) const { return Buffer::cuda(data, size, device); }
  std::size_t size;
  bool pooled;
  void* data = nullptr;
};

// A workload's buffers on the GPU, plus host images to fill and check them.
struct GpuWorkload {
  GpuWorkload(CopyService& service, bench::Workload w, bool pooled_destination = false,
              bool pooled_source = false)
      : workload(std::move(w)),
        me(service.my_pe()),
        send(workload.send_buffer_bytes[me], pooled_source),
        recv(workload.recv_buffer_bytes[me], pooled_destination),
        host_send(send.size),
        host_recv(recv.size) {
    for (const bench::WorkItem& item : workload.items) {
      if (item.src == me)
        service.register_send(item.task, send.buffer(service.device()), item.src_offset, item.bytes,
                              item.dst);
      if (item.dst == me)
        service.register_receive(item.task, recv.buffer(service.device()), item.dst_offset,
                                 item.bytes, item.src);
    }
  }
  // Fills sources for `iteration` and poisons the destination, in stream order.
  void stage(std::uint32_t iteration, cudaStream_t stream) {
    bench::prepare_buffers(workload, me, iteration, host_send, host_recv);
    cudaMemcpyAsync(send.data, host_send.data(), send.size, cudaMemcpyHostToDevice, stream);
    cudaMemcpyAsync(recv.data, host_recv.data(), recv.size, cudaMemcpyHostToDevice, stream);
  }
  // Wrong bytes in the destination, read back in stream order.
  std::uint64_t check(std::uint32_t iteration, cudaStream_t stream) {
    cudaMemcpyAsync(host_recv.data(), recv.data, recv.size, cudaMemcpyDeviceToHost, stream);
    if (cudaStreamSynchronize(stream) != cudaSuccess) return UINT64_MAX;
    return bench::verify_receive_buffer(workload, me, iteration, host_recv);
  }
  // Iterations [first, first + runs): stage, run on `stream` (no host sync before the run), check.
  void run_checked(CopyService& service, std::uint32_t first, std::uint32_t runs,
                   cudaStream_t stream, const std::string& what) {
    for (std::uint32_t iteration = first; iteration < first + runs; ++iteration) {
      stage(iteration, stream);
      service.run(stream);
      EXPECT_EQ(check(iteration, stream), 0u) << what << " run " << iteration;
    }
  }

  bench::Workload workload;
  PeId me;
  DeviceBytes send, recv;
  std::vector<std::byte> host_send, host_recv;
};

class Workloads : public testing::TestWithParam<std::tuple<std::string, std::uint64_t>> {};

TEST_P(Workloads, EveryByteArrivesOnEveryRun) {
  const auto& [kind, size] = GetParam();
  auto service = make_service();
  for (std::uint64_t seed : {1, 2}) {
    GpuWorkload w(*service, bench::make_workload(kind, service->n_pes(), size, seed));
    service->schedule();
    for (std::uint32_t iteration = 0; iteration < 3; ++iteration) {
      w.stage(iteration, nullptr);
      ASSERT_EQ(cudaDeviceSynchronize(), cudaSuccess);
      bootstrap()->barrier();
      service->run();
      EXPECT_EQ(w.check(iteration, nullptr), 0u)
          << kind << " size " << size << " seed " << seed << " iteration " << iteration;
    }
    service->clear_requests();
  }
  EXPECT_TRUE(all_pes(!HasFailure()));
}

INSTANTIATE_TEST_SUITE_P(Gpu, Workloads,
                         testing::Combine(testing::Values("uniform", "random", "small", "refit"),
                                          testing::Values(std::uint64_t{4096},
                                                          std::uint64_t{(1 << 20) + 13},
                                                          std::uint64_t{(8 << 20) + 5})),
                         [](const auto& info) {
                           return std::get<0>(info.param) + "_" +
                                  std::to_string(std::get<1>(info.param));
                         });

// The UUID of CUDA device `device` (the same GPU has the same one in every process).
std::vector<std::byte> gpu_uuid(int device) {
  cudaDeviceProp properties{};
  if (cudaGetDeviceProperties(&properties, device) != cudaSuccess)
    throw std::runtime_error("cudaGetDeviceProperties failed for device " + std::to_string(device));
  const auto bytes = std::as_bytes(std::span(properties.uuid.bytes));
  return {bytes.begin(), bytes.end()};
}

// PEs sharing a GPU are told by the GPU's host and PCI bus id, whatever ordinal each process sees
// it under (the NVSHMEM transport divides the GPU among them, the CUDA transport orders them by
// their streams). The test counts them by the GPU's UUID instead (every PE runs on this host);
// under tests/gpu/place_pes.sh rotated the PEs on one GPU see it under different ordinals.
TEST(GpuIdentity, PesSharingThisGpuAreThoseWithItsUuid) {
  auto service = make_service();
  const int device = service->device();
  const std::vector<std::byte> uuid = gpu_uuid(device);
  int same_gpu = 0;
  for (const auto& part : bootstrap()->all_gather(uuid)) {
    same_gpu += std::equal(part.begin(), part.end(), uuid.begin(), uuid.end());
  }
  EXPECT_EQ(cuda::pes_on_this_gpu(*bootstrap(), device), same_gpu);
  const std::string me = cuda::physical_gpu(device);
  EXPECT_NE(me.find('/'), std::string::npos) << me;
  int count = 0;
  CUDA_OK(cudaGetDeviceCount(&count));
  for (int other = 0; other < count; ++other) {
    EXPECT_EQ(cuda::physical_gpu(other) == me, other == device) << "device " << other;
  }
  EXPECT_TRUE(all_pes(!HasFailure()));
}

// Processes sharing a GPU without MPS take turns on it, so a wait in one process's kernel for
// another's lasts a time slice: there the GPU transports wait in their streams' front ends
// instead, and say so. The CUDA transport does with every peer once any GPU of the job is
// shared that way (a pair is ordered alike on both sides); NVSHMEM where its own GPU is.
TEST(GpuIdentity, TransportsWaitInTheStreamFrontEndWhereProcessesShareAGpuWithoutMps) {
  auto service = make_service();
  const int device = service->device();
  const std::vector<std::byte> uuid = gpu_uuid(device);
  const auto all = bootstrap()->all_gather(uuid);
  int mine_shared_by = 0;
  bool any_shared = false;
  for (std::size_t a = 0; a < all.size(); ++a) {
    mine_shared_by += std::equal(all[a].begin(), all[a].end(), uuid.begin(), uuid.end());
    for (std::size_t b = a + 1; b < all.size(); ++b) any_shared = any_shared || all[a] == all[b];
  }
  const bool turns = cuda::stream_memory_ops_supported(device) && !cuda::mps_server_found();
  const std::string transport = service->transport_name();
  const CopyServiceOptions& options = service->options();
  SCOPED_TRACE(transport + ", " + std::to_string(mine_shared_by) + " PE(s) on this GPU" +
               (any_shared ? ", some GPU shared" : ", no GPU shared") +
               (cuda::mps_server_found() ? ", MPS" : ", no MPS"));
  if (transport == "cuda" && options.cuda.same_device == "auto") {
    EXPECT_EQ(reshard::execution::ServiceSlot::waits_in_stream_front_end(*service),
              any_shared && turns);
  } else if (transport == "nvshmem" && options.nvshmem.waits == "auto") {
    EXPECT_EQ(reshard::execution::ServiceSlot::waits_in_stream_front_end(*service),
              mine_shared_by > 1 && turns);
  } else if (transport == "nvshmem") {
    EXPECT_EQ(reshard::execution::ServiceSlot::waits_in_stream_front_end(*service),
              options.nvshmem.waits == "stream");
  } else if (transport == "nccl") {
    EXPECT_FALSE(reshard::execution::ServiceSlot::waits_in_stream_front_end(*service));
  }
  EXPECT_TRUE(all_pes(!HasFailure()));
}

// Strided ranges in GPU memory: each side cuts the stream into rows of its own (up to three outer
// dimensions, gaps between rows); every row lands in place and no gap byte is written, run on the
// caller's stream after its own work with no host sync in between. NCCL sends each row as a
// message of its own, so it gets fewer and shorter rows.
TEST(StridedRanges, EveryRowLandsInPlaceAndNoGapIsWritten) {
  auto service = make_service();
  const PeId me = service->my_pe();
  const int device = service->device();
  const bool in_place = reshard::execution::ServiceSlot::moves_rows_in_place(*service);
  cudaStream_t stream = nullptr;
  CUDA_OK(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking));
  for (std::uint64_t seed = 1; seed <= 6; ++seed) {
    const auto w = testing_support::make_strided_workload(
        service->n_pes(), seed, in_place ? 48 : 8, in_place ? (seed % 2 ? 3 << 20 : 9000) : 300);
    DeviceBytes send(w.send_bytes[me]), receive(w.receive_bytes[me]);
    for (const auto& t : w.tasks) {
      if (t.src == me) service->register_send(t.task, send.buffer(device), t.send, t.dst);
      if (t.dst == me) service->register_receive(t.task, receive.buffer(device), t.receive, t.src);
    }
    service->schedule();
    const std::vector<std::byte> poison(receive.size, testing_support::kUntouched);
    for (std::uint32_t iteration = 1; iteration <= 3; ++iteration) {
      const auto source = testing_support::strided_send_buffer(w, me, iteration);
      CUDA_OK(
          cudaMemcpyAsync(send.data, source.data(), source.size(), cudaMemcpyHostToDevice, stream));
      CUDA_OK(cudaMemcpyAsync(receive.data, poison.data(), poison.size(), cudaMemcpyHostToDevice,
                              stream));
      service->run(stream);
      std::vector<std::byte> landed(receive.size);
      CUDA_OK(cudaMemcpyAsync(landed.data(), receive.data, landed.size(), cudaMemcpyDeviceToHost,
                              stream));
      CUDA_OK(cudaStreamSynchronize(stream));
      const auto expected = testing_support::strided_expected_receive(w, me, iteration);
      std::size_t wrong = 0;
      for (std::size_t i = 0; i < expected.size(); ++i) wrong += landed[i] != expected[i];
      EXPECT_EQ(wrong, 0u) << "seed " << seed << " run " << iteration;
    }
    service->synchronize();
    service->clear_requests();
  }
  cudaStreamDestroy(stream);
  EXPECT_TRUE(all_pes(!HasFailure()));
}

// Phases on a stream, with no host synchronisation between them: each phase lands in the scratch
// every phase reuses, and a copy queued after run_phase(p) saves what phase p left there. A phase
// writing a peer's scratch before the peer's copy of the previous phase ran would show here.
TEST(Phases, EachPhaseLandsAfterTheLastOneWasReadOnTheStream) {
  auto service = make_service();
  const PeId me = service->my_pe();
  const int device = service->device();
  const testing_support::PhaseWorkload w{.n_pes = service->n_pes(), .block = (1 << 20) + 3};
  DeviceBytes source(w.send_bytes()), scratch(w.scratch_bytes());
  DeviceBytes saved(w.scratch_bytes() * w.phases());
  w.register_on(*service, source.buffer(device), scratch.buffer(device));
  EXPECT_EQ(service->schedule().phases, w.phases());
  cudaStream_t stream = nullptr;
  CUDA_OK(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking));
  for (std::uint32_t iteration = 1; iteration <= 3; ++iteration) {
    const std::vector<std::byte> fill = w.source(me, iteration);
    CUDA_OK(cudaMemcpyAsync(source.data, fill.data(), fill.size(), cudaMemcpyHostToDevice, stream));
    for (std::uint32_t p = 0; p < w.phases(); ++p) {
      service->run_phase(p, stream);
      CUDA_OK(cudaMemcpyAsync(static_cast<std::byte*>(saved.data) + p * w.scratch_bytes(),
                              scratch.data, w.scratch_bytes(), cudaMemcpyDeviceToDevice, stream));
    }
    std::vector<std::byte> landed(saved.size);
    CUDA_OK(
        cudaMemcpyAsync(landed.data(), saved.data, landed.size(), cudaMemcpyDeviceToHost, stream));
    CUDA_OK(cudaStreamSynchronize(stream));
    for (std::uint32_t p = 0; p < w.phases(); ++p) {
      const std::vector<std::byte> phase(landed.begin() + p * w.scratch_bytes(),
                                         landed.begin() + (p + 1) * w.scratch_bytes());
      EXPECT_EQ(w.wrong_after(me, iteration, p, phase), 0u)
          << "run " << iteration << " phase " << p;
    }
  }
  service->synchronize();
  cudaStreamDestroy(stream);
  EXPECT_TRUE(all_pes(!HasFailure()));
}

// Work queued before run() on the caller's stream (filling sources, poisoning destinations) must
// finish before any byte moves, and work queued after must see the result — with no host sync.
TEST(StreamOrder, RunFollowsAndPrecedesTheCallersStreamWork) {
  auto service = make_service();
  GpuWorkload w(*service, bench::make_workload("random", service->n_pes(), 3 << 20, 7));
  service->schedule();
  cudaStream_t stream;
  CUDA_OK(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking));
  // A long kernel-free delay before the fill would be ideal; a large fill is enough to expose a
  // transport that starts before its stream predecessors.
  w.run_checked(*service, 0, 5, stream, "random 3 MiB");
  service->synchronize();
  CUDA_OK(cudaStreamDestroy(stream));
  EXPECT_TRUE(all_pes(!HasFailure()));
}

TEST(StreamOrder, RunCapturedInACudaGraphReplays) {
  auto service = make_service();
  GpuWorkload w(*service, bench::make_workload("uniform", service->n_pes(), (256 << 10) + 3, 3));
  service->schedule();
  cudaStream_t stream;
  CUDA_OK(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking));
  cudaGraph_t graph;
  CUDA_OK(cudaStreamBeginCapture(stream, cudaStreamCaptureModeThreadLocal));
  if (service->transport_name().find("nvshmem") != std::string::npos) {
    // Its signal values advance every run: capture is refused with a clear error, before any
    // work is queued.
    try {
      service->run(stream);
      ADD_FAILURE() << "the nvshmem transport accepted graph capture";
    } catch (const Error& e) {
      EXPECT_EQ(e.code(), ErrorCode::kUnsupported);
      EXPECT_NE(std::string(e.what()).find("CUDA graph"), std::string::npos) << e.what();
    }
    CUDA_OK(cudaStreamEndCapture(stream, &graph));
    CUDA_OK(cudaGraphDestroy(graph));
    CUDA_OK(cudaStreamDestroy(stream));
    EXPECT_TRUE(all_pes(!HasFailure()));
    return;
  }
  service->run(stream);
  CUDA_OK(cudaStreamEndCapture(stream, &graph));
  cudaGraphExec_t exec;
  CUDA_OK(cudaGraphInstantiate(&exec, graph, 0));
  for (std::uint32_t iteration = 0; iteration < 4; ++iteration) {
    w.stage(iteration, stream);
    CUDA_OK(cudaGraphLaunch(exec, stream));
    EXPECT_EQ(w.check(iteration, stream), 0u) << "replay " << iteration;
  }
  CUDA_OK(cudaGraphExecDestroy(exec));
  CUDA_OK(cudaGraphDestroy(graph));
  CUDA_OK(cudaStreamDestroy(stream));
  EXPECT_TRUE(all_pes(!HasFailure()));
}

// Stress on the GPU: random schedules (kinds, sizes, seeds), each run 1-3 times on a stream and
// checked byte for byte, every third one in verify mode, for RESHARD_STRESS_SECONDS (default 5)
// — new allocations every schedule, so IPC mappings come and go as in a long job.
TEST(Stress, RandomSchedulesWithRepeatedRunsStayExact) {
  const char* seconds_text = std::getenv("RESHARD_STRESS_SECONDS");
  const double budget = seconds_text ? std::atof(seconds_text) : 5.0;
  auto service = make_service();
  cudaStream_t stream;
  CUDA_OK(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking));
  const auto start = std::chrono::steady_clock::now();
  const char* kinds[] = {"uniform", "random", "small", "refit"};
  std::uint64_t schedules = 0, runs = 0;
  for (std::uint64_t seed = 2000;; ++seed) {
    const double elapsed =
        std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
    // Every PE stops at the same schedule, on time or at the first failure anywhere.
    if (!all_pes(elapsed < budget && !HasFailure())) break;
    const std::uint64_t size = 1 + (seed * 2654435761u) % (1u << (seed % 22));
    GpuWorkload w(*service, bench::make_workload(kinds[seed % 4], service->n_pes(), size, seed));
    service->set_verify(seed % 3 == 0);
    service->schedule();
    ++schedules;
    const auto repeats = static_cast<std::uint32_t>(1 + seed % 3);
    w.run_checked(*service, 0, repeats, stream,
                  std::string(kinds[seed % 4]) + " size " + std::to_string(size) + " seed " +
                      std::to_string(seed));
    runs += repeats;
    service->synchronize();
    service->clear_requests();
  }
  if (service->my_pe() == 0)
    std::printf("stress: %llu schedules, %llu runs\n", static_cast<unsigned long long>(schedules),
                static_cast<unsigned long long>(runs));
  EXPECT_GT(schedules, 0u);
  CUDA_OK(cudaStreamDestroy(stream));
}

// Schedules that leave a pair of PEs out for some runs and then bring it back, each run on a
// stream with no host sync: a PE's done flags must catch up on the runs that left a peer out.
// Each PE sends `bytes` to the PEs `hops` ahead (0: a local copy only, no peer at all).
bench::Workload ring_workload(int n_pes, std::vector<int> hops, std::uint64_t bytes) {
  bench::Workload w;
  w.name = "ring";
  w.n_pes = n_pes;
  w.send_buffer_bytes.assign(n_pes, bytes * hops.size());
  w.recv_buffer_bytes.assign(n_pes, bytes * hops.size());
  for (int pe = 0; pe < n_pes; ++pe) {
    for (std::size_t k = 0; k < hops.size(); ++k) {
      const int dst = (pe + hops[k]) % n_pes;
      w.items.push_back({static_cast<TaskId>(pe * 64 + k), pe, dst, bytes, k * bytes, k * bytes});
    }
  }
  return w;
}

TEST(Schedules, PairsLeftOutForSomeRunsCompleteWhenTheyReturn) {
  auto service = make_service();
  const int n = service->n_pes();
  cudaStream_t stream;
  CUDA_OK(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking));
  // (hops, runs): local only, the next PE, local only, the next again, every PE, the next.
  std::vector<int> everyone;
  for (int hop = 0; hop < n; ++hop) everyone.push_back(hop);
  const std::vector<std::pair<std::vector<int>, std::uint32_t>> phases = {
      {{0}, 2}, {{1}, 2}, {{0}, 3}, {{1}, 1}, {everyone, 2}, {{1}, 2}};
  std::uint32_t iteration = 0;
  for (std::size_t p = 0; p < phases.size(); ++p) {
    GpuWorkload w(*service, ring_workload(n, phases[p].first, (256 << 10) + 3));
    service->schedule();
    w.run_checked(*service, iteration, phases[p].second, stream, "phase " + std::to_string(p));
    iteration += phases[p].second;
    service->synchronize();
    service->clear_requests();
  }
  CUDA_OK(cudaStreamDestroy(stream));
  EXPECT_TRUE(all_pes(!HasFailure()));
}

// Verify mode on GPU memory: runs on a stream are checked once they complete; a byte flipped on
// the GPU after the transfer is named on every PE as an integrity error, and the next run is
// clean again.
TEST(VerifyMode, GpuRangesAreCheckedAndCorruptionIsNamedOnEveryPe) {
  auto service = make_service();
  service->set_verify(true);
  GpuWorkload w(*service, bench::make_workload("random", service->n_pes(), (1 << 20) + 5, 9));
  service->schedule();
  cudaStream_t stream;
  CUDA_OK(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking));
  w.run_checked(*service, 0, 2, stream, "verified");
  TaskId victim = 0;
  for (const bench::WorkItem& item : w.workload.items)
    if (item.bytes > 0) victim = item.task;
  test_hooks::ServiceProbe::corrupt_receives_after_run(*service, victim);
  w.stage(2, stream);
  try {
    service->run(stream);
    ADD_FAILURE() << "a corrupted GPU range passed verify mode";
  } catch (const Error& error) {
    EXPECT_EQ(error.code(), ErrorCode::kIntegrity) << error.what();
    EXPECT_EQ(error.tasks(), std::vector<std::uint64_t>{victim}) << error.what();
  }
  test_hooks::ServiceProbe::corrupt_receives_after_run(*service, std::nullopt);
  w.run_checked(*service, 3, 1, stream, "after the corruption");
  CUDA_OK(cudaStreamDestroy(stream));
  EXPECT_TRUE(all_pes(!HasFailure()));
}

// Three runs of a random workload, every byte checked, with destinations in pool memory on the PEs
// `pooled_on` names.
void expect_arrival_with_pooled_destinations(bool (*pooled_on)(PeId), std::uint64_t seed) {
  auto service = make_service();
  GpuWorkload w(*service, bench::make_workload("random", service->n_pes(), 1 << 20, seed),
                pooled_on(service->my_pe()));
  service->schedule();
  for (std::uint32_t iteration = 0; iteration < 3; ++iteration) {
    w.stage(iteration, nullptr);
    ASSERT_EQ(cudaDeviceSynchronize(), cudaSuccess);
    service->run();
    EXPECT_EQ(w.check(iteration, nullptr), 0u) << "iteration " << iteration;
  }
}

// Stream-ordered pool memory cannot be shared through legacy CUDA IPC: the CUDA transport stages
// those destinations through its bounce buffer, and the bytes must still arrive exactly.
TEST(Destinations, PoolAllocatedDestinationsArrive) {
  expect_arrival_with_pooled_destinations([](PeId) { return true; }, 11);
  EXPECT_TRUE(all_pes(!HasFailure()));
}

// Only PE 0's destinations are pool memory. Where PEs share a GPU and delegate, PE 0 leads: it
// makes the others' copies to itself, which land in its bounce buffer like any peer's before its
// unstage copy moves them (written straight to the destination, they were overwritten by it).
TEST(Destinations, PoolAllocatedDestinationsOfTheLeadingPeArrive) {
  expect_arrival_with_pooled_destinations([](PeId pe) { return pe == 0; }, 13);
  EXPECT_TRUE(all_pes(!HasFailure()));
}

TEST(Sources, PoolAllocatedSourcesArrive) {
  // Stream-ordered pool memory cannot be shared through CUDA IPC: PEs that share a GPU cannot
  // hand such sources to the process that makes their copies, and copy them themselves.
  auto service = make_service();
  GpuWorkload w(*service, bench::make_workload("random", service->n_pes(), 1 << 20, 12),
                /*pooled_destination=*/false, /*pooled_source=*/true);
  service->schedule();
  cudaStream_t stream = nullptr;
  CUDA_OK(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking));
  w.run_checked(*service, 0, 3, stream, "pool-allocated sources");
  CUDA_OK(cudaStreamDestroy(stream));
  EXPECT_TRUE(all_pes(!HasFailure()));
}

TEST(Destinations, SubAllocationsOfOneAllocationArrive) {
  // Several requests whose buffers are carved out of one cudaMalloc, as a caching allocator does.
  auto service = make_service();
  const int n = service->n_pes(), me = service->my_pe();
  const std::size_t piece = 1000;  // unaligned on purpose
  DeviceBytes arena(2 * n * piece + 64);
  std::vector<std::byte> host(arena.size);
  for (int peer = 0; peer < n; ++peer) {
    const Buffer src = Buffer::cuda(static_cast<std::byte*>(arena.data) + peer * piece + 3, piece,
                                    service->device());
    const Buffer dst = Buffer::cuda(static_cast<std::byte*>(arena.data) + (n + peer) * piece + 7,
                                    piece, service->device());
    service->register_send(static_cast<TaskId>(me * n + peer), src, 0, piece, peer);
    service->register_receive(static_cast<TaskId>(peer * n + me), dst, 0, piece, peer);
  }
  service->schedule();
  for (int peer = 0; peer < n; ++peer)
    bench::fill_pattern(std::span(host).subspan(peer * piece + 3, piece), me * n + peer, 0, 5);
  CUDA_OK(cudaMemcpy(arena.data, host.data(), host.size(), cudaMemcpyHostToDevice));
  bootstrap()->barrier();
  service->run();
  CUDA_OK(cudaMemcpy(host.data(), arena.data, host.size(), cudaMemcpyDeviceToHost));
  for (int peer = 0; peer < n; ++peer) {
    EXPECT_EQ(bench::count_pattern_mismatches(
                  std::span(host).subspan((n + peer) * piece + 7, piece), peer * n + me, 0, 5),
              0u)
        << "from PE " << peer;
  }
  EXPECT_TRUE(all_pes(!HasFailure()));
}

TEST(BadInput, HostAndForeignDeviceBuffersAreRefusedAtRegistration) {
  auto service = make_service();
  std::vector<std::byte> host(64);
  try {
    service->register_send(1, Buffer::host(host.data(), host.size()), 0, 64, 0);
    ADD_FAILURE() << "a host buffer was accepted";
  } catch (const Error& e) {
    EXPECT_EQ(e.code(), ErrorCode::kInvalidArgument);
    EXPECT_NE(std::string(e.what()).find("host buffer"), std::string::npos) << e.what();
  }
  DeviceBytes mine(64);
  try {
    // The pointer is on this PE's device but the buffer claims another one.
    service->register_receive(2, Buffer::cuda(mine.data, 64, service->device() + 1), 0, 64, 0);
    ADD_FAILURE() << "a buffer of the wrong device was accepted";
  } catch (const Error& e) {
    EXPECT_EQ(e.code(), ErrorCode::kInvalidArgument);
    EXPECT_NE(std::string(e.what()).find("CUDA device"), std::string::npos) << e.what();
  }
  EXPECT_TRUE(all_pes(!HasFailure()));
}

}  // namespace
}  // namespace reshard

int main(int argc, char** argv) {
  using namespace reshard;
  int devices = 0;
  if (cudaGetDeviceCount(&devices) != cudaSuccess) devices = 0;
  if (const std::string why = testing_support::gpu_skip_reason(devices); !why.empty()) {
    std::printf("skipped: %s\n", why.c_str());
    return kSkipped;
  }
  const auto names = available_transports();
  for (const char* variable : {"RESHARD_TEST_TRANSPORT", "RESHARD_INTER_NODE_TRANSPORT"}) {
    const char* transport = std::getenv(variable);
    if (transport && std::string(transport) != "auto" &&
        std::find(names.begin(), names.end(), transport) == names.end()) {
      std::printf("skipped: this build has no %s transport\n", transport);
      return kSkipped;
    }
  }
  return testing_support::run_pe_tests(argc, argv);
}
