// CopyServiceOptions: the environment gives the defaults, each variable lands in its field, and a
// value out of range is refused naming the field before a service starts.
#include "reshard/options.hpp"

#include <gtest/gtest.h>

#include <cstdlib>
#include <functional>
#include <string>
#include <vector>

#include "reshard/copy_service.hpp"
#include "reshard/error.hpp"
#include "support/scoped_env.hpp"

namespace reshard {
namespace {

using testing_support::ScopedEnv;

TEST(Options, WithoutVariablesTheEnvironmentGivesTheDefaults) {
  const CopyServiceOptions defaults;
  const CopyServiceOptions read = CopyServiceOptions::from_environment();
  EXPECT_EQ(read.transport, defaults.transport);
  EXPECT_EQ(read.inter_node_transport, defaults.inter_node_transport);
  EXPECT_EQ(read.node_size, defaults.node_size);
  EXPECT_EQ(read.device, defaults.device);
  EXPECT_EQ(read.timeout, defaults.timeout);
  EXPECT_EQ(read.arrival_timeout, defaults.arrival_timeout);
  EXPECT_EQ(read.verify, defaults.verify);
  EXPECT_EQ(read.chunk_bytes, defaults.chunk_bytes);
  EXPECT_EQ(read.log_level, defaults.log_level);
  EXPECT_EQ(read.host.staging_bytes, defaults.host.staging_bytes);
  EXPECT_EQ(read.cuda.engine, defaults.cuda.engine);
  EXPECT_EQ(read.cuda.same_device, defaults.cuda.same_device);
  EXPECT_EQ(read.nccl.nonblocking, defaults.nccl.nonblocking);
  EXPECT_EQ(read.nvshmem.staging_bytes, defaults.nvshmem.staging_bytes);
  EXPECT_EQ(read.nvshmem.waits, defaults.nvshmem.waits);
  EXPECT_TRUE(read.advanced == defaults.advanced);
  EXPECT_TRUE(read.debug == defaults.debug);
  EXPECT_EQ(read.cuda.ctas_per_peer, defaults.cuda.ctas_per_peer);
  EXPECT_EQ(read.nccl.group_spans, defaults.nccl.group_spans);
  EXPECT_NO_THROW(defaults.validate());
}

// Every documented variable, set to a value other than the default, shows in its field.
TEST(Options, EveryVariableLandsInItsField) {
  struct Case {
    const char* name;
    const char* value;
    std::function<bool(const CopyServiceOptions&)> holds;
  };
  const std::vector<Case> cases = {
      {"RESHARD_TRANSPORT", "host", [](auto& o) { return o.transport == TransportKind::kHost; }},
      {"RESHARD_INTER_NODE_TRANSPORT", "nccl",
       [](auto& o) { return o.inter_node_transport == TransportKind::kNccl; }},
      {"RESHARD_NODE_SIZE", "4", [](auto& o) { return o.node_size == 4; }},
      {"RESHARD_DEVICE", "3", [](auto& o) { return o.device == 3; }},
      {"RESHARD_TIMEOUT_S", "2.5", [](auto& o) { return o.timeout.count() == 2500; }},
      {"RESHARD_ARRIVAL_TIMEOUT_S", "900",
       [](auto& o) { return o.arrival_timeout.count() == 900000; }},
      {"RESHARD_VERIFY", "1", [](auto& o) { return o.verify; }},
      {"RESHARD_CHUNK_BYTES", "64KiB", [](auto& o) { return o.chunk_bytes == 65536u; }},
      {"RESHARD_LOG_LEVEL", "debug", [](auto& o) { return o.log_level == LogLevel::kDebug; }},
      {"RESHARD_HOST_STAGING_BYTES", "16MiB",
       [](auto& o) { return o.host.staging_bytes == (16u << 20); }},
      {"RESHARD_CUDA_ENGINE", "ce", [](auto& o) { return o.cuda.engine == "ce"; }},
      {"RESHARD_CUDA_CE_MIN_BYTES", "1MiB",
       [](auto& o) { return o.advanced.cuda_ce_min_bytes == (1u << 20); }},
      {"RESHARD_CUDA_CTAS_PER_PEER", "7",
       [](auto& o) { return o.advanced.cuda_ctas_per_peer == 7; }},
      {"RESHARD_CUDA_BYTES_PER_CTA", "8KiB",
       [](auto& o) { return o.advanced.cuda_bytes_per_cta == 8192u; }},
      {"RESHARD_CUDA_SAME_DEVICE", "stream",
       [](auto& o) { return o.cuda.same_device == "stream"; }},
      {"RESHARD_NCCL_NONBLOCKING", "0", [](auto& o) { return !o.nccl.nonblocking; }},
      {"RESHARD_NCCL_GROUP_SPANS", "9", [](auto& o) { return o.advanced.nccl_group_spans == 9u; }},
      {"RESHARD_NVSHMEM_STAGING_BYTES", "32MiB",
       [](auto& o) { return o.nvshmem.staging_bytes == (32u << 20); }},
      {"RESHARD_NVSHMEM_WAITS", "stream", [](auto& o) { return o.nvshmem.waits == "stream"; }},
      {"RESHARD_CUDA_TRACE", "1", [](auto& o) { return o.advanced.cuda_trace; }},
      {"RESHARD_NVSHMEM_TRACE", "1", [](auto& o) { return o.advanced.nvshmem_trace; }},
      {"RESHARD_STEP_TIMING", "1", [](auto& o) { return o.advanced.step_timing; }},
      {"RESHARD_PHASE_TIMING", "1", [](auto& o) { return o.advanced.step_timing; }},
      {"RESHARD_PIPELINED_PHASES", "0", [](auto& o) { return !o.advanced.pipelined_phases; }},
      {"RESHARD_CUDA_CE_STREAMS", "3", [](auto& o) { return o.advanced.cuda_ce_streams == 3; }},
      {"RESHARD_CUDA_UNROLL", "4", [](auto& o) { return o.advanced.cuda_unroll == 4; }},
      {"RESHARD_CUDA_EARLY_LAUNCH", "0", [](auto& o) { return !o.advanced.cuda_early_launch; }},
      {"RESHARD_CUDA_BATCH_MEMOPS", "0", [](auto& o) { return !o.advanced.cuda_batch_memops; }},
      {"RESHARD_NVSHMEM_DIRECT", "0", [](auto& o) { return !o.advanced.nvshmem_direct; }},
      {"RESHARD_NVSHMEM_SEND_STREAM", "0", [](auto& o) { return !o.advanced.nvshmem_send_stream; }},
      {"RESHARD_NVSHMEM_PEERS_PER_ROUND", "2",
       [](auto& o) { return o.advanced.nvshmem_peers_per_round == 2; }},
  };
  for (const Case& c : cases) {
    ScopedEnv scoped(c.name, c.value);
    const CopyServiceOptions read = CopyServiceOptions::from_environment();
    EXPECT_TRUE(c.holds(read)) << c.name << "=" << c.value << " did not reach its field";
    EXPECT_NO_THROW(read.validate()) << c.name << "=" << c.value;
  }
}

// Values set in code are checked as the environment's are, and the error names the field.
TEST(Options, OutOfRangeValuesAreRefusedNamingTheField) {
  const std::vector<std::pair<std::string, std::function<void(CopyServiceOptions&)>>> cases = {
      {"cuda.engine", [](auto& o) { o.cuda.engine = "fast"; }},
      {"cuda.same_device", [](auto& o) { o.cuda.same_device = "leader"; }},
      {"advanced.cuda_ctas_per_peer", [](auto& o) { o.advanced.cuda_ctas_per_peer = 0; }},
      {"advanced.cuda_ctas_per_peer", [](auto& o) { o.advanced.cuda_ctas_per_peer = 1025; }},
      {"advanced.cuda_bytes_per_cta", [](auto& o) { o.advanced.cuda_bytes_per_cta = 1024; }},
      // Set under a former name: refused under that name.
      {"cuda.ctas_per_peer", [](auto& o) { o.cuda.ctas_per_peer = 0; }},
      {"debug.cuda_unroll", [](auto& o) { o.debug.cuda_unroll = 6; }},
      {"timeout", [](auto& o) { o.timeout = std::chrono::milliseconds(0); }},
      {"arrival_timeout", [](auto& o) { o.arrival_timeout = std::chrono::milliseconds(-1); }},
      {"node_size", [](auto& o) { o.node_size = 0; }},
      {"device", [](auto& o) { o.device = -1; }},
      {"chunk_bytes", [](auto& o) { o.chunk_bytes = 0; }},
      {"inter_node_transport", [](auto& o) { o.inter_node_transport = TransportKind::kCuda; }},
      {"advanced.nccl_group_spans", [](auto& o) { o.advanced.nccl_group_spans = 0; }},
      {"host.staging_bytes", [](auto& o) { o.host.staging_bytes = 0; }},
      {"nvshmem.staging_bytes", [](auto& o) { o.nvshmem.staging_bytes = 0; }},
      {"nvshmem.waits", [](auto& o) { o.nvshmem.waits = "spin"; }},
      {"advanced.cuda_ce_streams", [](auto& o) { o.advanced.cuda_ce_streams = 9; }},
      {"advanced.cuda_unroll", [](auto& o) { o.advanced.cuda_unroll = 6; }},
      {"advanced.nvshmem_peers_per_round",
       [](auto& o) { o.advanced.nvshmem_peers_per_round = -1; }},
  };
  for (const auto& [field, spoil] : cases) {
    CopyServiceOptions options;
    spoil(options);
    try {
      options.validate();
      ADD_FAILURE() << field << ": accepted";
    } catch (const Error& error) {
      EXPECT_EQ(error.code(), ErrorCode::kInvalidArgument);
      EXPECT_NE(std::string(error.what()).find("CopyServiceOptions::" + field + " "),
                std::string::npos)
          << error.what();
    }
  }
}

// Tuning and diagnosis moved to `advanced`; for one release their former names still work: a
// value set there only is what the service runs with.
TEST(Options, AFormerNameSetAloneIsWhatTheServiceRunsWith) {
  CopyServiceOptions options;
  options.transport = TransportKind::kHost;
  options.cuda.ctas_per_peer = 16;
  options.nccl.group_spans = 3;
  options.debug.phase_timing = true;
  options.debug.cuda_unroll = 4;
  options.advanced.cuda_ce_streams = 2;  // set under its new name: kept
  CopyService service(options);
  const CopyServiceOptions& used = service.options();
  EXPECT_EQ(used.advanced.cuda_ctas_per_peer, 16);
  EXPECT_EQ(used.advanced.nccl_group_spans, 3u);
  EXPECT_TRUE(used.advanced.step_timing);
  EXPECT_EQ(used.advanced.cuda_unroll, 4);
  EXPECT_EQ(used.advanced.cuda_ce_streams, 2);
  // The former names are back at their defaults, so these options, changed under the new names,
  // make another service.
  const CopyServiceOptions defaults;
  EXPECT_TRUE(used.debug == defaults.debug);
  EXPECT_EQ(used.cuda.ctas_per_peer, defaults.cuda.ctas_per_peer);
  CopyServiceOptions changed = used;
  changed.advanced.cuda_ctas_per_peer = 32;
  EXPECT_NO_THROW(changed.validate());
  EXPECT_EQ(used.advanced.cuda_bytes_per_cta, defaults.advanced.cuda_bytes_per_cta);
  EXPECT_EQ(used.advanced.nvshmem_direct, defaults.advanced.nvshmem_direct);
}

// A former name and its new name set to different values: refused naming both.
TEST(Options, AFormerNameAndItsNewNameDisagreeingAreRefused) {
  CopyServiceOptions options;
  options.cuda.ctas_per_peer = 16;
  options.advanced.cuda_ctas_per_peer = 32;
  try {
    options.validate();
    ADD_FAILURE() << "accepted";
  } catch (const Error& error) {
    const std::string what = error.what();
    EXPECT_NE(what.find("CopyServiceOptions::cuda.ctas_per_peer = 16 is the former name of "
                        "advanced.cuda_ctas_per_peer, which is set to 32"),
              std::string::npos)
        << what;
  }
  options.advanced.cuda_ctas_per_peer = 16;  // both the same: one value meant
  EXPECT_NO_THROW(options.validate());
}

// A service refuses bad options when it is made, before any peer is contacted.
TEST(Options, AServiceRefusesBadOptionsWhenMade) {
  CopyServiceOptions options;
  options.transport = TransportKind::kHost;
  options.cuda.engine = "fast";
  try {
    CopyService service(options);
    ADD_FAILURE() << "a service was made with cuda.engine = fast";
  } catch (const Error& error) {
    EXPECT_NE(std::string(error.what()).find("cuda.engine"), std::string::npos) << error.what();
  }
}

// Code wins over the environment: a transport named in code is the one used, and
// RESHARD_TRANSPORT chooses only where the code says kAuto; the options constructor takes the
// options as given.
TEST(Options, ATransportNamedInCodeWinsOverTheEnvironment) {
  ScopedEnv scoped("RESHARD_TRANSPORT", "host");
  CopyService named(TransportKind::kCuda);
  EXPECT_EQ(named.transport(), TransportKind::kCuda);
  CopyService left_to_the_job(TransportKind::kAuto);
  EXPECT_EQ(left_to_the_job.transport(), TransportKind::kHost);
  CopyServiceOptions options;
  options.transport = TransportKind::kCuda;
  CopyService given(options);
  EXPECT_EQ(given.transport(), TransportKind::kCuda);
  EXPECT_EQ(given.options().transport, TransportKind::kCuda);
}

}  // namespace
}  // namespace reshard
