#include "execution/staging.hpp"

#include <cstdlib>
#include <cstring>
#include <new>
#include <utility>

#include "reshard/error.hpp"

namespace reshard::exec {
namespace {

// Host loop shared by pack and unpack: rows of the source view to rows of the destination view.
void copy_block_host(const std::byte* src, const BoxView& src_view, std::byte* dst,
                     const BoxView& dst_view, std::size_t element_bytes) {
  const std::size_t row_bytes = static_cast<std::size_t>(src_view.cols) * element_bytes;
  for (std::int64_t row = 0; row < src_view.rows; ++row) {
    std::memcpy(dst + dst_view.row_start(row) * element_bytes,
                src + src_view.row_start(row) * element_bytes, row_bytes);
  }
}

// The dense side of a pack or unpack, shaped like the block's rows.
BoxView dense_rows(const BoxView& view) {
  BoxView dense;
  dense.cols = view.cols;
  dense.outer_dims = 1;
  dense.outer_extent[0] = view.rows;
  dense.outer_stride[0] = view.cols;
  dense.rows = view.rows;
  return dense;
}

void copy_block(const Buffer& src, const BoxView& src_view, const Buffer& dst,
                const BoxView& dst_view, std::size_t element_bytes, void* stream) {
  if (src.kind != dst.kind) {
    throw_error(ErrorCode::kInvalidArgument, "staging copy between host and GPU memory: " +
                                                 describe(src) + " -> " + describe(dst));
  }
  const auto* from = static_cast<const std::byte*>(src.data);
  auto* to = static_cast<std::byte*>(dst.data);
  if (src.kind == MemoryKind::kHost) {
    copy_block_host(from, src_view, to, dst_view, element_bytes);
    return;
  }
#ifdef RESHARD_WITH_CUDA
  cuda::copy_block(from, src_view, to, dst_view, element_bytes, stream);
#else
  (void)stream;
  throw_error(ErrorCode::kUnsupported, "GPU tensors need a build with CUDA");
#endif
}

}  // namespace

Staging::Staging(MemoryKind kind, int device, std::size_t bytes) {
  const std::size_t size = bytes == 0 ? 1 : bytes;
  if (kind == MemoryKind::kHost) {
    void* data = std::aligned_alloc(256, (size + 255) / 256 * 256);
    if (data == nullptr) throw std::bad_alloc();
    buffer_ = Buffer::host(data, bytes);
    return;
  }
#ifdef RESHARD_WITH_CUDA
  buffer_ = Buffer::cuda(cuda::allocate(device, size), bytes, device);
#else
  (void)device;
  throw_error(ErrorCode::kUnsupported, "GPU staging needs a build with CUDA");
#endif
}

Staging::~Staging() { release(); }

const Buffer& Staging::fit(const Buffer& like, std::size_t bytes) {
  if (buffer_.data == nullptr || buffer_.bytes != bytes || buffer_.kind != like.kind ||
      buffer_.device != like.device) {
    *this = Staging(like.kind, like.device, bytes);
  }
  return buffer_;
}

Staging::Staging(Staging&& other) noexcept : buffer_(std::exchange(other.buffer_, Buffer{})) {}

Staging& Staging::operator=(Staging&& other) noexcept {
  if (this != &other) {
    release();
    buffer_ = std::exchange(other.buffer_, Buffer{});
  }
  return *this;
}

void Staging::release() {
  if (buffer_.data == nullptr) return;
  if (buffer_.kind == MemoryKind::kHost) {
    std::free(buffer_.data);
  } else {
#ifdef RESHARD_WITH_CUDA
    cuda::release(buffer_.device, buffer_.data);
#endif
  }
  buffer_ = Buffer{};
}

void pack_block(const Buffer& tensor, const BoxView& view, std::size_t element_bytes,
                const Buffer& out, void* stream) {
  copy_block(tensor, view, out, dense_rows(view), element_bytes, stream);
}

void unpack_block(const Buffer& in, const Buffer& tensor, const BoxView& view,
                  std::size_t element_bytes, void* stream) {
  copy_block(in, dense_rows(view), tensor, view, element_bytes, stream);
}

}  // namespace reshard::exec
