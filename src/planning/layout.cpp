#include "reshard/layout.hpp"

#include <algorithm>
#include <sstream>

#include "reshard/error.hpp"

namespace reshard {
namespace {

struct DTypeInfo {
  DType dtype;
  std::size_t size;
  const char* name;
  const char* aliases[3];
};

constexpr DTypeInfo kDTypes[] = {
    {DType::kFloat32, 4, "float32", {"fp32", "f32", "float"}},
    {DType::kFloat64, 8, "float64", {"fp64", "f64", "double"}},
    {DType::kBFloat16, 2, "bfloat16", {"bf16", nullptr, nullptr}},
    {DType::kFloat16, 2, "float16", {"fp16", "f16", "half"}},
    {DType::kFloat8E4M3, 1, "float8_e4m3fn", {"fp8", "e4m3", "float8_e4m3"}},
    {DType::kFloat8E8M0, 1, "float8_e8m0fnu", {"e8m0", nullptr, nullptr}},
    {DType::kInt8, 1, "int8", {"i8", nullptr, nullptr}},
    {DType::kUInt8, 1, "uint8", {"u8", "byte", nullptr}},
    {DType::kInt32, 4, "int32", {"i32", "int", nullptr}},
    {DType::kInt64, 8, "int64", {"i64", "long", nullptr}},
};

const DTypeInfo& info(DType dtype) {
  for (const DTypeInfo& entry : kDTypes) {
    if (entry.dtype == dtype) return entry;
  }
  throw_error(ErrorCode::kInvalidArgument,
              "unknown dtype code " + std::to_string(static_cast<int>(dtype)));
}

std::uint64_t pe_param_key(PeId pe, std::uint32_t param) {
  return (static_cast<std::uint64_t>(static_cast<std::uint32_t>(pe)) << 32) | param;
}

}  // namespace

std::string shape_str(const std::vector<std::int64_t>& shape) {
  std::ostringstream text;
  text << "[";
  for (std::size_t d = 0; d < shape.size(); ++d) text << (d ? ", " : "") << shape[d];
  text << "]";
  return text.str();
}

std::size_t dtype_size(DType dtype) { return info(dtype).size; }
const char* dtype_name(DType dtype) { return info(dtype).name; }

DType parse_dtype(const std::string& name) {
  for (const DTypeInfo& entry : kDTypes) {
    if (name == entry.name) return entry.dtype;
    for (const char* alias : entry.aliases) {
      if (alias != nullptr && name == alias) return entry.dtype;
    }
  }
  throw_error(ErrorCode::kInvalidArgument, "unknown dtype '" + name +
                                               "' (try bf16, fp16, fp32, fp64, fp8, e8m0, int8, "
                                               "uint8, int32, int64)");
}

Box Box::whole(const std::vector<std::int64_t>& shape) {
  if (shape.size() > static_cast<std::size_t>(kMaxDims)) {
    throw_error(ErrorCode::kInvalidArgument, "tensors of " + std::to_string(shape.size()) +
                                                 " dimensions are not supported (at most " +
                                                 std::to_string(kMaxDims) + ")");
  }
  Box box;
  box.ndim = static_cast<int>(shape.size());
  for (int d = 0; d < box.ndim; ++d) box.extent[d] = shape[d];
  return box;
}

std::int64_t Box::elements() const {
  std::int64_t n = 1;
  for (int d = 0; d < ndim; ++d) n *= extent[d];
  return n;
}

bool Box::contains(const Box& other) const {
  if (other.ndim != ndim) return false;
  for (int d = 0; d < ndim; ++d) {
    if (other.offset[d] < offset[d] || other.offset[d] + other.extent[d] > offset[d] + extent[d]) {
      return false;
    }
  }
  return true;
}

std::string Box::str() const {
  std::ostringstream text;
  text << "[";
  for (int d = 0; d < ndim; ++d) {
    text << (d ? ", " : "") << offset[d] << ":" << offset[d] + extent[d];
  }
  text << "]";
  return text.str();
}

bool operator==(const Box& a, const Box& b) {
  if (a.ndim != b.ndim) return false;
  for (int d = 0; d < a.ndim; ++d) {
    if (a.offset[d] != b.offset[d] || a.extent[d] != b.extent[d]) return false;
  }
  return true;
}

Box intersect(const Box& a, const Box& b) {
  Box out;
  out.ndim = a.ndim;
  for (int d = 0; d < a.ndim; ++d) {
    const std::int64_t lo = std::max(a.offset[d], b.offset[d]);
    const std::int64_t hi = std::min(a.offset[d] + a.extent[d], b.offset[d] + b.extent[d]);
    out.offset[d] = lo;
    out.extent[d] = std::max<std::int64_t>(0, hi - lo);
  }
  return out;
}

std::int64_t ParamSpec::elements() const {
  std::int64_t n = 1;
  for (std::int64_t dim : shape) n *= dim;
  return n;
}

Box Shard::local_box(const Piece& piece) const {
  Box box = piece.global;
  box.offset = piece.local_at;
  return box;
}

std::uint32_t Layout::add_param(const ParamSpec& param) {
  if (param.name.empty()) throw_error(ErrorCode::kInvalidArgument, "a parameter needs a name");
  for (std::int64_t dim : param.shape) {
    if (dim < 0) {
      throw_error(
          ErrorCode::kInvalidArgument,
          "parameter '" + param.name + "' has a negative dimension in " + shape_str(param.shape));
    }
  }
  Box::whole(param.shape);  // checks the rank
  if (!param.real_shape.empty()) {
    bool inside = param.real_shape.size() == param.shape.size();
    for (std::size_t d = 0; inside && d < param.shape.size(); ++d)
      inside = param.real_shape[d] >= 0 && param.real_shape[d] <= param.shape[d];
    if (!inside) {
      throw_error(ErrorCode::kInvalidArgument,
                  "parameter '" + param.name + "': its real shape " + shape_str(param.real_shape) +
                      " must lie inside its padded shape " + shape_str(param.shape) +
                      ", dimension by dimension");
    }
  }
  if (auto it = index_.find(param.name); it != index_.end()) {
    const ParamSpec& known = params_[it->second];
    if (known.shape != param.shape || known.dtype != param.dtype || known.real() != param.real()) {
      throw_error(ErrorCode::kInvalidArgument,
                  "parameter '" + param.name + "' added twice: " + shape_str(known.shape) + " " +
                      dtype_name(known.dtype) + " and " + shape_str(param.shape) + " " +
                      dtype_name(param.dtype));
    }
    return it->second;
  }
  const auto index = static_cast<std::uint32_t>(params_.size());
  params_.push_back(param);
  index_.emplace(param.name, index);
  by_param_.emplace_back();
  return index;
}

const ParamSpec* Layout::find_param(const std::string& name) const {
  auto it = index_.find(name);
  return it == index_.end() ? nullptr : &params_[it->second];
}

std::uint32_t Layout::param_index(const std::string& name) const {
  auto it = index_.find(name);
  if (it == index_.end()) {
    throw_error(ErrorCode::kInvalidArgument, "the layout has no parameter '" + name + "'");
  }
  return it->second;
}

const Shard* Layout::find_shard(PeId pe, std::uint32_t param) const {
  auto it = by_pe_param_.find(pe_param_key(pe, param));
  return it == by_pe_param_.end() ? nullptr : &shards_[it->second];
}

void Layout::add_shard(PeId pe, const std::string& param, const Box& block) {
  const ParamSpec& spec = params_[param_index(param)];
  std::vector<std::int64_t> local_shape(block.extent.begin(), block.extent.begin() + block.ndim);
  if (block.ndim != static_cast<int>(spec.shape.size())) {
    throw_error(ErrorCode::kInvalidArgument, "block " + block.str() + " of parameter '" + param +
                                                 "' has " + std::to_string(block.ndim) +
                                                 " dimensions, the parameter " +
                                                 std::to_string(spec.shape.size()));
  }
  add_shard(pe, param, std::move(local_shape), {Piece{block, {}}});
}

void Layout::add_shard(PeId pe, const std::string& param, std::vector<std::int64_t> local_shape,
                       std::vector<Piece> pieces) {
  const std::uint32_t index = param_index(param);
  const ParamSpec& spec = params_[index];
  auto where = [&] { return "PE " + std::to_string(pe) + "'s shard of '" + param + "'"; };
  if (pe < 0) throw_error(ErrorCode::kInvalidArgument, where() + ": negative PE");
  if (by_pe_param_.count(pe_param_key(pe, index)) != 0) {
    throw_error(ErrorCode::kInvalidArgument,
                where() + " was added twice (one local tensor per PE and parameter)");
  }
  if (local_shape.size() != spec.shape.size()) {
    throw_error(ErrorCode::kInvalidArgument, where() + ": local shape " + shape_str(local_shape) +
                                                 " does not have the parameter's " +
                                                 std::to_string(spec.shape.size()) + " dimensions");
  }
  const Box param_box = Box::whole(spec.shape);
  const Box local_whole = Box::whole(local_shape);
  Shard shard{pe, index, std::move(local_shape), {}, pe};
  for (const Piece& piece : pieces) {
    if (piece.global.ndim != param_box.ndim || !param_box.contains(piece.global)) {
      throw_error(ErrorCode::kInvalidArgument, where() + ": block " + piece.global.str() +
                                                   " lies outside the parameter " +
                                                   shape_str(spec.shape));
    }
    if (!local_whole.contains(shard.local_box(piece))) {
      throw_error(ErrorCode::kInvalidArgument, where() + ": block " + piece.global.str() +
                                                   " placed at " + shard.local_box(piece).str() +
                                                   " lies outside the local shape " +
                                                   shape_str(shard.local_shape));
    }
    for (const Piece& earlier : shard.pieces) {
      if (!intersect(shard.local_box(earlier), shard.local_box(piece)).empty()) {
        throw_error(ErrorCode::kInvalidArgument, where() + ": pieces " + earlier.global.str() +
                                                     " and " + piece.global.str() +
                                                     " overlap in the local tensor");
      }
      if (!intersect(earlier.global, piece.global).empty()) {
        throw_error(ErrorCode::kInvalidArgument, where() + ": pieces " + earlier.global.str() +
                                                     " and " + piece.global.str() +
                                                     " hold the same elements twice");
      }
    }
    if (!piece.global.empty()) shard.pieces.push_back(piece);
  }
  by_pe_param_.emplace(pe_param_key(pe, index), static_cast<std::uint32_t>(shards_.size()));
  by_param_[index].push_back(static_cast<std::uint32_t>(shards_.size()));
  shards_.push_back(std::move(shard));
  max_pe_ = std::max(max_pe_, pe);
}

}  // namespace reshard
