// Probe: how fast can processes that share one GPU hand it to each other without MPS?
//
// N processes (forked before CUDA starts) run a small all-to-all on one GPU: each pushes `bytes`
// into every peer's IPC-mapped buffer with one kernel, ordered with its peers before (the peer's
// buffer is free) and after (the peer's data has landed) by one of these mechanisms:
//   memops    cuStreamWriteValue64 / cuStreamWaitValue64 on IPC-mapped flags (reshard's path)
//   ipcevent  cudaEventRecord on an interprocess event, the host tells the peers it was recorded
//             (shared-memory counter), the peers cudaStreamWaitEvent on it
//   hostfunc  cudaLaunchHostFunc callbacks raise and wait for shared-memory counters
//   hostsync  the host synchronizes its stream, then raises and waits for shared-memory counters
//   kernel    the copy kernel itself spins on IPC-mapped flags (what a GPU-only handshake costs)
//   leader, leaderevent, leadermemops
//             PE 0 moves every PE's data in one kernel (all sources and destinations mapped), so
//             the GPU never switches between the processes' contexts; the others drain their
//             streams (leader), record IPC events / raise flags the leader's stream waits for,
//             and wait for the leader's done event / flag
// and `alone`: one process, the kernel only (no peers): launch + sync cost.
// Prints microseconds per all-to-all.
//
// Build and run on a GPU machine:
//   nvcc -O3 -arch=sm_90 -o /tmp/handoff tools/probes/same_gpu_handoff.cu -lcuda
//   /tmp/handoff [processes=2] [bytes=4096] [iterations=2000] [mode]
#include <cuda.h>
#include <cuda_runtime.h>
#include <sys/mman.h>
#include <sys/wait.h>
#include <unistd.h>

#include <atomic>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <string>
#include <thread>
#include <vector>

namespace {

constexpr int kMaxPes = 8;

#define CHECK(call)                                                     \
  do {                                                                  \
    cudaError_t status_ = (call);                                       \
    if (status_ != cudaSuccess) {                                       \
      std::fprintf(stderr, "%s:%d %s: %s\n", __FILE__, __LINE__, #call, \
                   cudaGetErrorString(status_));                        \
      std::exit(2);                                                     \
    }                                                                   \
  } while (0)

#define CHECK_CU(call)                                                                 \
  do {                                                                                 \
    CUresult status_ = (call);                                                         \
    if (status_ != CUDA_SUCCESS) {                                                     \
      std::fprintf(stderr, "%s:%d %s: %d\n", __FILE__, __LINE__, #call, int(status_)); \
      std::exit(2);                                                                    \
    }                                                                                  \
  } while (0)

// Host memory shared by the forked processes.
struct Shared {
  cudaIpcMemHandle_t buffer[kMaxPes];
  cudaIpcMemHandle_t source[kMaxPes];
  cudaIpcMemHandle_t flags[kMaxPes];
  cudaIpcEventHandle_t ready_event[kMaxPes];
  cudaIpcEventHandle_t done_event[kMaxPes];
  std::atomic<int> published;
  std::atomic<int> barrier;
  alignas(64) std::atomic<std::uint64_t> ready[kMaxPes];  // host counters, per PE
  alignas(64) std::atomic<std::uint64_t> done[kMaxPes];
};

Shared* shared = nullptr;

void wait_counter(std::atomic<std::uint64_t>* counters, int n, int me, std::uint64_t value) {
  for (int p = 0; p < n; ++p) {
    if (p == me) continue;
    while (counters[p].load(std::memory_order_acquire) < value) {
    }
  }
}

void host_barrier(int n, int round) {
  shared->barrier.fetch_add(1);
  while (shared->barrier.load() < n * round) {
  }
}

// Pushes `words` 16-byte words into every peer's buffer at this PE's slot.
__global__ void push(const int4* source, int4** peers, int n, int me, std::size_t words) {
  for (int p = 0; p < n; ++p) {
    if (p == me) continue;
    int4* destination = peers[p] + me * words;
    for (std::size_t i = blockIdx.x * blockDim.x + threadIdx.x; i < words;
         i += gridDim.x * blockDim.x)
      destination[i] = source[i];
  }
}

// One process moves every PE's data: `sources[p]` into each other PE's buffer at p's slot.
__global__ void push_all(int4** sources, int4** peers, int n, std::size_t words) {
  for (int p = 0; p < n; ++p)
    for (int q = 0; q < n; ++q) {
      if (p == q) continue;
      int4* destination = peers[q] + p * words;
      for (std::size_t i = blockIdx.x * blockDim.x + threadIdx.x; i < words;
           i += gridDim.x * blockDim.x)
        destination[i] = sources[p][i];
    }
}

// The same, ordered by the kernel itself: flags in each PE's memory, `flags[p][2*q]` = ready of
// q seen by p, `flags[p][2*q+1]` = done.
__global__ void push_flagged(const int4* source, int4** peers, unsigned long long** flags, int n,
                             int me, std::size_t words, unsigned long long epoch) {
  if (threadIdx.x == 0 && blockIdx.x == 0) {
    for (int p = 0; p < n; ++p)
      if (p != me) atomicExch(&flags[p][2 * me], epoch);
    for (int p = 0; p < n; ++p)
      if (p != me)
        while (atomicAdd(&flags[me][2 * p], 0) < epoch) {
        }
  }
  __syncthreads();
  for (int p = 0; p < n; ++p) {
    if (p == me) continue;
    int4* destination = peers[p] + me * words;
    for (std::size_t i = threadIdx.x; i < words; i += blockDim.x) destination[i] = source[i];
  }
  __threadfence_system();
  __syncthreads();
  if (threadIdx.x == 0) {
    for (int p = 0; p < n; ++p)
      if (p != me) atomicExch(&flags[p][2 * me + 1], epoch);
    for (int p = 0; p < n; ++p)
      if (p != me)
        while (atomicAdd(&flags[me][2 * p + 1], 0) < epoch) {
        }
  }
}

struct HostWait {
  std::atomic<std::uint64_t>* counters;
  int n, me;
  std::uint64_t value;
};

void CUDART_CB raise_and_wait(void* argument) {
  auto* wait = static_cast<HostWait*>(argument);
  wait->counters[wait->me].store(wait->value, std::memory_order_release);
  wait_counter(wait->counters, wait->n, wait->me, wait->value);
}

double run_pe(const std::string& mode, int n, int me, std::size_t bytes, int iterations) {
  CHECK(cudaSetDevice(0));
  cudaStream_t stream;
  CHECK(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking));
  const std::size_t words = bytes / 16;
  int4 *source, *buffer;
  unsigned long long* flags;
  CHECK(cudaMalloc(&source, bytes));
  CHECK(cudaMalloc(&buffer, bytes * kMaxPes));
  CHECK(cudaMalloc(&flags, 2 * kMaxPes * sizeof(unsigned long long)));
  CHECK(cudaMemset(flags, 0, 2 * kMaxPes * sizeof(unsigned long long)));
  CHECK(cudaMemset(source, me + 1, bytes));
  cudaEvent_t ready_event, done_event;
  CHECK(cudaEventCreateWithFlags(&ready_event, cudaEventDisableTiming | cudaEventInterprocess));
  CHECK(cudaEventCreateWithFlags(&done_event, cudaEventDisableTiming | cudaEventInterprocess));
  CHECK(cudaIpcGetMemHandle(&shared->buffer[me], buffer));
  CHECK(cudaIpcGetMemHandle(&shared->source[me], source));
  CHECK(cudaIpcGetMemHandle(&shared->flags[me], flags));
  CHECK(cudaIpcGetEventHandle(&shared->ready_event[me], ready_event));
  CHECK(cudaIpcGetEventHandle(&shared->done_event[me], done_event));
  CHECK(cudaDeviceSynchronize());
  host_barrier(n, 1);

  std::vector<int4*> peer_buffer(n), peer_source(n);
  std::vector<unsigned long long*> peer_flags(n);
  std::vector<cudaEvent_t> peer_ready(n), peer_done(n);
  for (int p = 0; p < n; ++p) {
    if (p == me) {
      peer_buffer[p] = buffer;
      peer_source[p] = source;
      peer_flags[p] = flags;
      continue;
    }
    CHECK(cudaIpcOpenMemHandle(reinterpret_cast<void**>(&peer_buffer[p]), shared->buffer[p],
                               cudaIpcMemLazyEnablePeerAccess));
    CHECK(cudaIpcOpenMemHandle(reinterpret_cast<void**>(&peer_source[p]), shared->source[p],
                               cudaIpcMemLazyEnablePeerAccess));
    CHECK(cudaIpcOpenMemHandle(reinterpret_cast<void**>(&peer_flags[p]), shared->flags[p],
                               cudaIpcMemLazyEnablePeerAccess));
    CHECK(cudaIpcOpenEventHandle(&peer_ready[p], shared->ready_event[p]));
    CHECK(cudaIpcOpenEventHandle(&peer_done[p], shared->done_event[p]));
  }
  int4 **device_peers, **device_sources;
  CHECK(cudaMalloc(&device_sources, n * sizeof(int4*)));
  CHECK(cudaMemcpy(device_sources, peer_source.data(), n * sizeof(int4*), cudaMemcpyHostToDevice));
  unsigned long long** device_flags;
  CHECK(cudaMalloc(&device_peers, n * sizeof(int4*)));
  CHECK(cudaMalloc(&device_flags, n * sizeof(unsigned long long*)));
  CHECK(cudaMemcpy(device_peers, peer_buffer.data(), n * sizeof(int4*), cudaMemcpyHostToDevice));
  CHECK(cudaMemcpy(device_flags, peer_flags.data(), n * sizeof(unsigned long long*),
                   cudaMemcpyHostToDevice));
  CHECK(cudaDeviceSynchronize());
  host_barrier(n, 2);

  auto wait_value = [&](unsigned long long* flag) {
    CHECK_CU(cuStreamWaitValue64(stream, reinterpret_cast<CUdeviceptr>(flag), 1,
                                 CU_STREAM_WAIT_VALUE_GEQ));
    CHECK_CU(cuStreamWriteValue64(stream, reinterpret_cast<CUdeviceptr>(flag), 0,
                                  CU_STREAM_WRITE_VALUE_DEFAULT));
  };
  auto raise_value = [&](unsigned long long* flag) {
    CHECK_CU(cuStreamWriteValue64(stream, reinterpret_cast<CUdeviceptr>(flag), 1,
                                  CU_STREAM_WRITE_VALUE_DEFAULT));
  };
  std::vector<HostWait> waits(2 * (iterations + 32));
  const int blocks = 4, threads = 256;

  auto one = [&](std::uint64_t k) {
    if (mode == "memops") {
      for (int p = 0; p < n; ++p)
        if (p != me) raise_value(&peer_flags[p][2 * me]);
      for (int p = 0; p < n; ++p)
        if (p != me) wait_value(&flags[2 * p]);
      push<<<blocks, threads, 0, stream>>>(source, device_peers, n, me, words);
      for (int p = 0; p < n; ++p)
        if (p != me) raise_value(&peer_flags[p][2 * me + 1]);
      for (int p = 0; p < n; ++p)
        if (p != me) wait_value(&flags[2 * p + 1]);
    } else if (mode == "ipcevent") {
      CHECK(cudaEventRecord(ready_event, stream));
      shared->ready[me].store(k, std::memory_order_release);
      wait_counter(shared->ready, n, me, k);
      for (int p = 0; p < n; ++p)
        if (p != me) CHECK(cudaStreamWaitEvent(stream, peer_ready[p], 0));
      push<<<blocks, threads, 0, stream>>>(source, device_peers, n, me, words);
      CHECK(cudaEventRecord(done_event, stream));
      shared->done[me].store(k, std::memory_order_release);
      wait_counter(shared->done, n, me, k);
      for (int p = 0; p < n; ++p)
        if (p != me) CHECK(cudaStreamWaitEvent(stream, peer_done[p], 0));
    } else if (mode == "hostfunc") {
      // The host runs ahead of the stream: every queued callback keeps its own arguments.
      HostWait& ready = waits[2 * k];
      HostWait& done = waits[2 * k + 1];
      ready = {shared->ready, n, me, k};
      done = {shared->done, n, me, k};
      CHECK(cudaLaunchHostFunc(stream, raise_and_wait, &ready));
      push<<<blocks, threads, 0, stream>>>(source, device_peers, n, me, words);
      CHECK(cudaLaunchHostFunc(stream, raise_and_wait, &done));
    } else if (mode == "hostsync") {
      CHECK(cudaStreamSynchronize(stream));
      shared->ready[me].store(k, std::memory_order_release);
      wait_counter(shared->ready, n, me, k);
      push<<<blocks, threads, 0, stream>>>(source, device_peers, n, me, words);
      CHECK(cudaStreamSynchronize(stream));
      shared->done[me].store(k, std::memory_order_release);
      wait_counter(shared->done, n, me, k);
    } else if (mode == "leader") {
      // PE 0 moves everything; the others only drain their streams and wait on the host.
      CHECK(cudaStreamSynchronize(stream));
      shared->ready[me].store(k, std::memory_order_release);
      if (me == 0) {
        wait_counter(shared->ready, n, me, k);
        push_all<<<blocks, threads, 0, stream>>>(device_sources, device_peers, n, words);
        CHECK(cudaStreamSynchronize(stream));
        shared->done[0].store(k, std::memory_order_release);
      } else {
        while (shared->done[0].load(std::memory_order_acquire) < k) {
        }
      }
    } else if (mode == "leaderevent") {
      if (me == 0) {
        wait_counter(shared->ready, n, me, k);
        for (int p = 1; p < n; ++p) CHECK(cudaStreamWaitEvent(stream, peer_ready[p], 0));
        push_all<<<blocks, threads, 0, stream>>>(device_sources, device_peers, n, words);
        CHECK(cudaEventRecord(done_event, stream));
        shared->done[0].store(k, std::memory_order_release);
      } else {
        CHECK(cudaEventRecord(ready_event, stream));
        shared->ready[me].store(k, std::memory_order_release);
        while (shared->done[0].load(std::memory_order_acquire) < k) {
        }
        CHECK(cudaStreamWaitEvent(stream, peer_done[0], 0));
      }
    } else if (mode == "leadermemops") {
      if (me == 0) {
        for (int p = 1; p < n; ++p) wait_value(&flags[2 * p]);
        push_all<<<blocks, threads, 0, stream>>>(device_sources, device_peers, n, words);
        for (int p = 1; p < n; ++p) raise_value(&peer_flags[p][1]);
      } else {
        raise_value(&peer_flags[0][2 * me]);
        wait_value(&flags[1]);
      }
    } else if (mode == "kernel") {
      push_flagged<<<1, threads, 0, stream>>>(source, device_peers, device_flags, n, me, words, k);
    } else if (mode == "alone") {
      push<<<blocks, threads, 0, stream>>>(source, device_peers, 1, 1, words);
    } else {
      std::fprintf(stderr, "unknown mode %s\n", mode.c_str());
      std::exit(2);
    }
  };

  const int warmup = 20;
  for (int k = 1; k <= warmup; ++k) one(k);
  CHECK(cudaStreamSynchronize(stream));
  host_barrier(n, 3);
  const auto start = std::chrono::steady_clock::now();
  for (int k = warmup + 1; k <= warmup + iterations; ++k) {
    one(k);
    if (mode == "alone") CHECK(cudaStreamSynchronize(stream));
  }
  CHECK(cudaStreamSynchronize(stream));
  const double seconds =
      std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();

  // Each peer's slot holds the peer's byte.
  if (mode != "alone") {
    std::vector<unsigned char> landed(bytes * n);
    CHECK(cudaMemcpy(landed.data(), buffer, bytes * n, cudaMemcpyDeviceToHost));
    for (int p = 0; p < n; ++p)
      for (std::size_t i = 0; p != me && i < bytes; ++i)
        if (landed[p * bytes + i] != p + 1) {
          std::fprintf(stderr, "PE %d: byte %zu from PE %d is %d\n", me, i, p,
                       landed[p * bytes + i]);
          std::exit(3);
        }
  }
  host_barrier(n, 4);
  return seconds * 1e6 / iterations;
}

}  // namespace

int main(int argc, char** argv) {
  const int n = argc > 1 ? std::atoi(argv[1]) : 2;
  const std::size_t bytes = argc > 2 ? std::strtoull(argv[2], nullptr, 10) : 4096;
  const int iterations = argc > 3 ? std::atoi(argv[3]) : 2000;
  std::vector<std::string> modes = {"alone",    "kernel", "memops",      "ipcevent",    "hostfunc",
                                    "hostsync", "leader", "leaderevent", "leadermemops"};
  if (argc > 4) modes = {argv[4]};
  std::printf("processes %d, %zu B per peer, %d iterations, MPS %s\n", n, bytes, iterations,
              std::getenv("CUDA_MPS_PIPE_DIRECTORY") ? "maybe (pipe dir set)" : "off");
  for (const std::string& mode : modes) {
    shared = static_cast<Shared*>(
        mmap(nullptr, sizeof(Shared), PROT_READ | PROT_WRITE, MAP_SHARED | MAP_ANONYMOUS, -1, 0));
    std::memset(static_cast<void*>(shared), 0, sizeof(Shared));
    const int pes = mode == "alone" ? 1 : n;
    // The kernel-spin mode can take a time slice per hand-off: fewer iterations.
    const int count = mode == "kernel" ? std::max(iterations / 20, 10) : iterations;
    int pipe_fds[2];
    if (pipe(pipe_fds) != 0) return 2;
    std::vector<pid_t> children;
    for (int me = 0; me < pes; ++me) {
      const pid_t child = fork();
      if (child == 0) {
        const double us = run_pe(mode, pes, me, bytes, count);
        if (me == 0) {
          if (write(pipe_fds[1], &us, sizeof us) != sizeof us) _exit(2);
        }
        _exit(0);
      }
      children.push_back(child);
    }
    double us = -1;
    bool ok = read(pipe_fds[0], &us, sizeof us) == sizeof us;
    for (pid_t child : children) {
      int status = 0;
      waitpid(child, &status, 0);
      ok = ok && WIFEXITED(status) && WEXITSTATUS(status) == 0;
    }
    close(pipe_fds[0]);
    close(pipe_fds[1]);
    munmap(shared, sizeof(Shared));
    std::printf("%-12s %10.1f us per all-to-all%s\n", mode.c_str(), us, ok ? "" : "  (FAILED)");
    std::fflush(stdout);
  }
  return 0;
}
