// The GPU conversions' jobs, queued as their kernels' tasks and launched together at a flush (the
// kernels are in transforms/gpu/; the arithmetic is number_formats.hpp, shared with the host
// reference, so results match it bit for bit).
#include "transforms/gpu/conversion_kernels.cuh"

namespace reshard::execution::cuda {

// GPU jobs become their kernels' tasks as they are queued, while their views are still in the
// cache: a refit queues thousands, and building the lists at launch time, from jobs kept whole
// (464 bytes an MXFP8 job), took more host time than the GPU took to convert 512 small matrices.
struct ConversionUploads {
  JobUpload convert, mx, block, swizzle;
  TaskList<CastTask> casts[kFloatTypes][kFloatTypes];  // [source][destination]
  TaskList<MxTask> mx_tasks[kFloatTypes];
  TaskList<BlockTask> block_tasks[kFloatTypes];
  TaskList<SwizzleTask> swizzle_tasks;
  std::size_t jobs = 0;  // queued since the last launch
};

ConversionUploads* create_uploads() { return new ConversionUploads(); }
void destroy_uploads(ConversionUploads* uploads) { delete uploads; }
std::size_t queued_jobs(const ConversionUploads& uploads) { return uploads.jobs; }

void queue(ConversionUploads& uploads, const ConvertJob& job) {
  const int from = float_index(job.src.dtype), to = float_index(job.dst.dtype);
  if (from < 0) refuse_dtype("cast", job.src.dtype);
  if (to < 0) refuse_dtype("cast to", job.dst.dtype);
  TaskList<CastTask>& list = uploads.casts[from][to];
  split_rows(job.src.view.rows, job.src.view.cols, kPerLane, list.last,
             [&](const VectorSpan& span) {
               CastTask& task = list.tasks.emplace_back();
               task.src = job.src.data;
               task.dst = job.dst.data;
               task.src_rows = RowWalk::of(job.src.view, list.uneven);
               task.dst_rows = RowWalk::of(job.dst.view, list.uneven);
               task.span = span;
               task.cols = job.src.view.cols;
               const auto dense = [&](const RowWalk& rows) {
                 return rows.view < 0 && rows.stride == task.cols;
               };
               task.warp_stores =
                   to == kFloatIndex<DType::kFloat32> && from != to && task.src_rows.view < 0 &&
                   task.dst_rows.view < 0 &&
                   ((dense(task.src_rows) && dense(task.dst_rows)) || task.cols >= 32 * kPerLane);
             });
  ++uploads.jobs;
}

namespace {

// MxTask::even.
bool is_even(const MxTask& task, std::size_t element_bytes) {
  const auto fits = [](const RowWalk& rows, std::size_t bytes) {
    return rows.view < 0 && rows.stride >= 0 &&
           static_cast<std::uint64_t>(rows.stride) * bytes < (std::uint64_t{1} << 32);
  };
  if (!fits(task.src_rows, element_bytes) || !fits(task.data_rows, 1)) return false;
  if (task.col_tiles == 0) return fits(task.scale_rows, 1);
  // Swizzled: the span's scale rows and block columns inside the layout's col_tiles * 4 columns,
  // and the last tile's end at most 2^32 bytes in.
  const std::uint32_t vectors_per_row = task.span.per_row.divisor;
  const std::int64_t rows =
      (std::int64_t{task.span.vectors} + vectors_per_row - 1) / vectors_per_row;
  const std::int64_t first_row = task.scale_rows.base + task.span.first_row;
  const std::int64_t blocks = std::int64_t{vectors_per_row} * kMxPerLane / kMxBlock;
  if (first_row < 0 || task.first_col < 0 ||
      task.first_col + blocks > 4 * std::int64_t{task.col_tiles})
    return false;
  const std::uint64_t tile_rows = static_cast<std::uint64_t>(first_row + rows + 127) / 128;
  return tile_rows * task.col_tiles * 512 <= (std::uint64_t{1} << 32);
}

// MxTask::banded (of an even task). Skinny spans (one band of rows, or rows of fewer than 256
// columns) keep the row walk: there it was the faster on one H200, 2026-11-27 (65536 x 128 and
// 128 x 65536: 0.83-0.84 of the copy rate against 0.78-0.80 in bands).
bool is_banded(const MxTask& task) {
  const std::uint32_t per_row = task.span.per_row.divisor;
  const std::int64_t first_row = task.scale_rows.base + task.span.first_row;
  return task.col_tiles > 0 && per_row % 8 == 0 && per_row >= 16 &&
         task.span.vectors % (std::uint64_t{128} * per_row) == 0 &&
         task.span.vectors / per_row >= 256 && first_row % 128 == 0 && task.first_col % 4 == 0 &&
         reinterpret_cast<std::uintptr_t>(task.scale) % 4 == 0;
}

}  // namespace

void queue(ConversionUploads& uploads, const MxJob& job) {
  const int from = float_index(job.src.dtype);
  if (from < 0) refuse_dtype("MXFP8 conversion", job.src.dtype);
  TaskList<MxTask>& list = uploads.mx_tasks[from];
  split_rows(job.src.view.rows, job.src.view.cols, kMxPerLane, list.last,
             [&](const VectorSpan& span) {
               MxTask& task = list.tasks.emplace_back();
               task.src = job.src.data;
               task.data = static_cast<std::uint8_t*>(job.data.data);
               task.scale = static_cast<std::uint8_t*>(job.scale.data);
               task.src_rows = RowWalk::of(job.src.view, list.uneven);
               task.data_rows = RowWalk::of(job.data.view, list.uneven);
               if (job.swizzled.col_tiles > 0) {
                 task.scale_rows = RowWalk{job.swizzled.first_row, 1, -1};
                 task.first_col = job.swizzled.first_col;
                 task.col_tiles = static_cast<std::uint32_t>(job.swizzled.col_tiles);
               } else {
                 task.scale_rows = RowWalk::of(job.scale.view, list.uneven);
               }
               task.span = span;
               task.round_up = rounds_up(job.rounding);
               task.least_bits = least_scale_bits(job.rounding);
               task.even = is_even(task, dtype_size(job.src.dtype));
               task.banded = task.even && is_banded(task);
             });
  ++uploads.jobs;
}

void queue(ConversionUploads& uploads, const SwizzleJob& job) {
  TaskList<SwizzleTask>& list = uploads.swizzle_tasks;
  split_rows(job.rows, job.cols, 1, list.last, [&](const VectorSpan& span) {
    list.tasks.push_back(
        {job.src, job.dst, span, job.at.first_row, job.at.first_col, job.at.col_tiles});
  });
  ++uploads.jobs;
}

void queue(ConversionUploads& uploads, const BlockFp8Job& job) {
  const int from = float_index(job.src.dtype);
  if (from < 0) refuse_dtype("block-FP8 conversion", job.src.dtype);
  if (job.src.view.cols == 0 || job.src.view.rows == 0) return;
  const std::int64_t tile_rows = (job.rows_per_matrix + kFp8Block - 1) / kFp8Block;
  const std::int64_t tile_cols = (job.src.view.cols + kFp8Block - 1) / kFp8Block;
  const std::int64_t tiles = job.src.view.rows / job.rows_per_matrix * tile_rows * tile_cols;
  if (tiles >= (std::int64_t{1} << 32)) {
    throw_error(ErrorCode::kUnsupported, "a block-FP8 conversion of " + std::to_string(tiles) +
                                             " tiles (at most 2^32 - 1 in one block)");
  }
  TaskList<BlockTask>& list = uploads.block_tasks[from];
  BlockTask& task = list.tasks.emplace_back();
  task.src = job.src.data;
  task.data = static_cast<std::uint8_t*>(job.data.data);
  task.scale = static_cast<float*>(job.scale.data);
  task.src_rows = RowWalk::of(job.src.view, list.uneven);
  task.data_rows = RowWalk::of(job.data.view, list.uneven);
  task.scale_rows = RowWalk::of(job.scale.view, list.uneven);
  task.cols = job.src.view.cols;
  task.src_stride = job.src.view.row_stride();
  task.data_stride = job.data.view.row_stride();
  task.rows_per_matrix = job.rows_per_matrix;
  task.tiles_per_matrix = FastDivisor::of(static_cast<std::uint32_t>(tile_rows * tile_cols));
  task.tile_cols = divisor_of(static_cast<std::uint32_t>(tile_cols), list.last);
  task.tiles = static_cast<std::uint32_t>(tiles);
  ++uploads.jobs;
}

namespace {

void clear_queued(ConversionUploads& uploads) {
  for (auto& to : uploads.casts) {
    for (TaskList<CastTask>& list : to) list.tasks.clear(), list.uneven.clear();
  }
  for (TaskList<MxTask>& list : uploads.mx_tasks) list.tasks.clear(), list.uneven.clear();
  for (TaskList<BlockTask>& list : uploads.block_tasks) list.tasks.clear(), list.uneven.clear();
  uploads.swizzle_tasks.tasks.clear();
  uploads.jobs = 0;
}

}  // namespace

void load_conversion_kernels() {
  load_cast_kernels();
  load_mx_kernels();
  load_block_kernels();
}

void launch_queued(ConversionUploads& uploads, void* stream) {
  // One launch per kind and pair of dtypes: casts, MXFP8, block FP8, then the scale swizzles.
  // What a failed launch leaves queued is dropped with it, not launched again by the next flush.
  struct ClearOnExit {
    ConversionUploads& uploads;
    ~ClearOnExit() { clear_queued(uploads); }
  } clear_on_exit{uploads};
  const auto s = static_cast<cudaStream_t>(stream);
  launch_cast_lists(uploads.casts, uploads.convert, s);
  launch_mx_lists(uploads.mx_tasks, uploads.mx, s);
  launch_block_lists(uploads.block_tasks, uploads.block, s);
  launch_swizzles(uploads.swizzle_tasks, uploads.swizzle, s);
}

}  // namespace reshard::execution::cuda
