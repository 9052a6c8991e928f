// The conversion loops behind the transforms, on the host (the reference) or on the GPU. Each
// walks blocks described by BoxViews (rows along the last dimension, not merged).
#pragma once

#include <vector>

#include "execution/box_view.hpp"
#include "execution/staging.hpp"
#include "reshard/layout.hpp"
#include "reshard/types.hpp"

namespace reshard::exec {

struct BlockRef {
  void* data;
  DType dtype;
  BoxView view;
};

// One conversion each: the jobs a ConversionQueue collects.
struct ConvertJob {
  BlockRef src, dst;
};
struct MxJob {
  BlockRef src, data, scale;
  bool round_up;
};
struct BlockFp8Job {
  BlockRef src, data, scale;
  std::int64_t rows_per_matrix;
};

#ifdef RESHARD_WITH_CUDA
namespace cuda {
struct ConversionUploads;
}
#endif

// Conversions and block copies of one refit, run together: host conversions run at once, block
// copies and GPU conversions at flush(), one kernel launch per kind for up to hundreds of ops
// (per-op launches cost more than the work itself for MoE models of tens of thousands of small
// weights; flush_if_full() launches what a large refit has queued so far).
class ConversionQueue {
 public:
  ConversionQueue();
  ~ConversionQueue();
  ConversionQueue(const ConversionQueue&) = delete;
  ConversionQueue& operator=(const ConversionQueue&) = delete;

  // `memory` says where the job's buffers are (kind and device; one device per queue).
  void convert(const ConvertJob& job, const Buffer& memory);
  void mx_quantize(const MxJob& job, const Buffer& memory);
  void block_quantize(const BlockFp8Job& job, const Buffer& memory);
  void pack(const Buffer& tensor, const BoxView& view, std::size_t element_bytes,
            const Buffer& out);
  void unpack(const Buffer& in, const Buffer& tensor, const BoxView& view,
              std::size_t element_bytes);
  // Launches what was queued on `stream` (copies first, then conversions) and empties the queue.
  void flush(void* stream);
  // flush() once enough is queued, so the GPU converts while the host is still queuing the rest
  // (a MoE refit queues tens of thousands of slices, for tens of milliseconds).
  void flush_if_full(void* stream);
  // While on, jobs are dropped instead of run (host) or queued (GPU): the hooks that add them run
  // only to learn their wire buffers, which hold no memory yet (StagingPool sizing).
  void set_dry_run(bool on) { dry_run_ = on; }

 private:
  void on_gpu();  // where GPU jobs are queued: makes their upload buffers

  bool dry_run_ = false;
  std::vector<ConvertJob> converts_;
  std::vector<MxJob> mx_;
  std::vector<BlockFp8Job> blocks_;
  BlockCopyBatch copies_;
#ifdef RESHARD_WITH_CUDA
  cuda::ConversionUploads* uploads_ = nullptr;
#endif
};

// Element-wise dtype conversion between float32, bfloat16 and float16 blocks of equal extents.
void convert_block(const BlockRef& src, const BlockRef& dst, MemoryKind where, void* stream);

// MXFP8: src (float32 or bfloat16) -> E4M3 data and one E8M0 scale per 32 elements of each row.
void mx_quantize(const BlockRef& src, const BlockRef& data, const BlockRef& scale, bool round_up,
                 MemoryKind where, void* stream);

// FP8 with a float32 scale per 128 x 128 tile of each matrix: the views' rows run over
// `matrices` matrices of `rows_per_matrix` rows; scale rows over matrices of ceil(rows / 128).
void block_quantize(const BlockRef& src, std::int64_t rows_per_matrix, const BlockRef& data,
                    const BlockRef& scale, MemoryKind where, void* stream);

#ifdef RESHARD_WITH_CUDA
namespace cuda {
ConversionUploads* create_uploads();
void destroy_uploads(ConversionUploads* uploads);
void convert(const std::vector<ConvertJob>& jobs, ConversionUploads& uploads, void* stream);
void mx_quantize(const std::vector<MxJob>& jobs, ConversionUploads& uploads, void* stream);
void block_quantize(const std::vector<BlockFp8Job>& jobs, ConversionUploads& uploads, void* stream);
}  // namespace cuda
#endif

}  // namespace reshard::exec
