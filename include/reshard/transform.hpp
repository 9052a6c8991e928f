// Transforms change what travels on the wire for some parameters: a cast, or FP8 with scales.
// The hooks follow Megatron's ReshardTransform so its users recognise them.
#pragma once

#include <memory>
#include <optional>
#include <span>
#include <string>
#include <vector>

#include "reshard/layout.hpp"
#include "reshard/plan.hpp"
#include "reshard/types.hpp"

namespace reshard {

// A PE's local tensor of one parameter: contiguous, row-major, of the shard's local shape.
struct LocalTensor {
  Buffer data;
  DType dtype =
      DType::kBFloat16;  // of `data` (a transform may make it differ from the parameter's)
  // Scales for block-scaled formats (MXFP8: E8M0, shape [..., K / 32]; 128x128 FP8: float32,
  // shape [..., ceil(M / 128), ceil(K / 128)]); empty otherwise.
  Buffer scale;
  // The shape of `data`, where the caller knows it (the Python binding always does): it must be
  // the layout's local shape, or the refit is refused before any byte moves. Empty: only the
  // byte count is checked (a transposed or reshaped tensor of the same size then goes unnoticed).
  std::vector<std::int64_t> shape;
  // The element type and shape of `scale`, where the caller knows them (the Python binding always
  // does): a transform checks them against the scales it writes (destination_scale) before any
  // byte moves; a one-byte integer type may hold E8M0 scales, and where either shape is 1-D, as
  // many elements in any shape are the same buffer. Unset: only the byte count is checked.
  std::optional<DType> scale_dtype;
  std::vector<std::int64_t> scale_shape;
};

// What one transfer operation moves, seen from this PE.
struct OpSlice {
  const ParamSpec& param;
  const TransferOp& op;
  Box local;  // the block in this PE's local tensor (the op's source or destination box)
  const std::vector<std::int64_t>& local_shape;
};

// The scale tensor a block-scaled format writes beside a destination's FP8 data: allocate it and
// pass it as LocalTensor::scale.
struct ScaleTensor {
  DType dtype = DType::kFloat8E8M0;
  std::vector<std::int64_t> shape;
  std::size_t bytes() const;
};

class ReshardTransform {
 public:
  virtual ~ReshardTransform() = default;
  virtual std::string name() const = 0;
  virtual bool should_transform(const ParamSpec& param) const = 0;
  // Sender: fills and returns the buffers to put on the wire. Return the same buffers at every
  // refit (the transform owns them) and the schedule is reused; new ones make it reschedule.
  virtual std::vector<Buffer> prepare_send(const OpSlice& slice, const LocalTensor& src,
                                           void* stream) = 0;
  // Receiver: the buffers the wire lands in, as many and as large as the sender's.
  virtual std::vector<Buffer> prepare_recv(const OpSlice& slice, const LocalTensor& dst) = 0;
  // Receiver, once the bytes landed: writes the slice of the destination tensor.
  virtual void finalize_recv(const OpSlice& slice, const LocalTensor& dst,
                             std::span<const Buffer> buffers, void* stream) = 0;
  // Called after the prepare_send of every op of a refit, and again after every finalize_recv
  // (both on `stream`): a transform that queued its GPU work op by op launches it here in one go.
  // The default does nothing.
  virtual void flush(void* stream) { (void)stream; }
  // A local op (source and destination both on this PE): true where the transform writes the
  // destination slice straight from the source slice (convert_local), so the op needs no wire
  // buffer, no copy and no place in the schedule. Called once when the refit is prepared, before
  // the schedule: it checks the tensors as prepare_send and prepare_recv would (throwing on bad
  // input). The default, false, sends the op through the copy service like any other.
  virtual bool converts_locally(const OpSlice& from, const LocalTensor& src, const OpSlice& to,
                                const LocalTensor& dst) {
    (void)from, (void)src, (void)to, (void)dst;
    return false;
  }
  // Queues that conversion on `stream` (flush launches it); called at every refit for the ops
  // converts_locally accepted. The executor runs these while the transfer runs (on GPUs the
  // transfer then goes on a high-priority stream of its own): they may touch only the op's slices.
  virtual void convert_local(const OpSlice& from, const LocalTensor& src, const OpSlice& to,
                             const LocalTensor& dst, void* stream);
  // The scale tensor a destination of a transformed parameter needs, given the shape of this
  // PE's local tensor; none for formats without scales (the default). Throws kInvalidArgument
  // for a shape the format cannot take.
  virtual std::optional<ScaleTensor> destination_scale(
      const std::vector<std::int64_t>& local_shape) const {
    (void)local_shape;
    return std::nullopt;
  }
};

// Most wire buffers one op may use (the executor numbers them in the task id's low bits).
constexpr int kMaxWireBuffers = 15;

// Casts on the wire: the sender converts its dtype to `wire`, the receiver `wire` to its tensor's
// dtype (float32, bfloat16, float16). Applies to floating-point parameters.
std::shared_ptr<ReshardTransform> make_cast_transform(DType wire);

enum class MxScaleRounding {
  kOcp,       // floor(log2(amax)) - 8: the OCP MX v1.0 rule; the largest elements may saturate
  kRoundUp,   // the smallest power of two keeping amax / scale <= 448: never saturates (what
              // Transformer Engine writes)
  kMegatron,  // kRoundUp as Megatron-LM's quantizer computes it, amax / 448 in float32: a block
              // that is not all zeros never gets a scale below 2^-126 (kRoundUp gives 2^-127
              // where amax <= 448 * 2^-127); bit for bit what Megatron writes for finite inputs
};

// Where the E8M0 scales of an MXFP8 destination go.
enum class MxScaleLayout {
  kRowMajor,  // [..., K / 32] beside the data
  kSwizzled,  // cuBLAS's blocked layout, read by its MXFP8 GEMMs and kept so by Megatron-LM and
              // Transformer Engine: one byte array of 128 x 4 tiles (512 bytes each) over the
              // [M, K / 32] scale matrix, padded to ceil(M / 128) * 128 rows and ceil(K / 128) * 4
              // columns. For 2-D tensors; padding bytes are left as they are (allocate zeros).
};

enum class QuantizeSide {
  kReceiver,  // BF16 on the wire, converted on arrival
  kSender,    // FP8 data and scales on the wire: about half the bytes
};

// OCP MXFP8: FP8 E4M3 elements, one E8M0 scale per 32 consecutive elements of the last dimension.
// Destination tensors are the caller's FP8 data and E8M0 scale buffers, written in place.
// Applies to parameters of 2 or more dimensions whose name passes `filter` (empty = all).
// Megatron-LM's MXFP8 buffers: MxScaleRounding::kMegatron with MxScaleLayout::kSwizzled.
std::shared_ptr<ReshardTransform> make_mxfp8_transform(
    QuantizeSide side, MxScaleRounding rounding, std::string name_filter = {},
    MxScaleLayout scale_layout = MxScaleLayout::kRowMajor);

// FP8 E4M3 with a float32 scale (amax / 448) per 128x128 block of the last two dimensions, as
// DeepSeek-V3 and Kimi-K2 checkpoints store their weights.
std::shared_ptr<ReshardTransform> make_fp8_block_transform(QuantizeSide side,
                                                           std::string name_filter = {});

// CPU references of the conversions, for callers and tests: `rows` x `cols` row-major inputs.
// `scales` holds rows * cols / 32 bytes row-major, or swizzled_scale_bytes when swizzled.
void reference_mxfp8_quantize(const std::uint16_t* bf16, std::int64_t rows, std::int64_t cols,
                              MxScaleRounding rounding, std::uint8_t* data, std::uint8_t* scales,
                              MxScaleLayout scale_layout = MxScaleLayout::kRowMajor);
void reference_fp8_block_quantize(const std::uint16_t* bf16, std::int64_t rows, std::int64_t cols,
                                  std::uint8_t* data, float* scales);

}  // namespace reshard
