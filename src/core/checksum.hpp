// The checksum of verify mode: 64 bits over a byte range, fast on one core (8-byte words mixed by a
// multiply-xorshift, the tail folded in), the same on every PE. It detects corruption, not an
// adversary. It can be fed in pieces (GPU memory arrives in host-sized chunks) and gives the same
// value as one call over the whole range.
#pragma once

#include <cstddef>
#include <cstdint>
#include <cstring>

namespace reshard {

class Checksum64 {
 public:
  // `total`: the bytes that will be fed, all told (the value depends on it).
  explicit Checksum64(std::size_t total)
      : lanes_{total, 0x243F6A8885A308D3ull, 0x13198A2E03707344ull, 0xA4093822299F31D0ull} {}

  void update(const std::byte* data, std::size_t bytes) {
    std::size_t i = 0;
    if (pending_ > 0) {  // complete a 32-byte block begun by an earlier piece
      const std::size_t take = bytes < 32 - pending_ ? bytes : 32 - pending_;
      std::memcpy(block_ + pending_, data, take);
      pending_ += take;
      i = take;
      if (pending_ < 32) return;
      mix_block(block_);
      pending_ = 0;
    }
    // Four independent lanes keep several multiplies in flight.
    for (; i + 32 <= bytes; i += 32) mix_block(data + i);
    std::memcpy(block_, data + i, bytes - i);
    pending_ = bytes - i;
  }

  std::uint64_t digest() const {
    std::uint64_t hash = lanes_[0] ^ (lanes_[1] * 3) ^ (lanes_[2] * 5) ^ (lanes_[3] * 7);
    for (std::size_t i = 0; i < pending_; ++i)
      hash = (hash ^ static_cast<std::uint8_t>(block_[i])) * kMultiplier;
    hash ^= hash >> 32;
    return hash * kMultiplier ^ (hash >> 29);
  }

 private:
  static constexpr std::uint64_t kMultiplier = 0x9E3779B97F4A7C15ull;

  void mix_block(const std::byte* block) {
    for (int lane = 0; lane < 4; ++lane) {
      std::uint64_t word;
      std::memcpy(&word, block + 8 * lane, 8);
      lanes_[lane] = (lanes_[lane] ^ word) * kMultiplier;
      lanes_[lane] ^= lanes_[lane] >> 29;
    }
  }

  std::uint64_t lanes_[4];
  std::byte block_[32] = {};
  std::size_t pending_ = 0;
};

inline std::uint64_t checksum64(const std::byte* data, std::size_t bytes) {
  Checksum64 sum(bytes);
  sum.update(data, bytes);
  return sum.digest();
}

}  // namespace reshard
