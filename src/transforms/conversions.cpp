#include "transforms/conversions.hpp"

#include <type_traits>

#include "reshard/error.hpp"
#include "transforms/element_access.hpp"

namespace reshard::execution {
namespace {

using namespace formats;

void convert_host(const BlockRef& src, const BlockRef& dst) {
  for (std::int64_t row = 0; row < src.view.rows; ++row) {
    const std::int64_t from = src.view.row_start(row);
    const std::int64_t to = dst.view.row_start(row);
    for (std::int64_t col = 0; col < src.view.cols; ++col) {
      store_float(dst.data, dst.dtype, to + col, load_float(src.data, src.dtype, from + col));
    }
  }
}

void mx_quantize_host(const MxJob& job) {
  const BlockRef& src = job.src;
  auto* out = static_cast<std::uint8_t*>(job.data.data);
  auto* scales = static_cast<std::uint8_t*>(job.scale.data);
  const bool round_up = rounds_up(job.rounding);
  const std::uint8_t least = least_scale_bits(job.rounding);
  const SwizzledScales& swizzled = job.swizzled;
  for (std::int64_t row = 0; row < src.view.rows; ++row) {
    const std::int64_t from = src.view.row_start(row);
    const std::int64_t to = job.data.view.row_start(row);
    const std::int64_t scale_at = job.scale.view.row_start(row);
    for (std::int64_t block = 0; block * kMxBlock < src.view.cols; ++block) {
      float amax = 0.0f;
      for (int i = 0; i < kMxBlock; ++i) {
        amax = abs_max(amax, load_float(src.data, src.dtype, from + block * kMxBlock + i));
      }
      const std::uint8_t bits = mx_scale_bits(amax, round_up, least);
      scales[swizzled.col_tiles > 0
                 ? swizzled_scale_offset(swizzled.first_row + row, swizzled.first_col + block,
                                         swizzled.col_tiles)
                 : scale_at + block] = bits;
      for (int i = 0; i < kMxBlock; ++i) {
        const std::int64_t col = block * kMxBlock + i;
        out[to + col] = mx_encode(load_float(src.data, src.dtype, from + col), bits);
      }
    }
  }
}

void swizzle_host(const SwizzleJob& job) {
  for (std::int64_t row = 0; row < job.rows; ++row) {
    for (std::int64_t col = 0; col < job.cols; ++col) {
      job.dst[swizzled_scale_offset(job.at.first_row + row, job.at.first_col + col,
                                    job.at.col_tiles)] = job.src[row * job.cols + col];
    }
  }
}

void block_quantize_host(const BlockRef& src, std::int64_t rows_per_matrix, const BlockRef& data,
                         const BlockRef& scale) {
  auto* out = static_cast<std::uint8_t*>(data.data);
  auto* scales = static_cast<float*>(scale.data);
  const std::int64_t matrices = src.view.rows / rows_per_matrix;
  const std::int64_t tile_rows = (rows_per_matrix + kFp8Block - 1) / kFp8Block;
  const std::int64_t cols = src.view.cols;
  for (std::int64_t m = 0; m < matrices; ++m) {
    for (std::int64_t tr = 0; tr < tile_rows; ++tr) {
      const std::int64_t row_begin = m * rows_per_matrix + tr * kFp8Block;
      const std::int64_t row_end =
          m * rows_per_matrix + std::min<std::int64_t>(rows_per_matrix, (tr + 1) * kFp8Block);
      for (std::int64_t c0 = 0; c0 < cols; c0 += kFp8Block) {
        const std::int64_t c1 = std::min<std::int64_t>(cols, c0 + kFp8Block);
        float amax = 0.0f;
        for (std::int64_t r = row_begin; r < row_end; ++r) {
          const std::int64_t from = src.view.row_start(r);
          for (std::int64_t c = c0; c < c1; ++c) {
            amax = abs_max(amax, load_float(src.data, src.dtype, from + c));
          }
        }
        const float s = block_scale(amax);
        scales[scale.view.row_start(m * tile_rows + tr) + c0 / kFp8Block] = s;
        for (std::int64_t r = row_begin; r < row_end; ++r) {
          const std::int64_t from = src.view.row_start(r);
          const std::int64_t to = data.view.row_start(r);
          for (std::int64_t c = c0; c < c1; ++c) {
            out[to + c] = block_encode(load_float(src.data, src.dtype, from + c), s);
          }
        }
      }
    }
  }
}

#ifndef RESHARD_WITH_CUDA
[[noreturn]] void no_cuda() {
  throw_error(ErrorCode::kUnsupported, "GPU tensors need a build with CUDA");
}
#endif

}  // namespace

#ifdef RESHARD_WITH_CUDA
namespace {

// One job on the GPU now: through a queue of its own, whose memory is freed (after the device is
// done with it) when the call returns.
template <typename Job>
void run_one(const Job& job, void* stream) {
  cuda::ConversionUploads* uploads = cuda::create_uploads();
  try {
    cuda::queue(*uploads, job);
    cuda::launch_queued(*uploads, stream);
  } catch (...) {
    cuda::destroy_uploads(uploads);
    throw;
  }
  cuda::destroy_uploads(uploads);
}

}  // namespace
#endif

void convert_block(const BlockRef& src, const BlockRef& dst, MemoryKind where, void* stream) {
  if (where == MemoryKind::kHost) return convert_host(src, dst);
#ifdef RESHARD_WITH_CUDA
  run_one(ConvertJob{src, dst}, stream);
#else
  (void)stream;
  no_cuda();
#endif
}

void mx_quantize(const MxJob& job, MemoryKind where, void* stream) {
  if (where == MemoryKind::kHost) return mx_quantize_host(job);
#ifdef RESHARD_WITH_CUDA
  run_one(job, stream);
#else
  (void)stream;
  no_cuda();
#endif
}

void block_quantize(const BlockRef& src, std::int64_t rows_per_matrix, const BlockRef& data,
                    const BlockRef& scale, MemoryKind where, void* stream) {
  if (where == MemoryKind::kHost) return block_quantize_host(src, rows_per_matrix, data, scale);
#ifdef RESHARD_WITH_CUDA
  run_one(BlockFp8Job{src, data, scale, rows_per_matrix}, stream);
#else
  (void)stream;
  no_cuda();
#endif
}

ConversionQueue::ConversionQueue() = default;

ConversionQueue::~ConversionQueue() {
#ifdef RESHARD_WITH_CUDA
  if (uploads_ != nullptr) cuda::destroy_uploads(uploads_);
#endif
}

template <typename Job>
void ConversionQueue::queue_on_gpu(const Job& job) {
#ifdef RESHARD_WITH_CUDA
  if (uploads_ == nullptr) uploads_ = cuda::create_uploads();
  cuda::queue(*uploads_, job);
#else
  (void)job;
  no_cuda();
#endif
}

void ConversionQueue::convert(const ConvertJob& job, const Buffer& memory) {
  if (dry_run_) return;
  record(ConversionRecording::Queued<ConvertJob>{job, memory});
  if (memory.kind == MemoryKind::kHost) return convert_host(job.src, job.dst);
  queue_on_gpu(job);
}

void ConversionQueue::mx_quantize(const MxJob& job, const Buffer& memory) {
  if (dry_run_) return;
  record(ConversionRecording::Queued<MxJob>{job, memory});
  if (memory.kind == MemoryKind::kHost) return mx_quantize_host(job);
  queue_on_gpu(job);
}

void ConversionQueue::swizzle_scales(const SwizzleJob& job, const Buffer& memory) {
  if (dry_run_) return;
  record(ConversionRecording::Queued<SwizzleJob>{job, memory});
  if (memory.kind == MemoryKind::kHost) return swizzle_host(job);
  queue_on_gpu(job);
}

void ConversionQueue::block_quantize(const BlockFp8Job& job, const Buffer& memory) {
  if (dry_run_) return;
  record(ConversionRecording::Queued<BlockFp8Job>{job, memory});
  if (memory.kind == MemoryKind::kHost) {
    return block_quantize_host(job.src, job.rows_per_matrix, job.data, job.scale);
  }
  queue_on_gpu(job);
}

void ConversionQueue::pack(const Buffer& tensor, const BoxView& view, std::size_t element_bytes,
                           const Buffer& out) {
  if (dry_run_) return;
  record(ConversionRecording::Pack{tensor, view, element_bytes, out});
  copies_.add_pack(tensor, view, element_bytes, out);
}

void ConversionQueue::unpack(const Buffer& in, const Buffer& tensor, const BoxView& view,
                             std::size_t element_bytes) {
  if (dry_run_) return;
  record(ConversionRecording::Unpack{in, tensor, view, element_bytes});
  copies_.add_unpack(in, tensor, view, element_bytes);
}

void ConversionQueue::flush_if_full(void* stream) {
  constexpr std::size_t kJobsPerLaunch = 512;
  std::size_t queued = copies_.size();
#ifdef RESHARD_WITH_CUDA
  if (uploads_ != nullptr) queued += cuda::queued_jobs(*uploads_);
#endif
  if (queued >= kJobsPerLaunch) {
    flush(stream);
  }
}

void ConversionQueue::flush(void* stream) {
  record(ConversionRecording::Flush{});
  // Packs feed the conversions of the same flush (a sender packing a slice it then converts does
  // not happen today, but the order keeps it right).
  copies_.run(stream);
  copies_.clear();
#ifdef RESHARD_WITH_CUDA
  if (uploads_ != nullptr) cuda::launch_queued(*uploads_, stream);
#else
  (void)stream;
#endif
}

void ConversionRecording::replay(void* stream) const {
  for (const Step& step : calls_) {
    ConversionQueue& queue = *step.queue;
    std::visit(
        [&](const auto& call) {
          using T = std::decay_t<decltype(call)>;
          if constexpr (std::is_same_v<T, Queued<ConvertJob>>) {
            queue.convert(call.job, call.memory);
          } else if constexpr (std::is_same_v<T, Queued<MxJob>>) {
            queue.mx_quantize(call.job, call.memory);
          } else if constexpr (std::is_same_v<T, Queued<BlockFp8Job>>) {
            queue.block_quantize(call.job, call.memory);
          } else if constexpr (std::is_same_v<T, Queued<SwizzleJob>>) {
            queue.swizzle_scales(call.job, call.memory);
          } else if constexpr (std::is_same_v<T, Pack>) {
            queue.pack(call.tensor, call.view, call.element_bytes, call.out);
          } else if constexpr (std::is_same_v<T, Unpack>) {
            queue.unpack(call.in, call.tensor, call.view, call.element_bytes);
          } else {
            queue.flush(stream);
          }
        },
        step.call);
  }
}

}  // namespace reshard::execution
