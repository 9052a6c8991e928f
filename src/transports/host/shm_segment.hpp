// A POSIX shared-memory segment that is unlinked as soon as every peer has mapped it, so nothing is
// left in /dev/shm after a normal or failed run (a crash can only leak it during set-up).
#pragma once

#include <cstddef>
#include <string>

namespace reshard::host {

class ShmSegment {
 public:
  ShmSegment() = default;
  // Creates and maps a new segment; space is reserved up front so a full /dev/shm is an error now
  // rather than a SIGBUS later.
  static ShmSegment create(const std::string& name, std::size_t bytes);
  // Maps a segment a peer created.
  static ShmSegment open(const std::string& name, std::size_t bytes);

  ~ShmSegment();
  ShmSegment(ShmSegment&& other) noexcept;
  ShmSegment& operator=(ShmSegment&& other) noexcept;
  ShmSegment(const ShmSegment&) = delete;
  ShmSegment& operator=(const ShmSegment&) = delete;

  std::byte* data() const { return data_; }
  std::size_t size() const { return bytes_; }
  // Removes the name; the mapping stays valid for everyone who has it.
  void unlink() noexcept;

 private:
  std::string name_;
  std::byte* data_ = nullptr;
  std::size_t bytes_ = 0;
  bool owns_name_ = false;
};

}  // namespace reshard::host
