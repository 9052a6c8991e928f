// Settings read from the environment: a bad value is refused with an error that names the
// variable and the value, and the defaults hold when the variable is unset.
#include "core/env.hpp"

#include <gtest/gtest.h>

#include <cstdlib>
#include <functional>
#include <string>

#include "reshard/error.hpp"
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

TEST(Env, CudaSettingsRefuseBadValuesNamingTheVariable) {
  expect_refused("RESHARD_CUDA_ENGINE", "fast", [] { env::cuda_engine(); });
  expect_refused("RESHARD_CUDA_SAME_DEVICE", "leader", [] { env::cuda_same_device(); });
  expect_refused("RESHARD_CUDA_CE_STREAMS", "0", [] { env::cuda_ce_streams(); });
  expect_refused("RESHARD_CUDA_CE_STREAMS", "9", [] { env::cuda_ce_streams(); });
  expect_refused("RESHARD_CUDA_CE_STREAMS", "two", [] { env::cuda_ce_streams(); });
  expect_refused("RESHARD_CUDA_UNROLL", "3", [] { env::cuda_unroll(); });
  expect_refused("RESHARD_CUDA_CTAS_PER_PEER", "0", [] { env::cuda_ctas_per_peer(); });
  expect_refused("RESHARD_CUDA_BYTES_PER_CTA", "1KiB", [] { env::cuda_bytes_per_cta(); });
  expect_refused("RESHARD_TIMEOUT_S", "-2", [] { env::timeout(); });
  expect_refused("RESHARD_NCCL_NONBLOCKING", "yes", [] { env::nccl_nonblocking(); });
  expect_refused("RESHARD_NVSHMEM_SEND_STREAM", "yes", [] { env::nvshmem_send_stream(); });
  expect_refused("RESHARD_NVSHMEM_PEERS_PER_ROUND", "-1", [] { env::nvshmem_peers_per_round(); });
  expect_refused("RESHARD_NVSHMEM_PEERS_PER_ROUND", "all", [] { env::nvshmem_peers_per_round(); });
  expect_refused("RESHARD_CUDA_EARLY_LAUNCH", "on", [] { env::cuda_early_launch(); });
  expect_refused("RESHARD_STAGING_BUDGET", "lots", [] { env::staging_budget(); });
  expect_refused("RESHARD_STAGING_BUDGET", "2 TB", [] { env::staging_budget(); });
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

TEST(Env, CudaSettingsAcceptEveryDocumentedValue) {
  for (const char* engine : {"auto", "sm", "ce", "autotune"}) {
    ScopedEnv scoped("RESHARD_CUDA_ENGINE", engine);
    EXPECT_EQ(env::cuda_engine(), engine);
  }
  for (int streams = 1; streams <= DebugOptions::kMaxCudaCeStreams; ++streams) {
    ScopedEnv scoped("RESHARD_CUDA_CE_STREAMS", std::to_string(streams).c_str());
    EXPECT_EQ(env::cuda_ce_streams(), streams);
  }
  for (const char* order : {"auto", "delegate", "stream", "kernel"}) {
    ScopedEnv scoped("RESHARD_CUDA_SAME_DEVICE", order);
    EXPECT_EQ(env::cuda_same_device(), order);
  }
  ::unsetenv("RESHARD_CUDA_SAME_DEVICE");
  EXPECT_EQ(env::cuda_same_device(), "auto");
  ::unsetenv("RESHARD_CUDA_ENGINE");
  ::unsetenv("RESHARD_CUDA_CE_STREAMS");
  {
    ScopedEnv scoped("RESHARD_CUDA_EARLY_LAUNCH", "0");
    EXPECT_FALSE(env::cuda_early_launch());
  }
  {
    ScopedEnv scoped("RESHARD_NVSHMEM_PEERS_PER_ROUND", "1");
    EXPECT_EQ(env::nvshmem_peers_per_round(), 1);
  }
  ::unsetenv("RESHARD_NVSHMEM_PEERS_PER_ROUND");
  EXPECT_EQ(env::nvshmem_peers_per_round(), 0);
  ::unsetenv("RESHARD_NCCL_NONBLOCKING");
  ::unsetenv("RESHARD_CUDA_EARLY_LAUNCH");
  EXPECT_EQ(env::cuda_engine(), "auto");
  EXPECT_TRUE(env::cuda_early_launch());
  EXPECT_TRUE(env::nccl_nonblocking());
  EXPECT_GE(env::cuda_ce_streams(), 1);
}

}  // namespace
}  // namespace reshard
