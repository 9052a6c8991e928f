// The conversion loops behind the transforms, on the host (the reference) or on the GPU. Each
// walks blocks described by BoxViews (rows along the last dimension, not merged).
#pragma once

#include "execution/box_view.hpp"
#include "reshard/layout.hpp"
#include "reshard/types.hpp"

namespace reshard::exec {

struct BlockRef {
  void* data;
  DType dtype;
  BoxView view;
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
void convert_block(const BlockRef& src, const BlockRef& dst, void* stream);
void mx_quantize(const BlockRef& src, const BlockRef& data, const BlockRef& scale, bool round_up,
                 void* stream);
void block_quantize(const BlockRef& src, std::int64_t rows_per_matrix, const BlockRef& data,
                    const BlockRef& scale, void* stream);
}  // namespace cuda
#endif

}  // namespace reshard::exec
