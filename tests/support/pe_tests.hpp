// What every multi-process GoogleTest binary shares: the job's bootstrap, a collective "did every
// PE pass", and a main() that lets only PE 0 print the full report.
#pragma once

#include <gtest/gtest.h>

#include <cstdio>
#include <cstdlib>
#include <memory>
#include <span>
#include <string>

#include "reshard/bootstrap.hpp"
#include "reshard/copy_service.hpp"

namespace reshard::testing_support {

inline std::shared_ptr<Bootstrap>& bootstrap() {
  static std::shared_ptr<Bootstrap> instance;
  return instance;
}

// Collective: true when `ok` holds on every PE.
inline bool all_pes(bool ok) {
  const std::byte mine{static_cast<unsigned char>(ok ? 1 : 0)};
  for (const auto& part : bootstrap()->all_gather(std::span(&mine, 1))) {
    if (part.at(0) != std::byte{1}) return false;
  }
  return true;
}

// RESHARD_TEST_TRANSPORT (default `fallback`): the transport a suite asks for.
inline TransportKind transport_under_test(const char* fallback) {
  const char* name = std::getenv("RESHARD_TEST_TRANSPORT");
  return parse_transport_kind(name ? name : fallback);
}

// A ready service on the transport under test. With RESHARD_TEST_EXPECT_TRANSPORT set, the
// transport must be that one ("host+host": auto made a mixed schedule of the declared nodes).
inline std::unique_ptr<CopyService> make_test_service(const char* fallback_transport) {
  auto service =
      std::make_unique<CopyService>(bootstrap(), transport_under_test(fallback_transport));
  service->init(LogLevel::kWarn);
  if (const char* expected = std::getenv("RESHARD_TEST_EXPECT_TRANSPORT")) {
    EXPECT_EQ(service->transport_name(), expected);
  }
  return service;
}

class FailurePrinter : public testing::EmptyTestEventListener {
  void OnTestPartResult(const testing::TestPartResult& result) override {
    if (result.failed()) {
      std::printf("%s:%d: Failure on this PE\n%s\n", result.file_name() ? result.file_name() : "?",
                  result.line_number(), result.message());
    }
  }
};

// Bootstraps, checks the PE count against RESHARD_EXPECT_PES (a launcher mix-up would otherwise
// leave every process a job of one PE), runs every test, and agrees on the result across PEs.
inline int run_pe_tests(int argc, char** argv) {
  testing::InitGoogleTest(&argc, argv);
  bootstrap() = make_default_bootstrap();
  if (const char* expected = std::getenv("RESHARD_EXPECT_PES");
      expected && std::atoi(expected) != bootstrap()->size()) {
    std::fprintf(stderr, "expected %s PEs, the bootstrap found %d\n", expected,
                 bootstrap()->size());
    return 1;
  }
  if (bootstrap()->rank() != 0) {
    auto& listeners = testing::UnitTest::GetInstance()->listeners();
    delete listeners.Release(listeners.default_result_printer());
    listeners.Append(new FailurePrinter);
  }
  const int result = RUN_ALL_TESTS();
  const bool all_passed = all_pes(result == 0);
  bootstrap().reset();
  return all_passed ? 0 : 1;
}

}  // namespace reshard::testing_support
