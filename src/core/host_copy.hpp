// Copies of host memory that stay at memory speed where memcpy does not. glibc's memcpy moves 2 KiB
// to a few hundred KiB with `rep movsb`, which some virtual machines run at a fraction of the
// memory's speed: 2.9 GB/s against 40 GB/s with vector moves on an AMD EPYC guest (2026-11-25),
// the host transport's slot copies exactly. copy_bytes times both ways once per process and takes
// the faster for those sizes; elsewhere, and for every size on machines where `rep movsb` is fast,
// it is memcpy.
#pragma once

#include <cstddef>

namespace reshard {

// memcpy's contract: `bytes` from `src` to `dst`, the ranges not overlapping.
void copy_bytes(void* dst, const void* src, std::size_t bytes);

// The vector-move copy copy_bytes may choose (exposed for its tests and measurements).
void copy_bytes_by_vectors(void* dst, const void* src, std::size_t bytes);

// Whether copy_bytes takes copy_bytes_by_vectors for mid-sized copies on this machine.
bool copy_bytes_uses_vectors();

}  // namespace reshard
