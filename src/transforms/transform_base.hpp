// What every built-in transform shares: its wire buffers (kept per op, so every refit returns the
// same ones and the schedule is reused) and the hooks of the public and the ranged transform that
// do not depend on the number format. Internal to src/transforms.
#pragma once

#include <algorithm>
#include <string>
#include <unordered_map>
#include <unordered_set>
#include <utility>
#include <vector>

#include "execution/staging.hpp"
#include "reshard/error.hpp"
#include "reshard/transform.hpp"
#include "transforms/conversions.hpp"
#include "transforms/wire_ranges.hpp"

namespace reshard::transforms {

using execution::BlockRef;
using execution::BoxView;
using execution::WireRange;

inline bool is_float(DType dtype) {
  return dtype == DType::kFloat32 || dtype == DType::kBFloat16 || dtype == DType::kFloat16;
}

inline std::byte* at_byte(const Buffer& buffer) { return static_cast<std::byte*>(buffer.data); }

[[noreturn]] inline void refuse(const std::string& transform, const OpSlice& slice,
                                const std::string& why) {
  throw_error(ErrorCode::kInvalidArgument, transform + " transform, '" + slice.param.name + "' " +
                                               slice.op.region.str() + " (PE " +
                                               std::to_string(slice.op.src_pe) + " -> PE " +
                                               std::to_string(slice.op.dst_pe) + "): " + why);
}

// Wire buffers, one set per (side, op), the same ones at every refit: the transform's own for the
// public hooks, the executor's pool (bounded by its staging budget) for RangedTransform's.
class WireBuffers {
 public:
  Buffer get(bool sending, const TransferOp& op, int index, std::size_t bytes, const Buffer& like) {
    return pool_->slot({sending, op.task_id, index}, like, bytes);
  }
  // Takes wire buffers from `pool` until the scope ends.
  class Borrow {
   public:
    Borrow(WireBuffers& wire, execution::StagingPool& pool) : wire_(wire) { wire_.pool_ = &pool; }
    ~Borrow() { wire_.pool_ = &wire_.own_; }
    Borrow(const Borrow&) = delete;
    Borrow& operator=(const Borrow&) = delete;

   private:
    WireBuffers& wire_;
  };

 private:
  execution::StagingPool own_;
  execution::StagingPool* pool_ = &own_;
};

class TransformBase : public ReshardTransform, public execution::RangedTransform {
 public:
  explicit TransformBase(std::string filter) : filter_(std::move(filter)) {}

  std::vector<Buffer> prepare_send(const OpSlice& slice, const LocalTensor& src,
                                   void* stream) final {
    return buffers_of(send_wire(slice, src, stream, false));
  }
  std::vector<Buffer> prepare_recv(const OpSlice& slice, const LocalTensor& dst) final {
    return buffers_of(recv_wire(slice, dst, false));
  }
  std::vector<WireRange> send_ranges(const OpSlice& slice, const LocalTensor& src, void* stream,
                                     execution::StagingPool& pool, bool in_place) final {
    const WireBuffers::Borrow borrow(wire_, pool);
    return send_wire(slice, src, stream, in_place);
  }
  std::vector<WireRange> recv_ranges(const OpSlice& slice, const LocalTensor& dst,
                                     execution::StagingPool& pool, bool in_place) final {
    const WireBuffers::Borrow borrow(wire_, pool);
    return recv_wire(slice, dst, in_place);
  }
  bool converts_locally(const OpSlice& from, const LocalTensor& src, const OpSlice& to,
                        const LocalTensor& dst) final {
    return converts_local_op(from, src, to, dst, true);
  }
  void set_dry_run(bool on) final { queue_.set_dry_run(on); }
  void record_conversions(execution::ConversionRecording* into) final {
    queue_.record_into(into);
    local_queue_.record_into(into);
  }
  void set_placement(std::vector<std::uint64_t> gpu_of_rank) final {
    if (gpu_of_rank == gpu_of_rank_) return;  // the executor hands it over at every refit
    gpu_of_rank_ = std::move(gpu_of_rank);
    std::unordered_map<std::uint64_t, int> ranks_on;
    for (std::uint64_t gpu : gpu_of_rank_)
      if (gpu != 0) ++ranks_on[gpu];
    shares_gpu_.assign(gpu_of_rank_.size(), false);
    for (std::size_t r = 0; r < gpu_of_rank_.size(); ++r)
      shares_gpu_[r] = gpu_of_rank_[r] != 0 && ranks_on[gpu_of_rank_[r]] > 1;
  }
  std::string description() const final { return name() + "|" + filter_; }

 protected:
  // The op's wire; with `in_place`, slices that are not contiguous go as strided ranges of the
  // tensor (the executor asks for that where the copy service moves rows in place).
  virtual std::vector<WireRange> send_wire(const OpSlice& slice, const LocalTensor& src,
                                           void* stream, bool in_place) = 0;
  virtual std::vector<WireRange> recv_wire(const OpSlice& slice, const LocalTensor& dst,
                                           bool in_place) = 0;
  static std::vector<Buffer> buffers_of(const std::vector<WireRange>& wire) {
    std::vector<Buffer> buffers;
    for (const WireRange& w : wire) buffers.push_back(w.buffer);
    return buffers;
  }
  // For a slice that is not contiguous: whether the wire buffer finalize_recv is given is the
  // tensor itself, i.e. the slice landed there in place, row by row (recv_wire with in_place).
  // Wire buffers of the transform's own are never the tensor's memory.
  static bool landed_in_place(const Buffer& wire, const Buffer& tensor) {
    return wire.data == tensor.data;
  }
  // Whether PE `rank`'s GPU holds another PE's tensors too (set_placement).
  bool shares_gpu(PeId rank) const {
    return rank >= 0 && static_cast<std::size_t>(rank) < shares_gpu_.size() && shares_gpu_[rank];
  }
  // Whether the op's two PEs hold their tensors on one GPU (set_placement).
  bool same_gpu(const TransferOp& op) const {
    const auto known = [&](PeId rank) {
      return rank >= 0 && static_cast<std::size_t>(rank) < gpu_of_rank_.size();
    };
    return known(op.src_pe) && known(op.dst_pe) && gpu_of_rank_[op.src_pe] != 0 &&
           gpu_of_rank_[op.src_pe] == gpu_of_rank_[op.dst_pe];
  }
  const std::string& filter() const { return filter_; }
  bool name_selected(const ParamSpec& param) const {
    return filter_.empty() || param.name.find(filter_) != std::string::npos;
  }
  // The bytes of a contiguous block of `tensor` (`view`, rows merged), as a buffer of their own.
  static Buffer contiguous_part(const Buffer& tensor, const BoxView& view, std::size_t element) {
    Buffer part = tensor;
    part.data = at_byte(tensor) + view.base * element;
    part.bytes = static_cast<std::size_t>(view.elements()) * element;
    return part;
  }
  // The source slice as a block of its tensor (a view; where the slice is not contiguous, its
  // rows in place, or packed into a wire buffer that carries the region densely).
  WireRange source_slice(const OpSlice& slice, const LocalTensor& src, int index, bool in_place) {
    const BoxView view = execution::view_of(slice.local, slice.local_shape, true);
    const std::size_t element = dtype_size(src.dtype);
    if (view.contiguous()) return WireRange::whole(contiguous_part(src.data, view, element));
    if (in_place) return {src.data, execution::strided_range_of(view, element)};
    const std::size_t bytes = static_cast<std::size_t>(slice.local.elements()) * element;
    Buffer wire = wire_.get(true, slice.op, index, bytes, src.data);
    queue_.pack(src.data, view, element, wire);
    return WireRange::whole(wire);
  }
  // Where a received dense block lands: straight in the destination tensor where the block is
  // contiguous there, or as its rows in place (nothing to unpack at the end either way), in a
  // wire buffer of the transform's otherwise. `view` is the block in the tensor, rows merged.
  WireRange landing(const OpSlice& slice, const Buffer& tensor, int index, const BoxView& view,
                    std::size_t element, bool in_place) {
    if (view.contiguous()) return WireRange::whole(contiguous_part(tensor, view, element));
    if (in_place) return {tensor, execution::strided_range_of(view, element)};
    const auto bytes = static_cast<std::size_t>(view.elements()) * element;
    return WireRange::whole(wire_.get(false, slice.op, index, bytes, tensor));
  }
  void require_scale(const std::string& name, const OpSlice& slice, const LocalTensor& dst,
                     std::size_t scale_bytes) const {
    if (dst.dtype != DType::kFloat8E4M3) {
      refuse(name, slice,
             std::string("the destination tensor must be float8_e4m3fn, not ") +
                 dtype_name(dst.dtype));
    }
    if (dst.scale.data == nullptr || dst.scale.bytes < scale_bytes) {
      refuse(name, slice,
             "the destination needs a scale buffer of " + std::to_string(scale_bytes) +
                 " bytes, got " + std::to_string(dst.scale.bytes));
    }
    if (dst.scale.kind != dst.data.kind) {
      refuse(name, slice, "scale and data buffers must both be on the host or both on the GPU");
    }
  }
  void require_float_source(const std::string& name, const OpSlice& slice,
                            const LocalTensor& src) const {
    if (src.dtype != DType::kBFloat16 && src.dtype != DType::kFloat32) {
      refuse(name, slice,
             std::string("the source must be bfloat16 or float32, not ") + dtype_name(src.dtype));
    }
  }

  void flush(void* stream) override {
    queue_.flush(stream);
    local_queue_.flush(stream);
    converted_.clear();
    sent_ops_.clear();
  }

  // Replicas of a destination ask for the same source slice once each: the first op of a refit
  // converts it, the others send the same wire buffers (the same ones at every refit, since the
  // ops come in plan order).
  struct SliceKey {
    const void* tensor;
    Box local;
    bool operator==(const SliceKey& other) const {
      return tensor == other.tensor && local.ndim == other.local.ndim &&
             std::equal(local.offset.begin(), local.offset.begin() + local.ndim,
                        other.local.offset.begin()) &&
             std::equal(local.extent.begin(), local.extent.begin() + local.ndim,
                        other.local.extent.begin());
    }
  };
  struct SliceKeyHash {
    std::size_t operator()(const SliceKey& key) const {
      auto mixed = reinterpret_cast<std::uintptr_t>(key.tensor);
      for (int d = 0; d < key.local.ndim; ++d) {
        mixed = (mixed ^ static_cast<std::uint64_t>(key.local.offset[d])) * 0x100000001b3ull;
        mixed = (mixed ^ static_cast<std::uint64_t>(key.local.extent[d])) * 0x100000001b3ull;
      }
      return static_cast<std::size_t>(mixed ^ (mixed >> 31));
    }
  };
  static SliceKey slice_key(const LocalTensor& src, const Box& local) {
    return {src.data.data, local};
  }
  // The slice's buffers if this refit converted it already. An op seen twice means a new refit
  // began without a flush (the last one failed half-way): nothing converted then is reused.
  const std::vector<WireRange>* converted(const TransferOp& op, const SliceKey& key) {
    if (!sent_ops_.insert(op.task_id).second) {
      converted_.clear();
      sent_ops_ = {op.task_id};
    }
    auto it = converted_.find(key);
    return it == converted_.end() ? nullptr : &it->second;
  }
  const std::vector<WireRange>& remember(const SliceKey& key, std::vector<WireRange> buffers) {
    return converted_[key] = std::move(buffers);
  }

  WireBuffers wire_;
  // This refit's GPU work, launched by flush() or by the hooks in batches as it grows.
  execution::ConversionQueue queue_;
  // The local ops' conversions (convert_local), which run beside the transfer: their job lists
  // stay the same from refit to refit (uploaded once) and are not replaced under a kernel of the
  // transfer's stream.
  execution::ConversionQueue local_queue_;

 private:
  std::string filter_;
  std::vector<std::uint64_t> gpu_of_rank_;  // set_placement
  std::vector<bool> shares_gpu_;
  // Hashed: a MoE refit converts tens of thousands of slices.
  std::unordered_map<SliceKey, std::vector<WireRange>, SliceKeyHash> converted_;  // until flush()
  std::unordered_set<TaskId> sent_ops_;
};

}  // namespace reshard::transforms
