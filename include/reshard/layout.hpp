// Layouts: which N-D block of which parameter every PE holds. Two layouts (the trainer's and the
// inference engine's) are all the planner needs to derive every transfer.
#pragma once

#include <array>
#include <cstdint>
#include <string>
#include <unordered_map>
#include <vector>

#include "reshard/types.hpp"

namespace reshard {

enum class DType : std::uint8_t {
  kFloat32,
  kFloat64,
  kBFloat16,
  kFloat16,
  kFloat8E4M3,  // OCP FP8 E4M3 (the "fn" variant: no infinities, max 448)
  kFloat8E8M0,  // OCP MX scale: an 8-bit power-of-two exponent
  kInt8,
  kUInt8,
  kInt32,
  kInt64,
};

std::size_t dtype_size(DType dtype);
const char* dtype_name(DType dtype);
DType parse_dtype(const std::string& name);  // "bf16", "bfloat16", "fp32", "float32", ...

// Tensors of up to this many dimensions; enough for every weight layout in use.
constexpr int kMaxDims = 6;
using Extents = std::array<std::int64_t, kMaxDims>;

// An axis-aligned block of an N-D index space: [offset[d], offset[d] + extent[d]) per dimension.
struct Box {
  int ndim = 0;
  Extents offset{};
  Extents extent{};

  static Box whole(const std::vector<std::int64_t>& shape);
  std::int64_t elements() const;
  bool empty() const { return elements() == 0; }
  bool contains(const Box& other) const;
  std::string str() const;  // "[0:128, 64:96]"
  friend bool operator==(const Box& a, const Box& b);
};

// "[128, 64]", for messages.
std::string shape_str(const std::vector<std::int64_t>& shape);

// The overlap of two boxes of the same rank (empty if they do not meet).
Box intersect(const Box& a, const Box& b);

struct ParamSpec {
  std::string name;
  std::vector<std::int64_t> shape;
  DType dtype = DType::kBFloat16;
  // The block [0, real_shape[d]) of `shape` that holds the model's values where the layout pads
  // the parameter (a vocabulary padded to a multiple of 128 x TP, as Megatron pads it): plans move
  // only that block, and two layouts may pad a parameter differently. Empty: all of `shape`.
  std::vector<std::int64_t> real_shape;

  const std::vector<std::int64_t>& real() const { return real_shape.empty() ? shape : real_shape; }
  std::int64_t elements() const;
  std::size_t bytes() const { return static_cast<std::size_t>(elements()) * dtype_size(dtype); }
};

// One block of a parameter inside a PE's local tensor. Packed partitions (fused QKV, gate/up)
// give a PE several pieces: its slice of Q, of K and of V, one after the other.
struct Piece {
  Box global;          // where the block sits in the full parameter
  Extents local_at{};  // where it sits in the PE's local tensor (same extents)
};

// A PE's local tensor of one parameter: contiguous row-major, `local_shape`, made of pieces.
struct Shard {
  PeId pe = 0;
  std::uint32_t param = 0;  // index into Layout::params()
  std::vector<std::int64_t> local_shape;
  std::vector<Piece> pieces;
  PeId rank = 0;  // former name of `pe`, kept (and filled alike) for one release

  Box local_box(const Piece& piece) const;  // the piece's block in local coordinates
};

class Layout {
 public:
  // Adds a parameter (once); returns its index. A second call with another shape or dtype throws.
  std::uint32_t add_param(const ParamSpec& param);
  // The PE's local tensor of `param` is exactly `block` of the full parameter.
  void add_shard(PeId pe, const std::string& param, const Box& block);
  // The PE's local tensor is made of several blocks; pieces must lie inside both the parameter
  // and the local shape and must not overlap there.
  void add_shard(PeId pe, const std::string& param, std::vector<std::int64_t> local_shape,
                 std::vector<Piece> pieces);

  const std::vector<ParamSpec>& params() const { return params_; }
  const std::vector<Shard>& shards() const { return shards_; }
  const ParamSpec* find_param(const std::string& name) const;
  std::uint32_t param_index(const std::string& name) const;  // throws naming the parameter
  // The PE's shard of `param`, or nullptr where the PE holds none.
  const Shard* find_shard(PeId pe, std::uint32_t param) const;
  // Shards in the order they were added, grouped per parameter.
  const std::vector<std::uint32_t>& shards_of(std::uint32_t param) const {
    return by_param_[param];
  }
  PeId max_pe() const { return max_pe_; }  // -1 when empty
  [[deprecated("max_pe(); max_rank() goes in the next release")]] PeId max_rank() const {
    return max_pe_;
  }

 private:
  std::vector<ParamSpec> params_;
  std::unordered_map<std::string, std::uint32_t> index_;
  std::vector<Shard> shards_;
  std::vector<std::vector<std::uint32_t>> by_param_;
  std::unordered_map<std::uint64_t, std::uint32_t> by_pe_param_;
  PeId max_pe_ = -1;
};

}  // namespace reshard
