// A thread that looks at a GPU transport's runs in flight, so that a run whose peer died or stopped
// ends in an error instead of a stream waiting forever: where a wait sits in a stream's front end
// (stream memory operations) no kernel's spin limit can end it.
#pragma once

#include <chrono>
#include <condition_variable>
#include <functional>
#include <mutex>
#include <thread>

namespace reshard::cuda {

class RunWatchdog {
 public:
  RunWatchdog() = default;
  RunWatchdog(const RunWatchdog&) = delete;
  RunWatchdog& operator=(const RunWatchdog&) = delete;
  ~RunWatchdog() { stop(); }

  // Starts the thread, current on `device`. It sleeps while `busy()` is false; while true, it calls
  // `check()` every `period`. Both are called with mutex() held: the transport's state they read
  // is guarded by it.
  void start(int device, std::function<bool()> busy, std::function<void()> check,
             std::chrono::milliseconds period = std::chrono::milliseconds(20));
  bool running() const { return thread_.joinable(); }
  std::mutex& mutex() { return mutex_; }
  // After a change that makes busy() true; call with mutex() held.
  void wake() { wake_.notify_one(); }
  // Ends and joins the thread (no-op when not running).
  void stop() noexcept;

 private:
  void loop(int device) noexcept;

  std::function<bool()> busy_;
  std::function<void()> check_;
  std::chrono::milliseconds period_{};
  bool stop_ = false;
  std::mutex mutex_;
  std::condition_variable wake_;
  std::thread thread_;
};

}  // namespace reshard::cuda
