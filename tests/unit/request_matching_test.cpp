#include <gtest/gtest.h>

#include "reshard/error.hpp"
#include "reshard/scheduler.hpp"

namespace reshard {
namespace {

// The refusal's message; `tasks` receives the task ids it carries (Error::tasks()).
std::string refusal(const std::vector<RequestClaim>& sends,
                    const std::vector<RequestClaim>& receives, int n = 4,
                    std::vector<TaskId>* tasks = nullptr) {
  try {
    match_requests(sends, receives, n);
  } catch (const Error& error) {
    EXPECT_EQ(error.code(), ErrorCode::kValidation);
    if (tasks != nullptr) *tasks = error.tasks();
    return error.what();
  }
  ADD_FAILURE() << "the requests were accepted";
  return {};
}

TEST(RequestMatching, MatchesSendsWithReceives) {
  const std::vector<RequestClaim> sends = {{7, 0, 1, 64}, {3, 2, 2, 8}};
  const std::vector<RequestClaim> receives = {{3, 2, 2, 8}, {7, 1, 0, 64}};
  const auto transfers = match_requests(sends, receives, 3);
  ASSERT_EQ(transfers.size(), 2u);
  EXPECT_EQ(transfers[0].task, 3u);
  EXPECT_EQ(transfers[1].src, 0);
  EXPECT_EQ(transfers[1].dst, 1);
  EXPECT_EQ(transfers[1].bytes, 64u);
}

TEST(RequestMatching, NamesASendWithoutReceive) {
  const std::string message = refusal({{42, 0, 2, 4096}}, {});
  EXPECT_NE(message.find("task 42: send of 4096 bytes from PE 0 to PE 2 has no matching receive"),
            std::string::npos)
      << message;
}

TEST(RequestMatching, NamesAReceiveWithoutSend) {
  const std::string message = refusal({}, {{9, 3, 1, 16}});
  EXPECT_NE(message.find("task 9: receive of 16 bytes on PE 3 from PE 1 has no matching send"),
            std::string::npos)
      << message;
}

TEST(RequestMatching, NamesSizesThatDiffer) {
  const std::string message = refusal({{5, 0, 1, 100}}, {{5, 1, 0, 99}});
  EXPECT_NE(message.find("task 5: PE 0 sends 100 bytes but PE 1 expects 99 bytes"),
            std::string::npos)
      << message;
}

TEST(RequestMatching, NamesPesThatDisagree) {
  const std::string message = refusal({{5, 0, 1, 100}}, {{5, 2, 0, 100}});
  EXPECT_NE(message.find("PE 0 sends to PE 1 but the receive is registered on PE 2"),
            std::string::npos)
      << message;
}

TEST(RequestMatching, NamesDuplicateTaskIds) {
  std::vector<TaskId> tasks;
  EXPECT_NE(refusal({{5, 0, 1, 1}, {5, 2, 1, 1}}, {{5, 1, 0, 1}}, 4, &tasks)
                .find("task 5 has more than one send (on PE 0 and PE 2)"),
            std::string::npos);
  EXPECT_EQ(tasks, std::vector<TaskId>{5});
  EXPECT_NE(refusal({{6, 0, 1, 1}}, {{6, 1, 0, 1}, {6, 1, 0, 1}})
                .find("task 6 has more than one receive (PE 1 registered it twice"),
            std::string::npos);
}

TEST(RequestMatching, NamesPesOutOfRange) {
  std::vector<TaskId> tasks;
  const std::string message = refusal({{1, 0, 9, 8}}, {{1, 9, 0, 8}}, 4, &tasks);
  EXPECT_NE(message.find("names PE 9, outside 0..3"), std::string::npos) << message;
  // The send's claim and the receive's name task 1: the error lists it once.
  EXPECT_EQ(tasks, (std::vector<TaskId>{1}));
}

TEST(RequestMatching, CountsEveryProblemAndListsTheFirst) {
  std::vector<RequestClaim> sends;
  for (TaskId t = 0; t < 20; ++t) sends.push_back({t, 0, 1, 1});
  const std::string message = refusal(sends, {});
  EXPECT_NE(message.find("20 problems"), std::string::npos) << message;
  const std::string one = refusal({{1, 0, 1, 1}}, {});
  EXPECT_NE(one.find("1 problem with"), std::string::npos) << one;
  EXPECT_NE(message.find("and 12 more"), std::string::npos) << message;
}

}  // namespace
}  // namespace reshard
