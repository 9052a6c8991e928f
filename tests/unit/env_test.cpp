// Settings read from the environment: a bad value is refused with an error that names the
// variable and the value (the defaults when no variable is set: options_test.cpp).
#include "core/env.hpp"

#include <gtest/gtest.h>

#include <cstdlib>
#include <functional>
#include <string>

#include "reshard/error.hpp"
#include "reshard/options.hpp"
#include "support/scoped_env.hpp"

namespace reshard {
namespace {

using testing_support::ScopedEnv;

void expect_refused(const char* name, const char* value, const std::function<void()>& read) {
  ScopedEnv scoped(name, value);
  try {
    read();
    ADD_FAILURE() << name << "=" << value << " was accepted";
  } catch (const Error& error) {
    EXPECT_EQ(error.code(), ErrorCode::kInvalidArgument);
    const std::string text = error.what();
    EXPECT_NE(text.find(name), std::string::npos) << text;
    EXPECT_NE(text.find(value), std::string::npos) << text;
  }
}

void read_options() { CopyServiceOptions::from_environment(); }

// Text that does not parse and values out of range alike name the variable and quote its text;
// a value out of range names the option it sets too.
TEST(Env, ServiceSettingsRefuseBadValuesNamingTheVariable) {
  expect_refused("RESHARD_CUDA_ENGINE", "fast", read_options);
  expect_refused("RESHARD_CUDA_SAME_DEVICE", "leader", read_options);
  expect_refused("RESHARD_CUDA_CE_STREAMS", "0", read_options);
  expect_refused("RESHARD_CUDA_CE_STREAMS", "9", read_options);
  expect_refused("RESHARD_CUDA_CE_STREAMS", "two", read_options);
  expect_refused("RESHARD_CUDA_UNROLL", "3", read_options);
  expect_refused("RESHARD_CUDA_CTAS_PER_PEER", "0", read_options);
  expect_refused("RESHARD_CUDA_BYTES_PER_CTA", "1KiB", read_options);
  expect_refused("RESHARD_CUDA_CE_MIN_BYTES", "lots", read_options);
  expect_refused("RESHARD_TIMEOUT_S", "-2", read_options);
  expect_refused("RESHARD_ARRIVAL_TIMEOUT_S", "soon", read_options);
  expect_refused("RESHARD_NCCL_NONBLOCKING", "yes", read_options);
  expect_refused("RESHARD_NCCL_GROUP_SPANS", "-3", read_options);
  expect_refused("RESHARD_NVSHMEM_SEND_STREAM", "yes", read_options);
  expect_refused("RESHARD_NVSHMEM_PEERS_PER_ROUND", "-1", read_options);
  expect_refused("RESHARD_NVSHMEM_PEERS_PER_ROUND", "all", read_options);
  expect_refused("RESHARD_NVSHMEM_STAGING_BYTES", "0", read_options);
  expect_refused("RESHARD_HOST_STAGING_BYTES", "8 apples", read_options);
  expect_refused("RESHARD_CUDA_EARLY_LAUNCH", "on", read_options);
  expect_refused("RESHARD_NODE_SIZE", "0", read_options);
  expect_refused("RESHARD_INTER_NODE_TRANSPORT", "cuda", read_options);
  expect_refused("RESHARD_INTER_NODE_TRANSPORT", "carrier-pigeon", read_options);
  expect_refused("RESHARD_TRANSPORT", "carrier-pigeon", read_options);
  expect_refused("RESHARD_DEVICE", "-1", read_options);
  expect_refused("RESHARD_CHUNK_BYTES", "0", read_options);
  expect_refused("RESHARD_STAGING_BUDGET", "lots", [] { env::staging_budget(); });
  expect_refused("RESHARD_STAGING_BUDGET", "2 TB", [] { env::staging_budget(); });
}

TEST(Env, AValueOutOfRangeNamesTheOptionItSets) {
  ScopedEnv scoped("RESHARD_CUDA_CTAS_PER_PEER", "2048");
  try {
    read_options();
    ADD_FAILURE() << "RESHARD_CUDA_CTAS_PER_PEER=2048 was accepted";
  } catch (const Error& error) {
    EXPECT_NE(std::string(error.what())
                  .find("RESHARD_CUDA_CTAS_PER_PEER='2048' "
                        "(CopyServiceOptions::advanced.cuda_ctas_per_peer) "
                        "is outside 1..1024"),
              std::string::npos)
        << error.what();
  }
}

TEST(Env, StagingBudgetTakesBytesUnlimitedOrNothing) {
  ::unsetenv("RESHARD_STAGING_BUDGET");
  EXPECT_EQ(env::staging_budget(), std::nullopt);
  {
    ScopedEnv scoped("RESHARD_STAGING_BUDGET", "1GiB");
    EXPECT_EQ(env::staging_budget(), std::uint64_t{1} << 30);
  }
  {
    ScopedEnv scoped("RESHARD_STAGING_BUDGET", "0");
    EXPECT_EQ(env::staging_budget(), 0u);
  }
  ScopedEnv scoped("RESHARD_STAGING_BUDGET", "unlimited");
  EXPECT_EQ(env::staging_budget(), UINT64_MAX);
}

TEST(Env, ServiceSettingsAcceptEveryDocumentedValue) {
  for (const char* engine : {"auto", "sm", "ce", "autotune"}) {
    ScopedEnv scoped("RESHARD_CUDA_ENGINE", engine);
    EXPECT_EQ(CopyServiceOptions::from_environment().cuda.engine, engine);
  }
  for (int streams = 1; streams <= AdvancedOptions::kMaxCudaCeStreams; ++streams) {
    ScopedEnv scoped("RESHARD_CUDA_CE_STREAMS", std::to_string(streams).c_str());
    EXPECT_EQ(CopyServiceOptions::from_environment().advanced.cuda_ce_streams, streams);
  }
  for (const char* order : {"auto", "delegate", "stream", "kernel"}) {
    ScopedEnv scoped("RESHARD_CUDA_SAME_DEVICE", order);
    EXPECT_EQ(CopyServiceOptions::from_environment().cuda.same_device, order);
  }
  for (const char* transport : {"nccl", "nvshmem", "host"}) {
    ScopedEnv scoped("RESHARD_INTER_NODE_TRANSPORT", transport);
    EXPECT_EQ(CopyServiceOptions::from_environment().inter_node_transport,
              parse_transport_kind(transport));
  }
  {
    ScopedEnv scoped("RESHARD_CUDA_EARLY_LAUNCH", "0");
    EXPECT_FALSE(CopyServiceOptions::from_environment().advanced.cuda_early_launch);
  }
  {
    ScopedEnv scoped("RESHARD_NVSHMEM_PEERS_PER_ROUND", "1");
    EXPECT_EQ(CopyServiceOptions::from_environment().advanced.nvshmem_peers_per_round, 1);
  }
}

}  // namespace
}  // namespace reshard
