// The conversion loops behind the transforms, on the host (the reference) or on the GPU. Each
// walks blocks described by BoxViews (rows along the last dimension, not merged).
#pragma once

#include <variant>
#include <vector>

#include "execution/box_view.hpp"
#include "execution/staging.hpp"
#include "reshard/layout.hpp"
#include "reshard/transform.hpp"
#include "reshard/types.hpp"

namespace reshard::execution {

struct BlockRef {
  void* data;
  DType dtype;
  BoxView view;
};

// One conversion each: the jobs a ConversionQueue collects.
struct ConvertJob {
  BlockRef src, dst;
};
// Scales in cuBLAS's swizzled layout (formats::swizzled_scale_offset), where col_tiles > 0: the
// scale of a job's row r and block b lies at swizzled_scale_offset(first_row + r, first_col + b,
// col_tiles) of the scale BlockRef's data, whose view is then unused.
struct SwizzledScales {
  std::int64_t first_row = 0, first_col = 0, col_tiles = 0;
};
struct MxJob {
  BlockRef src, data, scale;
  MxScaleRounding rounding = MxScaleRounding::kOcp;
  SwizzledScales swizzled{};
};
// Scales of a block, dense [rows, cols] at `src`, into their places of a swizzled scale matrix.
struct SwizzleJob {
  const std::uint8_t* src;
  std::uint8_t* dst;
  std::int64_t rows, cols;
  SwizzledScales at;
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

class ConversionQueue;

// The calls a refit made on ConversionQueues, kept to be made again (replay) while the tensors
// and wire buffers stay the same: the transform hooks that made them then need not run. A MoE
// refit's hooks cost about 1.5 us per slice on the host (views, checks, wire lookups); replaying
// their queue calls costs a copy of each job.
class ConversionRecording {
 public:
  void clear() { calls_.clear(); }
  bool empty() const { return calls_.empty(); }
  // Makes the calls again, in order, flushing on `stream` where the recorded refit flushed.
  void replay(void* stream) const;

 private:
  friend class ConversionQueue;
  struct Pack {
    Buffer tensor;
    BoxView view;
    std::size_t element_bytes;
    Buffer out;
  };
  struct Unpack {
    Buffer in, tensor;
    BoxView view;
    std::size_t element_bytes;
  };
  struct Flush {};  // flush(), or flush_if_full() where it launched
  template <typename Job>
  struct Queued {
    Job job;
    Buffer memory;
  };
  using Call = std::variant<Queued<ConvertJob>, Queued<MxJob>, Queued<BlockFp8Job>,
                            Queued<SwizzleJob>, Pack, Unpack, Flush>;
  struct Step {
    ConversionQueue* queue;
    Call call;
  };
  std::vector<Step> calls_;
};

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
  void swizzle_scales(const SwizzleJob& job, const Buffer& memory);
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
  // While set, every call that queues, runs or flushes work is also appended to `into`.
  void record_into(ConversionRecording* into) { recording_ = into; }

 private:
  template <typename Job>
  void queue_on_gpu(const Job& job);  // makes the upload buffers on first use
  template <typename Call>
  void record(Call&& call) {
    if (recording_ != nullptr) recording_->calls_.push_back({this, std::forward<Call>(call)});
  }

  bool dry_run_ = false;
  ConversionRecording* recording_ = nullptr;
  BlockCopyBatch copies_;
#ifdef RESHARD_WITH_CUDA
  cuda::ConversionUploads* uploads_ = nullptr;
#endif
};

// Element-wise dtype conversion between float32, bfloat16 and float16 blocks of equal extents.
void convert_block(const BlockRef& src, const BlockRef& dst, MemoryKind where, void* stream);

// MXFP8: src (float32, bfloat16 or float16) -> E4M3 data and one E8M0 scale per 32 elements of
// each row.
void mx_quantize(const MxJob& job, MemoryKind where, void* stream);
// A rounding rule as formats::mx_scale_bits takes it.
inline bool rounds_up(MxScaleRounding rounding) { return rounding != MxScaleRounding::kOcp; }
inline std::uint8_t least_scale_bits(MxScaleRounding rounding) {
  return rounding == MxScaleRounding::kMegatron ? formats::kMegatronLeastScaleBits : 0;
}

// FP8 with a float32 scale per 128 x 128 tile of each matrix: the views' rows run over
// `matrices` matrices of `rows_per_matrix` rows; scale rows over matrices of ceil(rows / 128).
void block_quantize(const BlockRef& src, std::int64_t rows_per_matrix, const BlockRef& data,
                    const BlockRef& scale, MemoryKind where, void* stream);

#ifdef RESHARD_WITH_CUDA
namespace cuda {
ConversionUploads* create_uploads();
void destroy_uploads(ConversionUploads* uploads);
// Jobs become their kernels' tasks when queued (a job the kernels cannot take is refused there,
// before anything runs); launch_queued launches them all on `stream`, casts first, then MXFP8,
// block FP8 and scale swizzles, and empties the queue (also where a launch fails).
void queue(ConversionUploads& uploads, const ConvertJob& job);
void queue(ConversionUploads& uploads, const MxJob& job);
void queue(ConversionUploads& uploads, const BlockFp8Job& job);
void queue(ConversionUploads& uploads, const SwizzleJob& job);
std::size_t queued_jobs(const ConversionUploads& uploads);
void launch_queued(ConversionUploads& uploads, void* stream);
// Loads every conversion kernel launch_queued may launch on the current device now (see
// reshard::cuda::load_copy_kernels: a first launch behind a peer's stuck wait would not return).
void load_conversion_kernels();
}  // namespace cuda
#endif

}  // namespace reshard::execution
