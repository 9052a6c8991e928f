// The scaled FP8 transforms, MXFP8 (an E8M0 scale per 32 elements) and 128 x 128 block FP8 (a
// float32 scale per tile), each quantized by the sender or on arrival, and the host references
// the GPU kernels are tested against.
#include "transforms/transform_base.hpp"

namespace reshard {
namespace {

using namespace transforms;  // the base every built-in transform shares

// The hooks both scaled-FP8 formats share; a format says how its slices must align, where a
// slice's scales sit and how it quantizes. Sender side: FP8 data (wire buffer 0) and scales (1);
// receiver side: the source dtype on the wire, quantized on arrival.
class ScaledFp8Transform : public TransformBase {
 public:
  ScaledFp8Transform(QuantizeSide side, std::string filter)
      : TransformBase(std::move(filter)), side_(side) {}

  bool should_transform(const ParamSpec& param) const override {
    return param.shape.size() >= 2 &&
           (param.dtype == DType::kBFloat16 || param.dtype == DType::kFloat32) &&
           name_selected(param);
  }

  std::optional<ScaleTensor> destination_scale(
      const std::vector<std::int64_t>& local_shape) const override {
    if (local_shape.size() < 2) {
      throw_error(ErrorCode::kInvalidArgument,
                  name() + ": a scaled FP8 tensor has 2 or more dimensions, not " +
                      std::to_string(local_shape.size()));
    }
    for (std::int64_t extent : local_shape) {
      if (extent < 0) {
        throw_error(ErrorCode::kInvalidArgument, name() + ": negative extent in the shape");
      }
    }
    check_shape(local_shape);
    return ScaleTensor{scale_dtype(), scale_shape(local_shape)};
  }

  std::vector<WireRange> send_wire(const OpSlice& slice, const LocalTensor& src, void* stream,
                                   bool in_place) override {
    queue_.flush_if_full(stream);
    check_source(slice, src);
    if (on_arrival(slice)) return {source_slice(slice, src, 0, in_place)};
    const SliceKey key = slice_key(src, slice.local);
    if (const std::vector<WireRange>* done = converted(slice.op, key)) return *done;
    const Box scales = scale_box(slice.local);
    Buffer data = wire_.get(true, slice.op, 0, elements(slice.local), src.data);
    Buffer scale = wire_.get(true, slice.op, 1, scale_bytes(scales), src.data);
    quantize(queue_,
             {src.data.data, src.dtype, execution::view_of(slice.local, slice.local_shape, false)},
             {data.data, DType::kFloat8E4M3, execution::dense_view(slice.local)},
             {scale.data, scale_dtype(), execution::dense_view(scales)}, slice.local, src.data, {});
    return remember(key, {WireRange::whole(data), WireRange::whole(scale)});
  }

  std::vector<WireRange> recv_wire(const OpSlice& slice, const LocalTensor& dst,
                                   bool in_place) override {
    check_destination(slice, dst);
    const std::size_t n = elements(slice.local);
    if (on_arrival(slice)) {
      return {WireRange::whole(
          wire_.get(false, slice.op, 0, n * dtype_size(slice.param.dtype), dst.data))};
    }
    WireRange data = landing(slice, dst.data, 0,
                             execution::view_of(slice.local, slice.local_shape, true), 1, in_place);
    if (swizzled_scales(slice).col_tiles > 0) {  // scattered over the tiles at the end
      return {data, WireRange::whole(wire_.get(false, slice.op, 1,
                                               scale_bytes(scale_box(slice.local)), dst.scale))};
    }
    return {data,
            landing(slice, dst.scale, 1, scale_view(slice), dtype_size(scale_dtype()), in_place)};
  }

  void finalize_recv(const OpSlice& slice, const LocalTensor& dst, std::span<const Buffer> wire,
                     void* stream) override {
    queue_.flush_if_full(stream);
    if (on_arrival(slice)) {
      quantize_into(queue_, {wire[0].data, slice.param.dtype, execution::dense_view(slice.local)},
                    slice, dst);
      return;
    }
    // Blocks contiguous in the destination landed there (prepare_recv).
    const BoxView data_view = execution::view_of(slice.local, slice.local_shape, true);
    if (!data_view.contiguous() && !landed_in_place(wire[0], dst.data))
      queue_.unpack(wire[0], dst.data, data_view, 1);
    if (const execution::SwizzledScales at = swizzled_scales(slice); at.col_tiles > 0) {
      const Box scales = scale_box(slice.local);
      queue_.swizzle_scales(
          {static_cast<const std::uint8_t*>(wire[1].data),
           static_cast<std::uint8_t*>(dst.scale.data), scales.extent[0], scales.extent[1], at},
          dst.scale);
      return;
    }
    const BoxView scale_at = scale_view(slice);
    if (!scale_at.contiguous() && !landed_in_place(wire[1], dst.scale))
      queue_.unpack(wire[1], dst.scale, scale_at, dtype_size(scale_dtype()));
  }

  // A local op quantizes its source slice where it lies, straight into the destination, while
  // the transfer runs: one pass over the slice (read 2 bytes, write 1 per bf16 element) where the
  // wire costs a conversion and a copy (FP8 into a wire buffer, then into the destination), or a
  // bf16 copy and a conversion on arrival. Except where the sender quantizes a slice that other
  // ops send too (replicas; by the sender-side variant, or by a PE whose GPU other PEs share,
  // set_placement): there one conversion serves them all, and converting the local op again
  // would cost more than the FP8 copy it saves (Llama-3-8B TP2 -> 2 replicas, 2 PEs on one H100:
  // 15.3-17.0 ms against 13.8 ms through the wire; with MPS 13.9 against 11.7).
  bool converts_local_op(const OpSlice& from, const LocalTensor& src, const OpSlice& to,
                         const LocalTensor& dst, bool source_also_sent) override {
    const bool sender_quantizes = side_ == QuantizeSide::kSender || shares_gpu(from.op.src_pe);
    if (source_also_sent && sender_quantizes) return false;
    if (src.data.kind != dst.data.kind || src.data.device != dst.data.device) return false;
    check_source(from, src);
    check_destination(to, dst);
    return true;
  }

  void convert_local(const OpSlice& from, const LocalTensor& src, const OpSlice& to,
                     const LocalTensor& dst, void* stream) override {
    local_queue_.flush_if_full(stream);
    quantize_into(
        local_queue_,
        {src.data.data, src.dtype, execution::view_of(from.local, from.local_shape, false)}, to,
        dst);
  }

 protected:
  const char* side_name() const { return side_ == QuantizeSide::kSender ? "sender" : "receiver"; }
  // Whether this op's slice is quantized on arrival: the side asked for, except between two PEs
  // on one GPU, where the sender quantizes (see RangedTransform::set_placement). Sources are
  // checked by the side asked for, so the same input is refused or accepted everywhere.
  bool on_arrival(const OpSlice& slice) const {
    return side_ == QuantizeSide::kReceiver && !same_gpu(slice.op);
  }

 private:
  // Refuses (naming the region) a slice that would cut the format's blocks.
  virtual void check_alignment(const OpSlice& slice) const = 0;
  // Refuses a local tensor shape the format cannot scale.
  virtual void check_shape(const std::vector<std::int64_t>& shape) const { (void)shape; }
  virtual DType scale_dtype() const = 0;
  // The scales of `box` (a block of a tensor), as a block of that tensor's scale tensor.
  virtual Box scale_box(const Box& box) const = 0;
  virtual std::vector<std::int64_t> scale_shape(const std::vector<std::int64_t>& shape) const = 0;
  // Where a destination keeps the slice's scales in cuBLAS's swizzled layout; col_tiles 0 where
  // it keeps them as scale_shape says.
  virtual execution::SwizzledScales swizzled_scales(const OpSlice& slice) const {
    (void)slice;
    return {};
  }
  // Queues the conversion on `queue`; `block` is the slice in local coordinates, for formats
  // whose blocks span rows, `memory` says where the buffers are, and `swizzled` where the scales
  // go if not where `scale` says.
  virtual void quantize(execution::ConversionQueue& queue, const execution::BlockRef& src,
                        const execution::BlockRef& data, const execution::BlockRef& scale,
                        const Box& block, const Buffer& memory,
                        const execution::SwizzledScales& swizzled) = 0;

  // Queues the quantization of `src` (the slice's elements) into the slice of `dst` and its
  // scales.
  void quantize_into(execution::ConversionQueue& queue, const execution::BlockRef& src,
                     const OpSlice& slice, const LocalTensor& dst) {
    const Box scales = scale_box(slice.local);
    const execution::SwizzledScales swizzled = swizzled_scales(slice);
    quantize(queue, src,
             {dst.data.data, DType::kFloat8E4M3,
              execution::view_of(slice.local, slice.local_shape, false)},
             {dst.scale.data, scale_dtype(),
              swizzled.col_tiles > 0
                  ? execution::dense_view(scales)  // unused
                  : execution::view_of(scales, scale_shape(slice.local_shape), false)},
             slice.local, dst.data, swizzled);
  }
  // What prepare_send checks of a source slice (and converts_locally of a local op's).
  void check_source(const OpSlice& slice, const LocalTensor& src) const {
    check_alignment(slice);
    require_float_source(name(), slice, src);
    // Quantized on arrival, the wire carries the parameter's dtype: the source must hold it.
    if (side_ == QuantizeSide::kReceiver && src.dtype != slice.param.dtype) {
      refuse(name(), slice,
             std::string("quantized on arrival, the wire carries the parameter's dtype (") +
                 dtype_name(slice.param.dtype) + "), but the source tensor is " +
                 dtype_name(src.dtype));
    }
  }
  // What prepare_recv checks of a destination slice (and converts_locally of a local op's).
  void check_destination(const OpSlice& slice, const LocalTensor& dst) const {
    check_alignment(slice);
    const ScaleTensor wanted = *destination_scale(slice.local_shape);
    require_scale(name(), slice, dst, wanted.bytes());
    // A scale tensor of another type but enough bytes (float32 where MXFP8 writes E8M0 bytes)
    // would take the scales' bytes in the wrong places: refused, naming both.
    const auto allocate = std::string("; allocate them as the transform's destination_scale(") +
                          shape_str(slice.local_shape) + ") says: " + dtype_name(wanted.dtype) +
                          " " + shape_str(wanted.shape);
    if (dst.scale_dtype && *dst.scale_dtype != wanted.dtype &&
        !(dtype_size(wanted.dtype) == 1 &&
          (*dst.scale_dtype == DType::kUInt8 || *dst.scale_dtype == DType::kInt8))) {
      refuse(name(), slice,
             std::string("the destination's scale tensor is ") + dtype_name(*dst.scale_dtype) +
                 ", but this transform writes " + dtype_name(wanted.dtype) + " scales" + allocate);
    }
    if (!dst.scale_shape.empty() && dst.scale_shape != wanted.shape) {
      std::int64_t given = 1, needed = 1;
      for (std::int64_t extent : dst.scale_shape) given *= extent;
      for (std::int64_t extent : wanted.shape) needed *= extent;
      // A flat buffer of as many scales (either side 1-D) is the same memory; a 2-D one of another
      // shape would hold them in the wrong places.
      const bool flat = dst.scale_shape.size() == 1 || wanted.shape.size() == 1;
      if (!flat || given != needed) {
        refuse(name(), slice,
               "the destination's scale tensor has shape " + shape_str(dst.scale_shape) +
                   ", but this transform writes scales of shape " + shape_str(wanted.shape) +
                   allocate);
      }
    }
  }

  static std::size_t elements(const Box& box) { return static_cast<std::size_t>(box.elements()); }
  // The slice's scales in the destination's scale tensor, rows merged.
  BoxView scale_view(const OpSlice& slice) const {
    return execution::view_of(scale_box(slice.local), scale_shape(slice.local_shape), true);
  }
  std::size_t scale_bytes(const Box& scales) const {
    return elements(scales) * dtype_size(scale_dtype());
  }

 protected:
  QuantizeSide side_;
};

// OCP MXFP8: one E8M0 scale per 32 consecutive elements of the last dimension.
class Mxfp8Transform final : public ScaledFp8Transform {
 public:
  Mxfp8Transform(QuantizeSide side, MxScaleRounding rounding, std::string filter,
                 MxScaleLayout layout)
      : ScaledFp8Transform(side, std::move(filter)), rounding_(rounding), layout_(layout) {}

  std::string name() const override {
    static constexpr const char* kRounding[] = {"", "-roundup", "-megatron"};
    return std::string("mxfp8-") + side_name() + kRounding[static_cast<int>(rounding_)] +
           (layout_ == MxScaleLayout::kSwizzled ? "-swizzled" : "");
  }
  std::shared_ptr<ReshardTransform> fresh_copy() const override {
    return std::make_shared<Mxfp8Transform>(side_, rounding_, filter(), layout_);
  }

 private:
  DType scale_dtype() const override { return DType::kFloat8E8M0; }
  Box scale_box(const Box& box) const override {
    Box scales = box;
    const int last = box.ndim - 1;
    scales.offset[last] /= formats::kMxBlock;
    scales.extent[last] /= formats::kMxBlock;
    return scales;
  }
  std::vector<std::int64_t> scale_shape(const std::vector<std::int64_t>& shape) const override {
    std::vector<std::int64_t> scales = shape;
    scales.back() /= formats::kMxBlock;
    if (layout_ == MxScaleLayout::kSwizzled) {
      return {formats::swizzled_scale_bytes(scales[0], scales[1])};
    }
    return scales;
  }
  execution::SwizzledScales swizzled_scales(const OpSlice& slice) const override {
    if (layout_ != MxScaleLayout::kSwizzled) return {};
    const std::int64_t scale_cols = slice.local_shape[1] / formats::kMxBlock;
    return {slice.local.offset[0], slice.local.offset[1] / formats::kMxBlock, (scale_cols + 3) / 4};
  }
  void quantize(execution::ConversionQueue& queue, const execution::BlockRef& src,
                const execution::BlockRef& data, const execution::BlockRef& scale, const Box&,
                const Buffer& memory, const execution::SwizzledScales& swizzled) override {
    queue.mx_quantize({src, data, scale, rounding_, swizzled}, memory);
  }
  void check_shape(const std::vector<std::int64_t>& shape) const override {
    if (layout_ == MxScaleLayout::kSwizzled && shape.size() != 2) {
      throw_error(ErrorCode::kInvalidArgument,
                  name() + ": swizzled scales are laid out for 2-D tensors, not " +
                      std::to_string(shape.size()) + "-D (use row-major scales)");
    }
    if (shape.back() % formats::kMxBlock != 0) {
      throw_error(ErrorCode::kInvalidArgument, name() + ": the last dimension (" +
                                                   std::to_string(shape.back()) +
                                                   ") must be a multiple of 32, the MX block");
    }
  }
  void check_alignment(const OpSlice& slice) const override {
    const int last = slice.op.region.ndim - 1;
    const auto& region = slice.op.region;
    if (region.offset[last] % formats::kMxBlock != 0 ||
        region.extent[last] % formats::kMxBlock != 0 ||
        slice.local.offset[last] % formats::kMxBlock != 0 ||
        slice.local_shape.back() % formats::kMxBlock != 0) {
      refuse(name(), slice,
             "the last dimension of every slice must start and end on multiples of 32 (MX "
             "blocks), here " +
                 std::to_string(region.offset[last]) + ".." +
                 std::to_string(region.offset[last] + region.extent[last]) + " in the parameter, " +
                 std::to_string(slice.local.offset[last]) + ".. of a local dimension of " +
                 std::to_string(slice.local_shape.back()));
    }
  }

  MxScaleRounding rounding_;
  MxScaleLayout layout_;
};

// FP8 with a float32 scale (amax / 448) per 128 x 128 tile of the last two dimensions.
class Fp8BlockTransform final : public ScaledFp8Transform {
 public:
  Fp8BlockTransform(QuantizeSide side, std::string filter)
      : ScaledFp8Transform(side, std::move(filter)) {}

  std::string name() const override { return std::string("fp8-block-") + side_name(); }
  std::shared_ptr<ReshardTransform> fresh_copy() const override {
    return std::make_shared<Fp8BlockTransform>(side_, filter());
  }

 private:
  static constexpr std::int64_t kTile = formats::kFp8Block;
  static std::int64_t tiles_of(std::int64_t n) { return (n + kTile - 1) / kTile; }

  DType scale_dtype() const override { return DType::kFloat32; }
  // The tiles a block covers, in a tensor of tiles (its last two dimensions divided by 128).
  Box scale_box(const Box& box) const override {
    Box tiles = box;
    for (int d = box.ndim - 2; d < box.ndim; ++d) {
      tiles.offset[d] = box.offset[d] / kTile;
      tiles.extent[d] = tiles_of(box.extent[d]);
    }
    return tiles;
  }
  std::vector<std::int64_t> scale_shape(const std::vector<std::int64_t>& shape) const override {
    std::vector<std::int64_t> tiles = shape;
    for (std::size_t d = shape.size() - 2; d < shape.size(); ++d) tiles[d] = tiles_of(shape[d]);
    return tiles;
  }
  void quantize(execution::ConversionQueue& queue, const execution::BlockRef& src,
                const execution::BlockRef& data, const execution::BlockRef& scale, const Box& block,
                const Buffer& memory, const execution::SwizzledScales&) override {
    queue.block_quantize({src, data, scale, block.extent[block.ndim - 2]}, memory);
  }
  // Tiles must stay whole: slices start on a tile boundary and end on one or at the dimension's
  // end, in the parameter and in the local tensor alike.
  void check_alignment(const OpSlice& slice) const override {
    const Box& region = slice.op.region;
    for (int d = region.ndim - 2; d < region.ndim; ++d) {
      const std::int64_t end = region.offset[d] + region.extent[d];
      const std::int64_t local_end = slice.local.offset[d] + slice.local.extent[d];
      const bool whole = region.offset[d] % kTile == 0 &&
                         (end % kTile == 0 || end == slice.param.shape[d]) &&
                         slice.local.offset[d] % kTile == 0 &&
                         (local_end % kTile == 0 || local_end == slice.local_shape[d]);
      if (!whole) {
        refuse(name(), slice,
               "dimension " + std::to_string(d) + " of the slice cuts 128 x 128 tiles (parameter " +
                   std::to_string(region.offset[d]) + ".." + std::to_string(end) + ", local " +
                   std::to_string(slice.local.offset[d]) + ".." + std::to_string(local_end) +
                   " of " + std::to_string(slice.local_shape[d]) +
                   "); the transform's name filter can leave such a parameter unquantized (e.g. "
                   "only names containing \"layers.\", as checkpoints keep embeddings in bf16)");
      }
    }
  }
};

}  // namespace

std::shared_ptr<ReshardTransform> make_mxfp8_transform(QuantizeSide side, MxScaleRounding rounding,
                                                       std::string name_filter,
                                                       MxScaleLayout scale_layout) {
  return std::make_shared<Mxfp8Transform>(side, rounding, std::move(name_filter), scale_layout);
}

std::shared_ptr<ReshardTransform> make_fp8_block_transform(QuantizeSide side,
                                                           std::string name_filter) {
  return std::make_shared<Fp8BlockTransform>(side, std::move(name_filter));
}

void reference_mxfp8_quantize(const std::uint16_t* bf16, std::int64_t rows, std::int64_t cols,
                              MxScaleRounding rounding, std::uint8_t* data, std::uint8_t* scales,
                              MxScaleLayout scale_layout) {
  if (cols % formats::kMxBlock != 0) {
    throw_error(ErrorCode::kInvalidArgument,
                "MXFP8 rows need a multiple of 32 elements, got " + std::to_string(cols));
  }
  const Box box = Box::whole({rows, cols});
  const std::int64_t scale_cols = cols / formats::kMxBlock;
  const Box scale_box = Box::whole({rows, scale_cols});
  execution::SwizzledScales swizzled{};
  if (scale_layout == MxScaleLayout::kSwizzled) swizzled.col_tiles = (scale_cols + 3) / 4;
  execution::mx_quantize(
      {{const_cast<std::uint16_t*>(bf16), DType::kBFloat16, execution::dense_view(box)},
       {data, DType::kFloat8E4M3, execution::dense_view(box)},
       {scales, DType::kFloat8E8M0, execution::dense_view(scale_box)},
       rounding,
       swizzled},
      MemoryKind::kHost, nullptr);
}

void reference_fp8_block_quantize(const std::uint16_t* bf16, std::int64_t rows, std::int64_t cols,
                                  std::uint8_t* data, float* scales) {
  const Box box = Box::whole({rows, cols});
  const Box tiles = Box::whole({(rows + 127) / 128, (cols + 127) / 128});
  execution::block_quantize(
      {const_cast<std::uint16_t*>(bf16), DType::kBFloat16, execution::dense_view(box)}, rows,
      {data, DType::kFloat8E4M3, execution::dense_view(box)},
      {scales, DType::kFloat32, execution::dense_view(tiles)}, MemoryKind::kHost, nullptr);
}

}  // namespace reshard
