// The device-side waits of the GPU transports, on one GPU: a wait that runs out records whom it
// waited for and where the chain of stuck waits from there ends (read from each PE's waiting_on
// word), and a long wait marks this PE's own word until it ends; the groups of one flagged launch
// wait, copy and raise independently. The other PEs' words and flags are played by pinned host
// memory, so each case sets up exactly what it checks. Exits 77 (skipped) without a GPU.
#include <cuda_runtime.h>
#include <gtest/gtest.h>

#include <atomic>
#include <chrono>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <mutex>
#include <optional>
#include <random>
#include <span>
#include <thread>
#include <vector>

#include "gpu/copy_kernels.hpp"
#include "gpu/cuda_device.hpp"
#include "gpu/device_array.hpp"
#include "gpu/run_watchdog.hpp"
#include "gpu/stream_memory_ops.hpp"
#include "support/single_gpu_main.hpp"

namespace reshard::cuda {
namespace {

constexpr int kPes = 4;
constexpr int kMe = 2;
constexpr int kPeer = 3;  // the PE this PE's wait is for

// Pinned host memory mapped into the device: the kernel and the test both see it at once.
template <typename T>
struct Pinned {
  explicit Pinned(std::size_t n) {
    EXPECT_EQ(cudaHostAlloc(reinterpret_cast<void**>(&host), n * sizeof(T), cudaHostAllocMapped),
              cudaSuccess);
    EXPECT_EQ(cudaHostGetDevicePointer(reinterpret_cast<void**>(&device), host, 0), cudaSuccess);
    for (std::size_t i = 0; i < n; ++i) host[i] = T{};
  }
  ~Pinned() { cudaFreeHost(host); }
  volatile T& operator[](std::size_t i) { return const_cast<volatile T&>(host[i]); }
  T load(std::size_t i) const { return const_cast<const volatile T&>(host[i]); }
  T* host = nullptr;
  T* device = nullptr;
};

class DeviceWaits : public testing::Test {
 protected:
  void SetUp() override {
    ASSERT_EQ(cudaStreamCreateWithFlags(&stream_, cudaStreamNonBlocking), cudaSuccess);
    ASSERT_EQ(cudaMalloc(&group_device_, sizeof(PeerGroup)), cudaSuccess);
    PeerGroup group{};  // nothing to copy: the wait is what is under test
    group.cta_count = 1;
    group.peer = kPeer;
    ASSERT_EQ(cudaMemcpy(group_device_, &group, sizeof group, cudaMemcpyHostToDevice), cudaSuccess);
    ASSERT_EQ(cudaMalloc(&failure_, sizeof(unsigned int)), cudaSuccess);
    ASSERT_EQ(cudaMalloc(&peer_words_device_, kPes * sizeof(std::uint64_t*)), cudaSuccess);
    map_every_pe();
  }
  void TearDown() override {
    cudaStreamDestroy(stream_);
    cudaFree(group_device_);
    cudaFree(failure_);
    cudaFree(peer_words_device_);
  }

  // Which PEs' waiting_on words this PE sees (null: not mapped, as a PE on another node).
  void map_pes(const std::vector<bool>& mapped) {
    std::vector<const std::uint64_t*> pointers(kPes);
    for (int pe = 0; pe < kPes; ++pe) pointers[pe] = mapped[pe] ? words_.device + pe : nullptr;
    ASSERT_EQ(cudaMemcpy(peer_words_device_, pointers.data(), kPes * sizeof pointers[0],
                         cudaMemcpyHostToDevice),
              cudaSuccess);
  }
  void map_every_pe() { map_pes(std::vector<bool>(kPes, true)); }

  // Launches one flagged copy that waits for PE kPeer's flag (never raised unless the test does).
  void launch_wait(std::uint64_t timeout_ns, bool with_peer_words = true) {
    std::memset(status_.host, 0, sizeof(DeviceStatus));
    ASSERT_EQ(cudaMemset(failure_, 0, sizeof(unsigned int)), cudaSuccess);
    KernelArgs args{};
    args.groups = group_device_;
    args.group_count = 1;
    args.cta_count = 1;
    args.n_pes = kPes;
    args.me = kMe;
    args.waiting_on = words_.device + kMe;
    args.peer_waiting_on = with_peer_words ? peer_words_device_ : nullptr;
    args.status = status_.device;
    args.failure = failure_;
    args.timeout_ns = timeout_ns;
    CopyFlags flags;
    flags.wait = flag_.device;
    flags.wait_value = 1;
    flags.peer = kPeer;
    flags.wait_kind = kWaitData;
    FlaggedLaunch launch;
    ASSERT_TRUE(launch.add(0, 1, flags));
    launch_flagged_copies(args, launch, stream_);
  }

  // Sets the other PEs' words (PE + 1 each is stuck on; 0 not stuck), lets this PE's wait run
  // out, and gives back where it says the chain ends.
  int stuck_behind(const std::vector<std::uint64_t>& words, bool with_peer_words = true) {
    for (int pe = 0; pe < kPes; ++pe) words_[pe] = pe == kMe ? 0 : words[pe];
    flag_[0] = 0;
    launch_wait(20'000'000, with_peer_words);
    EXPECT_EQ(cudaStreamSynchronize(stream_), cudaSuccess);
    const DeviceStatus status = *status_.host;  // the stream is done: plain reads
    EXPECT_EQ(status.code, kStatusTimeout);
    EXPECT_EQ(status.peer, kPeer);
    EXPECT_EQ(status.wait_kind, kWaitData);
    // The wait lasted 20 ms: it named its peer in this PE's word, and left it there.
    EXPECT_EQ(words_.load(kMe), std::uint64_t{kPeer + 1});
    unsigned int failure = 0;
    EXPECT_EQ(cudaMemcpy(&failure, failure_, sizeof failure, cudaMemcpyDeviceToHost), cudaSuccess);
    EXPECT_EQ(failure, kStatusTimeout);
    return status.stuck_behind;
  }

  cudaStream_t stream_ = nullptr;
  PeerGroup* group_device_ = nullptr;
  unsigned int* failure_ = nullptr;
  const std::uint64_t** peer_words_device_ = nullptr;
  Pinned<std::uint64_t> words_{kPes};
  Pinned<std::uint64_t> flag_{1};
  Pinned<DeviceStatus> status_{1};
};

TEST_F(DeviceWaits, ATimeoutNamesThePeerWhenItIsNotStuck) {
  EXPECT_EQ(stuck_behind({0, 0, 0, 0}), kPeer);
}

TEST_F(DeviceWaits, ATimeoutNamesThePeTheChainEndsAt) {
  EXPECT_EQ(stuck_behind({0, 0, 0, 1 + 1}), 1);      // 3 -> 1
  EXPECT_EQ(stuck_behind({1 + 1, 0, 0, 0 + 1}), 1);  // 3 -> 0 -> 1
  EXPECT_EQ(stuck_behind({0, 0 + 1, 0, 1 + 1}), 0);  // 3 -> 1 -> 0
}

TEST_F(DeviceWaits, ACycleEndsAtTheLastPeNewToTheChain) {
  EXPECT_EQ(stuck_behind({0, 3 + 1, 0, 1 + 1}), 1);    // 3 -> 1 -> 3
  EXPECT_EQ(stuck_behind({0, 0, 0, 3 + 1}), kPeer);    // 3 -> 3
  EXPECT_EQ(stuck_behind({0, 0, 0, kMe + 1}), kPeer);  // 3 -> this PE
  EXPECT_EQ(stuck_behind({0, kMe + 1, 0, 1 + 1}), 1);  // 3 -> 1 -> this PE
}

TEST_F(DeviceWaits, TheWalkStopsAtUnmappedPesAndNonsense) {
  map_pes({true, false, true, true});
  EXPECT_EQ(stuck_behind({0, 0 + 1, 0, 1 + 1}), 1);  // PE 1's word is not visible here
  map_every_pe();
  EXPECT_EQ(stuck_behind({0, 0, 0, 99}), kPeer);  // not a PE
  EXPECT_EQ(stuck_behind({0, 0, 0, 1 + 1}, /*with_peer_words=*/false), kPeer);
}

TEST_F(DeviceWaits, ALongWaitMarksThisPeUntilItEnds) {
  for (int pe = 0; pe < kPes; ++pe) words_[pe] = 0;
  flag_[0] = 0;
  launch_wait(10'000'000'000ull);
  const auto give_up = std::chrono::steady_clock::now() + std::chrono::seconds(5);
  while (words_.load(kMe) == 0 && std::chrono::steady_clock::now() < give_up)
    std::this_thread::sleep_for(std::chrono::milliseconds(1));
  EXPECT_EQ(words_.load(kMe), std::uint64_t{kPeer + 1}) << "a wait of over 1 ms left no mark";
  EXPECT_EQ(cudaStreamQuery(stream_), cudaErrorNotReady) << "the wait ended without its flag";
  flag_[0] = 1;  // the peer arrives
  ASSERT_EQ(cudaStreamSynchronize(stream_), cudaSuccess);
  EXPECT_EQ(status_.host->code, 0u);
  EXPECT_EQ(words_.load(kMe), 0u) << "the mark outlived the wait";
}

TEST_F(DeviceWaits, AShortWaitLeavesNoMark) {
  for (int pe = 0; pe < kPes; ++pe) words_[pe] = 0;
  flag_[0] = 1;  // already there
  launch_wait(10'000'000'000ull);
  ASSERT_EQ(cudaStreamSynchronize(stream_), cudaSuccess);
  EXPECT_EQ(status_.host->code, 0u);
  EXPECT_EQ(words_.load(kMe), 0u);
}

// One flagged launch of three groups (several CTAs, odd sizes and offsets): the group whose flag
// never comes holds back neither the others' copies nor their raises, and every group raises only
// after its bytes have landed, by exactly the units it was given (shares of every CTA, CTA 0 the
// units beyond the first): a second launch adds on top of the first.
// A failure the host records (a watchdog, a dead peer) while a kernel's wait runs out or is
// cancelled at about the same moment: what is read back is one of the two records whole, never
// the host's code beside the kernel's peer. The kernels alone write the pinned status (the first
// failed wait claims the device failure word) and the host writes its own record.
TEST_F(DeviceWaits, AHostFailureBesideAKernelsLeavesOneWholeRecord) {
  constexpr int kHostPeer = 1;
  int kernel_records = 0, host_records = 0;
  for (int trial = 0; trial < 200; ++trial) {
    HostFailure host;
    for (int pe = 0; pe < kPes; ++pe) words_[pe] = 0;
    flag_[0] = 0;
    launch_wait(100'000 + 5'000 * (trial % 40));  // 0.1-0.3 ms
    std::this_thread::sleep_for(std::chrono::microseconds(10 * (trial % 30)));
    host.record(kStatusCancelled, kHostPeer, kWaitArrival);
    cancel_waits(status_.host);
    ASSERT_EQ(cudaStreamSynchronize(stream_), cudaSuccess);
    const std::optional<RunFailure> failure = run_failure(status_.host, host);
    ASSERT_TRUE(failure.has_value());
    const bool kernels = failure->peer == kPeer && failure->wait_kind == kWaitData &&
                         (failure->code == kStatusTimeout || failure->code == kStatusCancelled);
    const bool hosts = failure->peer == kHostPeer && failure->wait_kind == kWaitArrival &&
                       failure->code == kStatusCancelled;
    EXPECT_TRUE(kernels || hosts) << "trial " << trial << ": code " << failure->code << ", peer "
                                  << failure->peer << ", wait kind " << failure->wait_kind;
    (kernels ? kernel_records : host_records) += 1;
  }
  std::printf("records: %d the kernels', %d the host's\n", kernel_records, host_records);
}

// Host threads recording at once (the watchdog's and the caller's): the first records, whole.
TEST(HostFailures, TheFirstOfSeveralAtOnceIsRecordedWhole) {
  for (int trial = 0; trial < 100; ++trial) {
    HostFailure host;
    std::vector<std::thread> threads;
    std::atomic<int> recorded{0};
    for (int t = 0; t < 8; ++t) {
      threads.emplace_back([&, t] {
        if (host.record(kStatusTimeout, t, static_cast<unsigned int>(t))) ++recorded;
      });
    }
    for (std::thread& thread : threads) thread.join();
    const std::optional<RunFailure> failure = host.get();
    ASSERT_TRUE(failure.has_value());
    EXPECT_EQ(recorded.load(), 1);
    EXPECT_EQ(static_cast<unsigned int>(failure->peer), failure->wait_kind);
    EXPECT_EQ(run_failure(nullptr, host)->peer, failure->peer);
  }
}

TEST(FlaggedLaunch, GroupsWaitCopyAndRaiseIndependently) {
  cudaStream_t stream = nullptr;
  ASSERT_EQ(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking), cudaSuccess);
  const std::vector<std::uint64_t> sizes = {(1 << 20) + 3, 4097, 200001};
  const std::vector<std::uint32_t> ctas = {5, 1, 3};
  const std::uint64_t total = sizes[0] + sizes[1] + sizes[2] + 64;
  std::vector<unsigned char> pattern(total);
  std::mt19937 random(7);
  for (auto& byte : pattern) byte = static_cast<unsigned char>(random());
  DeviceArray<unsigned char> source, destination;
  unsigned char* src = source.upload(pattern);
  unsigned char* dst = destination.upload(std::vector<unsigned char>(total));
  std::vector<CopyDescriptor> descriptors;
  std::vector<PeerGroup> groups;
  std::uint64_t at = 1;  // every piece unaligned
  for (std::size_t g = 0; g < sizes.size(); ++g) {
    descriptors.push_back({src + at, dst + at + 7, sizes[g], 0});
    PeerGroup group{};
    group.first_descriptor = static_cast<std::uint32_t>(g);
    group.descriptor_count = 1;
    group.bytes = sizes[g];
    group.cta_count = ctas[g];
    group.peer = static_cast<std::int32_t>(g);
    groups.push_back(group);
    at += sizes[g] + 9;
  }
  ASSERT_LE(at + 7, total);  // the last destination piece ends inside the buffer
  DeviceArray<CopyDescriptor> descriptors_device;
  DeviceArray<PeerGroup> groups_device;
  DeviceArray<unsigned int> failure_word;
  unsigned int* failure = failure_word.upload(std::vector<unsigned int>(1, 0));
  Pinned<std::uint64_t> waits(3);
  // The raised flags in device memory (the kernel adds to them with system-scope reductions),
  // read while the kernel still waits: plain copies, ordered with nothing on its stream.
  DeviceArray<std::uint64_t> raised_words;
  std::uint64_t* raised = raised_words.upload(std::vector<std::uint64_t>(3, 0));
  auto raised_value = [&](int g) {
    std::uint64_t value = 0;
    EXPECT_EQ(cudaMemcpy(&value, raised + g, sizeof value, cudaMemcpyDeviceToHost), cudaSuccess);
    return value;
  };
  Pinned<DeviceStatus> status(1);
  KernelArgs args{};
  args.descriptors = descriptors_device.upload(descriptors);
  args.groups = groups_device.upload(groups);
  args.n_pes = 3;
  args.me = 0;
  args.status = status.device;
  args.failure = failure;
  args.timeout_ns = 20'000'000'000ull;
  args.unroll = 4;

  for (std::uint64_t run = 1; run <= 2; ++run) {
    ASSERT_EQ(cudaMemset(dst, 0, total), cudaSuccess);
    waits[0] = run;  // group 1's flag comes later
    waits[2] = run;
    FlaggedLaunch launch;
    for (std::uint32_t g = 0; g < 3; ++g) {
      CopyFlags flags;
      flags.wait = waits.device + g;
      flags.wait_value = run;
      flags.peer = static_cast<int>(g);
      flags.wait_kind = kWaitData;
      flags.raise = raised + g;
      // Group g's flag ends run r at done_mark(10 r + g): the first run adds 10 + g units.
      flags.raise_units = run == 1 ? 10 + g : 10;
      ASSERT_TRUE(launch.add(g, ctas[g], flags));
    }
    launch_flagged_copies(args, launch, stream);
    auto mark = [&](std::uint32_t g) { return done_mark(10 * run + g); };
    const auto give_up = std::chrono::steady_clock::now() + std::chrono::seconds(10);
    while ((raised_value(0) != mark(0) || raised_value(2) != mark(2)) &&
           std::chrono::steady_clock::now() < give_up)
      std::this_thread::sleep_for(std::chrono::milliseconds(1));
    EXPECT_EQ(raised_value(0), mark(0)) << "run " << run << ": group 0 held back";
    EXPECT_EQ(raised_value(2), mark(2)) << "run " << run << ": group 2 held back";
    EXPECT_EQ(raised_value(1), run == 1 ? 0 : done_mark(11))
        << "group 1 raised before its flag came";
    EXPECT_EQ(cudaStreamQuery(stream), cudaErrorNotReady);
    waits[1] = run;
    ASSERT_EQ(cudaStreamSynchronize(stream), cudaSuccess);
    EXPECT_EQ(status.host->code, 0u);
    EXPECT_EQ(raised_value(1), mark(1));
    std::vector<unsigned char> landed(total);
    ASSERT_EQ(cudaMemcpy(landed.data(), dst, total, cudaMemcpyDeviceToHost), cudaSuccess);
    for (const CopyDescriptor& d : descriptors) {
      const std::uint64_t from = d.src - src, to = d.dst - dst;
      EXPECT_EQ(std::memcmp(landed.data() + to, pattern.data() + from, d.bytes), 0)
          << "run " << run << ": the " << d.bytes << "-byte piece differs";
    }
  }
  cudaStreamDestroy(stream);
}

// The transports' watchdog: checks only while a run is in flight, every period; ends a stream
// that waits in its front end for a word nobody raises (as a dead peer's would stay).
TEST(RunWatchdog, ChecksOnlyWhileBusyAndStopsAtOnce) {
  RunWatchdog watchdog;
  bool busy = false;
  int checks = 0;
  watchdog.start(
      0, [&] { return busy; },
      [&] {
        if (++checks == 3) busy = false;  // the run is over after three looks
      },
      std::chrono::milliseconds(5));
  std::this_thread::sleep_for(std::chrono::milliseconds(60));
  {
    std::lock_guard lock(watchdog.mutex());
    EXPECT_EQ(checks, 0) << "checked with no run in flight";
    busy = true;
    watchdog.wake();
  }
  // Three looks, then none: the thread may be slow to start (tools such as compute-sanitizer).
  const auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(10);
  for (bool over = false; !over && std::chrono::steady_clock::now() < deadline;) {
    std::this_thread::sleep_for(std::chrono::milliseconds(5));
    std::lock_guard lock(watchdog.mutex());
    over = !busy;
  }
  std::this_thread::sleep_for(std::chrono::milliseconds(50));  // ten periods more
  {
    std::lock_guard lock(watchdog.mutex());
    EXPECT_FALSE(busy) << "no look within 10 s of a run in flight";
    EXPECT_EQ(checks, 3) << "looks went on after the run was over";
  }

  RunWatchdog slow;  // a period far beyond the test: stop() must not wait for it
  slow.start(0, [] { return true; }, [] {}, std::chrono::seconds(600));
  std::this_thread::sleep_for(std::chrono::milliseconds(20));
  const auto start = std::chrono::steady_clock::now();
  slow.stop();
  EXPECT_FALSE(slow.running());
  EXPECT_LT(std::chrono::steady_clock::now() - start, std::chrono::seconds(1));
}

TEST(RunWatchdog, ReleasesAStreamWaitingForAWordNobodyRaises) {
  if (!stream_memory_ops_supported(0)) GTEST_SKIP() << "no 64-bit stream memory operations";
  std::uint64_t* word = nullptr;
  ASSERT_EQ(cudaMalloc(&word, sizeof *word), cudaSuccess);
  ASSERT_EQ(cudaMemset(word, 0, sizeof *word), cudaSuccess);
  cudaStream_t stream = nullptr, release = nullptr;
  cudaEvent_t done = nullptr;
  ASSERT_EQ(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking), cudaSuccess);
  ASSERT_EQ(cudaStreamCreateWithFlags(&release, cudaStreamNonBlocking), cudaSuccess);
  ASSERT_EQ(cudaEventCreateWithFlags(&done, cudaEventDisableTiming), cudaSuccess);
  const StreamMemoryOp wait{word, 7, true};
  queue_stream_memory_ops(stream, std::span(&wait, 1), true);
  ASSERT_EQ(cudaEventRecord(done, stream), cudaSuccess);

  RunWatchdog watchdog;
  bool in_flight = true;
  std::atomic<int> released{0};
  const auto queued = std::chrono::steady_clock::now();
  watchdog.start(
      0, [&] { return in_flight; },
      [&] {
        if (cudaEventQuery(done) == cudaSuccess) {
          in_flight = false;
        } else if (std::chrono::steady_clock::now() - queued > std::chrono::milliseconds(100)) {
          write_value_noexcept(release, word, 7);  // what a transport's release does
          cudaStreamSynchronize(release);
          ++released;
        }
      });
  {
    std::lock_guard lock(watchdog.mutex());
    watchdog.wake();
  }
  const auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(10);
  while (cudaEventQuery(done) == cudaErrorNotReady && std::chrono::steady_clock::now() < deadline)
    std::this_thread::sleep_for(std::chrono::milliseconds(5));
  EXPECT_EQ(cudaEventQuery(done), cudaSuccess) << "the stream still waits after 10 s";
  EXPECT_GE(std::chrono::steady_clock::now() - queued, std::chrono::milliseconds(100));
  bool seen_over = false;  // its next look, within a period or so, finds the run over
  while (!seen_over && std::chrono::steady_clock::now() < deadline) {
    std::this_thread::sleep_for(std::chrono::milliseconds(5));
    std::lock_guard lock(watchdog.mutex());
    seen_over = !in_flight;
  }
  watchdog.stop();
  EXPECT_GE(released.load(), 1);
  EXPECT_TRUE(seen_over) << "the watchdog did not see the run end";
  cudaEventDestroy(done);
  cudaStreamDestroy(release);
  cudaStreamDestroy(stream);
  cudaFree(word);
}

}  // namespace
}  // namespace reshard::cuda

int main(int argc, char** argv) {
  return reshard::testing_support::run_single_gpu_tests(argc, argv);
}
