// Where the PEs meet at the start of every collective call of the service and the executor.
#include "core/env.hpp"
#include "core/message.hpp"
#include "service/copy_service_impl.hpp"

namespace reshard {

// Where the PEs meet at the start of a collective call (`call`: "schedule()", "bind()"):
// one may come minutes after the others (a trainer finishing its step), so this all-gather waits
// the arrival timeout, and the transfer timeout applies again after it. A PE that does not come in
// time is named as a PE (the service's PEs are its bootstrap's ranks), and every PE fails the call
// alike with nothing done, so it may be made again on every PE.
// Each PE's part names its call: PEs in different collective calls at the same point (a program
// that calls them in a different order on some PE) all fail the meeting alike, naming both.
std::vector<std::vector<std::byte>> meet(Bootstrap& bootstrap, const CopyServiceOptions& options,
                                         std::span<const std::byte> mine, const std::string& call) {
  const auto what = [&] {
    return call + " on PE " + std::to_string(bootstrap.rank()) + ": every PE must call " + call +
           ", and not every one did within the arrival timeout (" +
           format_seconds(options.arrival_timeout) +
           "; arrival_timeout, RESHARD_ARRIVAL_TIMEOUT_S)";
  };
  message::Writer tagged;
  tagged.put_string(call);
  tagged.put_array(mine);
  std::vector<std::vector<std::byte>> all;
  bootstrap.set_timeout(options.arrival_timeout);
  try {
    all = bootstrap.all_gather(tagged.bytes());
    bootstrap.set_timeout(options.timeout);
  } catch (const CollectiveAbandoned& abandoned) {
    bootstrap.set_timeout(options.timeout);
    std::string late;
    for (const int pe : abandoned.late())
      late += (late.empty() ? "PE " : ", PE ") + std::to_string(pe);
    const std::string who =
        late.empty() ? abandoned.what() : late + " did not call " + call + " in time";
    throw CollectiveAbandoned(abandoned.code(),
                              what() + ": " + who +
                                  "; nothing took effect and the service is usable: call " + call +
                                  " again on every PE",
                              abandoned.late());
  } catch (const Error& error) {
    bootstrap.set_timeout(options.timeout);
    if (error.code() != ErrorCode::kTimeout && error.code() != ErrorCode::kPeerFailure) throw;
    // The bootstrap names the ranks it waited for; say what they were to do.
    throw Error(error.code(),
                what() + " or stayed (the bootstrap's rank N is PE N): " + error.what());
  }
  std::string other_calls;
  for (std::size_t pe = 0; pe < all.size(); ++pe) {
    message::Reader reader(all[pe]);
    const std::string theirs = reader.get_string();
    if (theirs != call)
      other_calls += (other_calls.empty() ? "PE " : ", PE ") + std::to_string(pe) + " " + theirs;
    all[pe] = reader.get_array<std::byte>();
  }
  if (!other_calls.empty()) {
    CollectiveAbandoned mismatch(ErrorCode::kInvalidState,
                                 call + " on PE " + std::to_string(bootstrap.rank()) +
                                     " met other calls: " + other_calls +
                                     " (every PE must make the same collective calls in the same "
                                     "order); nothing took effect");
    mismatch.set_retryable(false);  // the program's order is to be mended, not retried
    throw mismatch;
  }
  return all;
}

}  // namespace reshard
