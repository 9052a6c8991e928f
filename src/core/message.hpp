// Messages between PEs over the bootstrap: plain values packed into byte vectors. Every PE runs
// the same binary on the same architecture, so values travel in native byte order.
#pragma once

#include <cstddef>
#include <cstring>
#include <span>
#include <string>
#include <type_traits>
#include <vector>

#include "reshard/error.hpp"

namespace reshard::message {

class Writer {
 public:
  Writer() { data_.reserve(256); }

  template <typename T>
  void put(const T& value) {
    static_assert(std::is_trivially_copyable_v<T>);
    const auto* bytes = reinterpret_cast<const std::byte*>(&value);
    data_.insert(data_.end(), bytes, bytes + sizeof(T));
  }
  template <typename T>
  void put_array(std::span<const T> values) {
    static_assert(std::is_trivially_copyable_v<T>);
    put<std::uint64_t>(values.size());
    const auto* bytes = reinterpret_cast<const std::byte*>(values.data());
    data_.insert(data_.end(), bytes, bytes + values.size_bytes());
  }
  void put_string(const std::string& text) {
    put_array(std::span<const char>(text.data(), text.size()));
  }
  std::vector<std::byte>& bytes() { return data_; }

 private:
  std::vector<std::byte> data_;
};

class Reader {
 public:
  explicit Reader(std::span<const std::byte> data) : data_(data) {}
  template <typename T>
  T get() {
    static_assert(std::is_trivially_copyable_v<T>);
    T value;
    take(&value, sizeof(T));
    return value;
  }
  template <typename T>
  std::vector<T> get_array() {
    const auto count = get<std::uint64_t>();
    if (count > (data_.size() - offset_) / (sizeof(T) ? sizeof(T) : 1)) truncated();
    std::vector<T> values(count);
    take(values.data(), count * sizeof(T));
    return values;
  }
  std::string get_string() {
    auto chars = get_array<char>();
    return std::string(chars.begin(), chars.end());
  }

 private:
  void take(void* out, std::size_t bytes) {
    if (bytes > data_.size() - offset_) truncated();
    if (bytes == 0) return;  // an empty array has no storage: memcpy must not see its null
    std::memcpy(out, data_.data() + offset_, bytes);
    offset_ += bytes;
  }
  [[noreturn]] static void truncated() {
    throw_error(ErrorCode::kPeerFailure, "truncated message from a peer");
  }
  std::span<const std::byte> data_;
  std::size_t offset_ = 0;
};

}  // namespace reshard::message
