#include "execution/verdicts.hpp"

#include <algorithm>
#include <string>

#include "core/message.hpp"
#include "reshard/error.hpp"
#include "service/service_slot.hpp"

namespace reshard::execution {

std::vector<std::vector<std::byte>> gather_verdicts(CopyService& service,
                                                    std::span<const std::byte> mine,
                                                    const std::exception_ptr& failure,
                                                    const char* meeting) {
  const PeId me = service.my_pe();
  ErrorCode code = ErrorCode::kInvalidArgument;
  std::string text;
  bool ours = true;
  if (failure) {
    try {
      std::rethrow_exception(failure);
    } catch (const Error& error) {
      code = error.code();
      text = error.what();
    } catch (const std::exception& error) {
      ours = false;
      text = error.what();
    } catch (...) {
      ours = false;
      text = "an exception that is not a std::exception";
    }
  }
  message::Writer out;
  out.put<std::uint8_t>(failure ? 1 : 0);
  out.put<std::int32_t>(static_cast<std::int32_t>(code));
  out.put_string(text);
  out.put_array(mine);
  const auto all = meeting != nullptr ? ServiceSlot::meet(service, out.bytes(), meeting)
                                      : service.all_gather(out.bytes());
  std::vector<std::vector<std::byte>> parts(all.size());
  std::vector<int> failed;
  std::string first_text;
  ErrorCode first_code = code;
  for (std::size_t rank = 0; rank < all.size(); ++rank) {
    message::Reader in(all[rank]);
    const bool their_failure = in.get<std::uint8_t>() != 0;
    const auto their_code = static_cast<ErrorCode>(in.get<std::int32_t>());
    std::string their_text = in.get_string();
    parts[rank] = in.get_array<std::byte>();
    if (!their_failure) continue;
    if (failed.empty()) {
      first_code = their_code;
      first_text = std::move(their_text);
    }
    failed.push_back(static_cast<int>(rank));
  }
  if (failed.empty()) return parts;
  if (failure && !ours) std::rethrow_exception(failure);
  // A PE that failed itself tells its own cause (each PE's is the one it can correct); the
  // others tell the first failing PE's.
  if (failure) {
    first_code = code;
    first_text = text;
    std::rotate(failed.begin(), std::find(failed.begin(), failed.end(), me), failed.end());
  }
  std::string others;
  if (failed.size() > 1) {
    others = " (and PE";
    others += failed.size() > 2 ? "s" : "";
    for (std::size_t i = 1; i < failed.size(); ++i)
      others += (i > 1 ? ", " : " ") + std::to_string(failed[i]);
    others += ")";
  }
  throw Error(first_code,
              "PE " + std::to_string(failed[0]) + others +
                  " refused the refit, so every PE stops before any byte moves: " + first_text +
                  " [the copy service stays usable: call again on every PE with "
                  "that corrected]");
}

}  // namespace reshard::execution
