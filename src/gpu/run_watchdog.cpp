#include "gpu/run_watchdog.hpp"

#include "gpu/cuda_device.hpp"

namespace reshard::cuda {

void RunWatchdog::start(int device, std::function<bool()> busy, std::function<void()> check,
                        std::chrono::milliseconds period) {
  busy_ = std::move(busy);
  check_ = std::move(check);
  period_ = period;
  stop_ = false;
  thread_ = std::thread([this, device] { loop(device); });
}

void RunWatchdog::loop(int device) noexcept {
  const auto scope = DeviceScope::try_enter(device);
  std::unique_lock lock(mutex_);
  while (!stop_) {
    if (!busy_()) {
      wake_.wait(lock);
      continue;
    }
    wake_.wait_for(lock, period_);
    if (!stop_ && busy_()) check_();
  }
}

void RunWatchdog::stop() noexcept {
  if (!thread_.joinable()) return;
  {
    std::lock_guard lock(mutex_);
    stop_ = true;
    wake_.notify_one();
  }
  thread_.join();
}

}  // namespace reshard::cuda
