// The cast transform: the source converted to another float type on the wire (float32, bfloat16,
// float16) by the sender, and to the destination's type on arrival.
#include "transforms/transform_base.hpp"

namespace reshard {
namespace {

using namespace transforms;  // the base every built-in transform shares

class CastTransform final : public TransformBase {
 public:
  explicit CastTransform(DType wire) : TransformBase({}), wire_dtype_(wire) {
    if (!is_float(wire)) {
      throw_error(ErrorCode::kInvalidArgument,
                  std::string("cast transform: wire dtype must be float32, bfloat16 or float16, "
                              "not ") +
                      dtype_name(wire));
    }
  }
  std::string name() const override { return std::string("cast-") + dtype_name(wire_dtype_); }
  std::shared_ptr<ReshardTransform> fresh_copy() const override {
    return std::make_shared<CastTransform>(wire_dtype_);
  }
  bool should_transform(const ParamSpec& param) const override { return is_float(param.dtype); }

  std::vector<WireRange> send_wire(const OpSlice& slice, const LocalTensor& src, void* stream,
                                   bool in_place) override {
    queue_.flush_if_full(stream);
    check_dtype(slice, src.dtype, "source");
    if (src.dtype == wire_dtype_) return {source_slice(slice, src, 0, in_place)};
    Buffer wire = wire_.get(true, slice.op, 0, wire_bytes(slice), src.data);
    queue_.convert(
        {{src.data.data, src.dtype, execution::view_of(slice.local, slice.local_shape, false)},
         {wire.data, wire_dtype_, execution::dense_view(slice.local)}},
        src.data);
    return {WireRange::whole(wire)};
  }
  std::vector<WireRange> recv_wire(const OpSlice& slice, const LocalTensor& dst,
                                   bool in_place) override {
    check_dtype(slice, dst.dtype, "destination");
    if (dst.dtype == wire_dtype_) {
      return {landing(slice, dst.data, 0, execution::view_of(slice.local, slice.local_shape, true),
                      dtype_size(dst.dtype), in_place)};
    }
    return {WireRange::whole(wire_.get(false, slice.op, 0, wire_bytes(slice), dst.data))};
  }
  void finalize_recv(const OpSlice& slice, const LocalTensor& dst, std::span<const Buffer> wire,
                     void* stream) override {
    queue_.flush_if_full(stream);
    if (dst.dtype == wire_dtype_ &&
        (execution::view_of(slice.local, slice.local_shape, true).contiguous() ||
         landed_in_place(wire[0], dst.data))) {
      return;  // it landed in place
    }
    queue_.convert(
        {{wire[0].data, wire_dtype_, execution::dense_view(slice.local)},
         {dst.data.data, dst.dtype, execution::view_of(slice.local, slice.local_shape, false)}},
        dst.data);
  }

  // Where the wire dtype is the source's or the destination's, converting a local op straight
  // from source to destination gives the bits the wire would; a narrower wire in between (fp32
  // -> bf16 -> fp32) rounds, so such ops travel. Same dtypes on both sides are a plain copy,
  // which the transport does.
  bool converts_local_op(const OpSlice& from, const LocalTensor& src, const OpSlice& to,
                         const LocalTensor& dst, bool) override {
    check_dtype(from, src.dtype, "source");
    check_dtype(to, dst.dtype, "destination");
    return src.dtype != dst.dtype && (wire_dtype_ == src.dtype || wire_dtype_ == dst.dtype) &&
           src.data.kind == dst.data.kind && src.data.device == dst.data.device;
  }

  void convert_local(const OpSlice& from, const LocalTensor& src, const OpSlice& to,
                     const LocalTensor& dst, void* stream) override {
    local_queue_.flush_if_full(stream);
    local_queue_.convert(
        {{src.data.data, src.dtype, execution::view_of(from.local, from.local_shape, false)},
         {dst.data.data, dst.dtype, execution::view_of(to.local, to.local_shape, false)}},
        dst.data);
  }

 private:
  std::size_t wire_bytes(const OpSlice& slice) const {
    return static_cast<std::size_t>(slice.local.elements()) * dtype_size(wire_dtype_);
  }
  void check_dtype(const OpSlice& slice, DType dtype, const char* role) const {
    if (!is_float(dtype)) {
      refuse(name(), slice,
             std::string("the ") + role +
                 " tensor must be float32, bfloat16 or "
                 "float16, not " +
                 dtype_name(dtype));
    }
  }
  DType wire_dtype_;
};

}  // namespace

std::shared_ptr<ReshardTransform> make_cast_transform(DType wire) {
  return std::make_shared<CastTransform>(wire);
}

}  // namespace reshard
