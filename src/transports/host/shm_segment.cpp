#include "transports/host/shm_segment.hpp"

#include <fcntl.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cstring>
#include <utility>

#include "reshard/error.hpp"
#include "reshard/types.hpp"

namespace reshard::host {
namespace {

std::byte* map_fd(int fd, std::size_t bytes, const std::string& name) {
  void* address = ::mmap(nullptr, bytes, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
  if (address == MAP_FAILED) throw_system_error("cannot map shared memory " + name);
  return static_cast<std::byte*>(address);
}

}  // namespace

ShmSegment ShmSegment::create(const std::string& name, std::size_t bytes) {
  const int fd = ::shm_open(name.c_str(), O_CREAT | O_EXCL | O_RDWR | O_CLOEXEC, 0600);
  if (fd < 0) throw_system_error("cannot create shared memory " + name);
  ShmSegment segment;
  segment.name_ = name;
  segment.owns_name_ = true;
  segment.bytes_ = bytes;
  if (const int rc = ::posix_fallocate(fd, 0, static_cast<off_t>(bytes)); rc != 0) {
    ::close(fd);
    ::shm_unlink(name.c_str());
    throw_error(ErrorCode::kSystem, "cannot reserve " + format_bytes(bytes) +
                                        " of shared memory for " + name + ": " + std::strerror(rc) +
                                        " (is /dev/shm full? lower RESHARD_HOST_STAGING_BYTES)");
  }
  try {
    segment.data_ = map_fd(fd, bytes, name);
  } catch (...) {
    ::close(fd);
    ::shm_unlink(name.c_str());
    throw;
  }
  ::close(fd);
  return segment;
}

ShmSegment ShmSegment::open(const std::string& name, std::size_t bytes) {
  const int fd = ::shm_open(name.c_str(), O_RDWR | O_CLOEXEC, 0600);
  if (fd < 0) throw_system_error("cannot open a peer's shared memory " + name);
  // Touching a mapping past the file's end raises SIGBUS: a segment its owner has not sized yet
  // (or one left by another step of a job whose PEs went out of step) is refused instead.
  struct stat status{};
  if (::fstat(fd, &status) != 0 || static_cast<std::size_t>(status.st_size) < bytes) {
    const auto found = static_cast<long long>(status.st_size);
    ::close(fd);
    throw_error(ErrorCode::kPeerFailure,
                "a peer's shared memory " + name + " holds " + std::to_string(found) +
                    " bytes, not the " + std::to_string(bytes) +
                    " expected: the PEs are not at the same step (did one fail or restart?)");
  }
  ShmSegment segment;
  segment.name_ = name;
  segment.bytes_ = bytes;
  try {
    segment.data_ = map_fd(fd, bytes, name);
  } catch (...) {
    ::close(fd);
    throw;
  }
  ::close(fd);
  return segment;
}

ShmSegment::~ShmSegment() {
  unlink();
  if (data_ != nullptr) ::munmap(data_, bytes_);
}

ShmSegment::ShmSegment(ShmSegment&& other) noexcept
    : name_(std::move(other.name_)),
      data_(std::exchange(other.data_, nullptr)),
      bytes_(std::exchange(other.bytes_, 0)),
      owns_name_(std::exchange(other.owns_name_, false)) {}

ShmSegment& ShmSegment::operator=(ShmSegment&& other) noexcept {
  if (this != &other) {
    unlink();
    if (data_ != nullptr) ::munmap(data_, bytes_);
    name_ = std::move(other.name_);
    data_ = std::exchange(other.data_, nullptr);
    bytes_ = std::exchange(other.bytes_, 0);
    owns_name_ = std::exchange(other.owns_name_, false);
  }
  return *this;
}

void ShmSegment::unlink() noexcept {
  if (owns_name_) {
    ::shm_unlink(name_.c_str());
    owns_name_ = false;
  }
}

}  // namespace reshard::host
