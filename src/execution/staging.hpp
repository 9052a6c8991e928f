// Memory the executor and the transforms own (staging for non-contiguous slices, wire buffers of
// conversions) and the copies between a tensor's block and a dense buffer, on the host or on the
// tensor's GPU.
#pragma once

#include <cstddef>

#include "execution/box_view.hpp"
#include "reshard/types.hpp"

namespace reshard::exec {

// Owned memory of the same kind and device as some tensor; freed on destruction.
class Staging {
 public:
  Staging() = default;
  Staging(MemoryKind kind, int device, std::size_t bytes);
  ~Staging();
  Staging(Staging&& other) noexcept;
  Staging& operator=(Staging&& other) noexcept;
  Staging(const Staging&) = delete;
  Staging& operator=(const Staging&) = delete;

  // Keeps the memory when it already holds `bytes` in the same place as `like` (kind and device),
  // reallocates otherwise: what lets every refit return the same buffers. Returns the buffer.
  const Buffer& fit(const Buffer& like, std::size_t bytes);

  const Buffer& buffer() const { return buffer_; }
  std::byte* data() const { return static_cast<std::byte*>(buffer_.data); }

 private:
  void release();
  Buffer buffer_;
};

// Copies the block `view` of `tensor` into the dense buffer `out` (pack) or back (unpack), with
// `element_bytes` per element. GPU buffers: queued on `stream`.
void pack_block(const Buffer& tensor, const BoxView& view, std::size_t element_bytes,
                const Buffer& out, void* stream);
void unpack_block(const Buffer& in, const Buffer& tensor, const BoxView& view,
                  std::size_t element_bytes, void* stream);

#ifdef RESHARD_WITH_CUDA
namespace cuda {
void* allocate(int device, std::size_t bytes);
void release(int device, void* pointer);
void copy_block(const std::byte* src, const BoxView& src_view, std::byte* dst,
                const BoxView& dst_view, std::size_t element_bytes, void* stream);
void* create_stream(int device);
void destroy_stream(int device, void* stream);
void synchronize_stream(void* stream);
}  // namespace cuda
#endif

}  // namespace reshard::exec
