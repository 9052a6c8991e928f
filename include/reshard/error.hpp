// Errors raised by reshard. Every failure is an exception carrying a code and a message that names
// what is wrong (task id, PEs, sizes), so callers never have to parse logs to find the cause.
#pragma once

#include <cstdint>
#include <stdexcept>
#include <string>
#include <vector>

namespace reshard {

enum class ErrorCode {
  kInvalidArgument,  // a caller passed something malformed (bad PE, range outside its buffer)
  kInvalidState,     // a call out of order (run() before schedule(), register after finalize())
  kValidation,       // the registered requests do not form a consistent transfer set
  kTimeout,          // a peer did not answer within the configured time
  kPeerFailure,      // a peer died or aborted
  kSystem,           // an operating-system call failed
  kUnsupported,      // the transport or build lacks what was asked for
  kIntegrity,        // verify mode: bytes arrived different from what was sent
  kInterrupted,      // the user stopped a wait (Ctrl-C, where the embedding program checks it)
};

const char* error_code_name(ErrorCode code);

class Error : public std::runtime_error {
 public:
  Error(ErrorCode code, const std::string& message, std::vector<std::uint64_t> tasks = {})
      : std::runtime_error(message), code_(code), tasks_(unique_in_order(std::move(tasks))) {}
  ErrorCode code() const noexcept { return code_; }
  // Validation errors: the task ids the problems name (so layers above can say what they are),
  // each once, in the order the problems name them.
  const std::vector<std::uint64_t>& tasks() const noexcept { return tasks_; }
  // The call failed on every PE alike with nothing done, or left every PE able to make it again
  // (a run given up on a late or stalled peer that is alive): the same call, made again on every
  // PE, is what to do next. The message says so too.
  bool retryable() const noexcept { return retryable_; }
  void set_retryable(bool retryable) noexcept { retryable_ = retryable; }
  // This error with another message (code, tasks and retryable kept): for layers that add what
  // they were doing.
  Error with_message(const std::string& message) const {
    Error error(code_, message, tasks_);
    error.retryable_ = retryable_;
    return error;
  }

 private:
  static std::vector<std::uint64_t> unique_in_order(std::vector<std::uint64_t> tasks);
  ErrorCode code_;
  std::vector<std::uint64_t> tasks_;
  bool retryable_ = false;
};

// A collective that every rank failed alike (rank 0 gave up waiting for a late rank and told the
// others): nothing it was to agree on took effect and the bootstrap stays in step, so the call that
// ran it may be made again on every rank.
class CollectiveAbandoned : public Error {
 public:
  CollectiveAbandoned(ErrorCode code, const std::string& message, std::vector<int> late = {})
      : Error(code, message), late_(std::move(late)) {
    set_retryable(true);
  }
  // The ranks rank 0 was still waiting for when it gave up (empty where it did not say), so the
  // layer above can name them as it knows them (a copy service: its PEs).
  const std::vector<int>& late() const noexcept { return late_; }

 private:
  std::vector<int> late_;
};

[[noreturn]] void throw_error(ErrorCode code, const std::string& message);
[[noreturn]] void throw_system_error(const std::string& what);  // appends strerror(errno)

}  // namespace reshard
