// The checksum of verify mode: 64 bits over a byte range, fast on one core (8-byte words mixed by a
// multiply-xorshift, the tail folded in), the same on every PE. It detects corruption, not an
// adversary.
#pragma once

#include <cstddef>
#include <cstdint>
#include <cstring>

namespace reshard {

inline std::uint64_t checksum64(const std::byte* data, std::size_t bytes) {
  constexpr std::uint64_t kMultiplier = 0x9E3779B97F4A7C15ull;
  std::uint64_t lanes[4] = {bytes, 0x243F6A8885A308D3ull, 0x13198A2E03707344ull,
                            0xA4093822299F31D0ull};
  std::size_t i = 0;
  // Four independent lanes keep several multiplies in flight.
  for (; i + 32 <= bytes; i += 32) {
    for (int lane = 0; lane < 4; ++lane) {
      std::uint64_t word;
      std::memcpy(&word, data + i + 8 * lane, 8);
      lanes[lane] = (lanes[lane] ^ word) * kMultiplier;
      lanes[lane] ^= lanes[lane] >> 29;
    }
  }
  std::uint64_t hash = lanes[0] ^ (lanes[1] * 3) ^ (lanes[2] * 5) ^ (lanes[3] * 7);
  for (; i < bytes; ++i) hash = (hash ^ static_cast<std::uint8_t>(data[i])) * kMultiplier;
  hash ^= hash >> 32;
  return hash * kMultiplier ^ (hash >> 29);
}

}  // namespace reshard
