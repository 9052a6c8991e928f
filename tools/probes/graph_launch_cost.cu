// Probe: what makes the host time of launching a one-kernel CUDA graph grow?
//
// A bound refit captured in a graph is one copy-kernel node (two PEs on two GPUs), yet
// cuGraphLaunch of it took 20-50 us of host time where a one-kernel PyTorch graph took 5-13 us.
// This launches one-kernel graphs that differ in one thing at a time and prints the median host
// time of cudaGraphLaunch (synchronized after each, so nothing queues) and of a plain launch:
//   plain      an empty kernel, 1 CTA
//   grid       the same on a grid of 528 CTAs x 512 threads (a refit's copy grid on an H200)
//   stack      a kernel with a 256-byte stack frame (a printf it never reaches, as reshard's copy
//              kernel has), 528 x 512
//   memory     `stack` again after the process allocated 40 GiB of device memory in 4 GiB pieces
//   many       `stack` again after 20,000 more small allocations (a model's tensors)
//   ipc N      `stack` again after opening N buffers another process exported through CUDA IPC
//              (N = 10, 100, 1000: a peer's tensors, as the CUDA transport maps them)
//   export N   `stack` again after exporting N of this process's own buffers (cudaIpcGetMemHandle,
//              as every PE does for its tensors), N = 10, 100, 1000
//   busy D     `stack` again, each launch right after the stream ran a D-millisecond kernel and the
//              host waited for it (a refit's copy before the next refit), D = 0.1, 2, 10, 40
//   sleep D    `stack` again, each launch after the host slept D milliseconds, the GPU idle
//   warm D     as busy D, with a launch of the one-kernel `plain` graph just before the timed one
//   memops     a graph as a bound refit of 2 PEs sharing a GPU captures: a batch of stream memory
//              operations (write, wait, reset), the `stack` kernel, another batch; as is, after a
//              10 ms sleep, and after the sleep and a launch of `plain`
// Each row also gives "again": a second launch of the same graph right after the timed one (the
// driver's path for it warm).
//
// Build and run on a GPU machine:
//   nvcc -O3 -arch=sm_90 -o /tmp/graph_launch_cost tools/probes/graph_launch_cost.cu \
//     -L/usr/local/cuda/lib64/stubs -lcuda
//   /tmp/graph_launch_cost [launches=300]
#include <cuda.h>
#include <cuda_runtime.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <string>
#include <vector>

#define CHECK(call)                                                                       \
  do {                                                                                    \
    cudaError_t status = (call);                                                          \
    if (status != cudaSuccess) {                                                          \
      std::fprintf(stderr, "%s:%d %s\n", __FILE__, __LINE__, cudaGetErrorString(status)); \
      std::exit(1);                                                                       \
    }                                                                                     \
  } while (0)

__global__ void empty_kernel(int* flag) {
  if (flag != nullptr && threadIdx.x == 0 && blockIdx.x == 0) *flag += 0;
}

__global__ void stack_kernel(int* flag, int never) {
  if (never == 12345) {
    printf("never %d %d %d %d %d %d %d %d\n", never, never + 1, never + 2, never + 3, never + 4,
           never + 5, never + 6, never + 7);
  }
  if (flag != nullptr && threadIdx.x == 0 && blockIdx.x == 0) *flag += 0;
}

using Clock = std::chrono::steady_clock;

__global__ void spin_kernel(long long cycles) {
  const long long start = clock64();
  while (clock64() - start < cycles) {
  }
}

// Called before each timed launch (after the previous one's work ended): nothing by default.
struct NoPause {
  void operator()(cudaStream_t) const {}
};

template <typename Launch, typename Pause = NoPause>
void measure(const char* name, cudaStream_t stream, int launches, Launch launch,
             Pause pause = {}) {
  cudaGraph_t graph;
  cudaGraphExec_t exec;
  CHECK(cudaStreamBeginCapture(stream, cudaStreamCaptureModeGlobal));
  launch(stream);
  CHECK(cudaStreamEndCapture(stream, &graph));
  CHECK(cudaGraphInstantiate(&exec, graph, 0));
  CHECK(cudaGraphUpload(exec, stream));
  CHECK(cudaStreamSynchronize(stream));
  std::vector<double> graph_us, plain_us, again_us;
  for (int i = 0; i < launches; ++i) {
    pause(stream);
    auto start = Clock::now();
    CHECK(cudaGraphLaunch(exec, stream));
    auto end = Clock::now();
    graph_us.push_back(std::chrono::duration<double, std::micro>(end - start).count());
    CHECK(cudaGraphLaunch(exec, stream));
    again_us.push_back(std::chrono::duration<double, std::micro>(Clock::now() - end).count());
    CHECK(cudaStreamSynchronize(stream));
    pause(stream);
    start = Clock::now();
    launch(stream);
    plain_us.push_back(std::chrono::duration<double, std::micro>(Clock::now() - start).count());
    CHECK(cudaStreamSynchronize(stream));
  }
  std::sort(graph_us.begin(), graph_us.end());
  std::sort(plain_us.begin(), plain_us.end());
  std::sort(again_us.begin(), again_us.end());
  std::printf("%-12s graph launch %6.1f us (p90 %6.1f, again %5.1f), plain launch %6.1f us\n",
              name, graph_us[launches / 2], graph_us[launches * 9 / 10], again_us[launches / 2],
              plain_us[launches / 2]);
  CHECK(cudaGraphExecDestroy(exec));
  CHECK(cudaGraphDestroy(graph));
}

constexpr int kExported = 1000;

// The exporting process (forked before CUDA starts): allocates kExported buffers, writes their IPC
// handles to `out`, and keeps them until `hold` closes.
void export_buffers(int out, int hold) {
  std::vector<cudaIpcMemHandle_t> handles(kExported);
  for (auto& handle : handles) {
    void* p;
    CHECK(cudaMalloc(&p, 2 << 20));
    CHECK(cudaIpcGetMemHandle(&handle, p));
  }
  const char* at = reinterpret_cast<const char*>(handles.data());
  for (std::size_t left = handles.size() * sizeof(cudaIpcMemHandle_t); left > 0;) {
    const ssize_t n = write(out, at, left);
    if (n <= 0) std::exit(1);
    at += n;
    left -= static_cast<std::size_t>(n);
  }
  char byte;
  if (read(hold, &byte, 1) < 0) std::exit(1);
  std::exit(0);
}

int main(int argc, char** argv) {
  const int launches = argc > 1 ? std::atoi(argv[1]) : 300;
  int handles_pipe[2], hold_pipe[2];
  if (pipe(handles_pipe) != 0 || pipe(hold_pipe) != 0) return 1;
  const pid_t exporter = fork();
  if (exporter == 0) {
    close(handles_pipe[0]);
    close(hold_pipe[1]);
    export_buffers(handles_pipe[1], hold_pipe[0]);
  }
  close(handles_pipe[1]);
  close(hold_pipe[0]);
  cudaStream_t stream;
  CHECK(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking));
  int* flag;
  CHECK(cudaMalloc(&flag, sizeof(int)));
  measure("plain", stream, launches, [&](cudaStream_t s) { empty_kernel<<<1, 32, 0, s>>>(flag); });
  measure("grid", stream, launches,
          [&](cudaStream_t s) { empty_kernel<<<528, 512, 0, s>>>(flag); });
  auto stack = [&](cudaStream_t s) { stack_kernel<<<528, 512, 0, s>>>(flag, 0); };
  measure("stack", stream, launches, stack);
  std::vector<void*> big;
  for (int i = 0; i < 10; ++i) {
    void* p;
    CHECK(cudaMalloc(&p, std::size_t{4} << 30));
    big.push_back(p);
  }
  measure("memory", stream, launches, stack);
  std::vector<void*> small;
  for (int i = 0; i < 20000; ++i) {
    void* p;
    CHECK(cudaMalloc(&p, 64 << 10));
    small.push_back(p);
  }
  measure("many", stream, launches, stack);
  std::vector<cudaIpcMemHandle_t> handles(kExported);
  char* at = reinterpret_cast<char*>(handles.data());
  for (std::size_t left = handles.size() * sizeof(cudaIpcMemHandle_t); left > 0;) {
    const ssize_t n = read(handles_pipe[0], at, left);
    if (n <= 0) return 1;
    at += n;
    left -= static_cast<std::size_t>(n);
  }
  std::vector<void*> opened;
  for (int target : {10, 100, 1000}) {
    while (static_cast<int>(opened.size()) < target) {
      void* p;
      CHECK(cudaIpcOpenMemHandle(&p, handles[opened.size()], cudaIpcMemLazyEnablePeerAccess));
      opened.push_back(p);
    }
    const std::string name = "ipc " + std::to_string(target);
    measure(name.c_str(), stream, launches, stack);
  }
  int exported = 0;
  for (int target : {10, 100, 1000}) {
    for (; exported < target; ++exported) {
      cudaIpcMemHandle_t handle;
      CHECK(cudaIpcGetMemHandle(&handle, small[exported]));
    }
    const std::string name = "export " + std::to_string(target);
    measure(name.c_str(), stream, launches, stack);
  }
  int clock_khz = 0;
  CHECK(cudaDeviceGetAttribute(&clock_khz, cudaDevAttrClockRate, 0));
  cudaGraph_t plain_graph;
  cudaGraphExec_t plain_exec;
  CHECK(cudaStreamBeginCapture(stream, cudaStreamCaptureModeGlobal));
  empty_kernel<<<1, 32, 0, stream>>>(flag);
  CHECK(cudaStreamEndCapture(stream, &plain_graph));
  CHECK(cudaGraphInstantiate(&plain_exec, plain_graph, 0));
  for (double ms : {0.1, 2.0, 10.0, 40.0}) {
    const auto cycles = static_cast<long long>(ms * clock_khz);
    const auto busy = [&](cudaStream_t s) {
      spin_kernel<<<1, 1, 0, s>>>(cycles);
      CHECK(cudaStreamSynchronize(s));
    };
    std::string name = "busy " + std::to_string(ms).substr(0, 4);
    measure(name.c_str(), stream, launches / 3, stack, busy);
    name = "sleep " + std::to_string(ms).substr(0, 4);
    measure(name.c_str(), stream, launches / 3, stack, [&](cudaStream_t) {
      usleep(static_cast<useconds_t>(ms * 1000));
    });
    name = "warm " + std::to_string(ms).substr(0, 4);
    measure(name.c_str(), stream, launches / 3, stack, [&](cudaStream_t s) {
      busy(s);
      CHECK(cudaGraphLaunch(plain_exec, s));
    });
  }
  std::uint64_t* flags;
  CHECK(cudaMalloc(&flags, 2 * sizeof(std::uint64_t)));
  CHECK(cudaMemset(flags, 0, 2 * sizeof(std::uint64_t)));
  const auto batch = [](cudaStream_t s, std::uint64_t* flag) {
    CUstreamBatchMemOpParams ops[3]{};
    ops[0].writeValue.operation = CU_STREAM_MEM_OP_WRITE_VALUE_64;
    ops[0].writeValue.address = reinterpret_cast<CUdeviceptr>(flag);
    ops[0].writeValue.value64 = 1;
    ops[1].waitValue.operation = CU_STREAM_MEM_OP_WAIT_VALUE_64;
    ops[1].waitValue.address = reinterpret_cast<CUdeviceptr>(flag);
    ops[1].waitValue.value64 = 1;
    ops[1].waitValue.flags = CU_STREAM_WAIT_VALUE_GEQ;
    ops[2] = ops[0];
    ops[2].writeValue.value64 = 0;
    if (cuStreamBatchMemOp(reinterpret_cast<CUstream>(s), 3, ops, 0) != CUDA_SUCCESS) std::exit(1);
  };
  const auto memops = [&](cudaStream_t s) {
    batch(s, flags);
    stack(s);
    batch(s, flags + 1);
  };
  measure("memops", stream, launches / 3, memops);
  measure("memops sleep", stream, launches / 3, memops,
          [](cudaStream_t) { usleep(10000); });
  measure("memops warm", stream, launches / 3, memops, [&](cudaStream_t s) {
    usleep(10000);
    CHECK(cudaGraphLaunch(plain_exec, s));
  });
  CHECK(cudaFree(flags));
  CHECK(cudaGraphExecDestroy(plain_exec));
  CHECK(cudaGraphDestroy(plain_graph));
  for (void* p : opened) CHECK(cudaIpcCloseMemHandle(p));
  close(hold_pipe[1]);
  waitpid(exporter, nullptr, 0);
  for (void* p : small) CHECK(cudaFree(p));
  for (void* p : big) CHECK(cudaFree(p));
  return 0;
}
