// Whether a multi-process GPU test can run here. PEs share GPUs where there are fewer GPUs than
// PEs (colocated processes, as RL jobs run trainer and engine), except where NCCL is in the
// schedule: NCCL refuses two ranks on one GPU.
#pragma once

#include <cstdlib>
#include <string>

namespace reshard::testing_support {

// Empty when the test can run with `devices` GPUs, else why it is skipped.
inline std::string gpu_skip_reason(int devices) {
  if (devices == 0) return "no CUDA device";
  const char* expected = std::getenv("RESHARD_EXPECT_PES");
  const int pes = expected ? std::atoi(expected) : 1;
  if (devices >= pes) return {};
  auto is = [](const char* variable, const char* value) {
    const char* set = std::getenv(variable);
    return set != nullptr && std::string(set) == value;
  };
  if (is("RESHARD_TEST_TRANSPORT", "nccl") ||
      (is("RESHARD_TEST_TRANSPORT", "auto") && is("RESHARD_INTER_NODE_TRANSPORT", "nccl"))) {
    return "NCCL needs a CUDA device per rank (it refuses two ranks on one GPU); " +
           std::to_string(pes) + " PEs, " + std::to_string(devices) + " device(s)";
  }
  return {};
}

}  // namespace reshard::testing_support
