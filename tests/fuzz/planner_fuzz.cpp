// libFuzzer harness: random small layouts through make_reshard_plan. A refused pair must be refused
// with kInvalidArgument or kValidation; an accepted plan must write every destination element
// exactly once, from a source shard that holds it, with the element it stands for. Anything else
// is a finding.
#include <fuzzer/FuzzedDataProvider.h>

#include <cstdio>
#include <cstdlib>
#include <map>
#include <memory>

#include "reshard/error.hpp"
#include "reshard/plan.hpp"
#include "support/boxes.hpp"

using namespace reshard;
using testing_support::for_each_position;
using testing_support::linear;

namespace {

[[noreturn]] void finding(const std::string& what) {
  std::fprintf(stderr, "planner_fuzz: %s\n", what.c_str());
  std::abort();
}

Box random_block(FuzzedDataProvider& in, const std::vector<std::int64_t>& shape) {
  Box box;
  box.ndim = static_cast<int>(shape.size());
  for (int d = 0; d < box.ndim; ++d) {
    box.offset[d] = in.ConsumeIntegralInRange<std::int64_t>(0, shape[d] - 1);
    box.extent[d] = in.ConsumeIntegralInRange<std::int64_t>(1, shape[d] - box.offset[d]);
  }
  return box;
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const std::uint8_t* data, std::size_t size) {
  FuzzedDataProvider in(data, size);
  std::vector<ParamSpec> params;
  const int param_count = in.ConsumeIntegralInRange(1, 3);
  for (int p = 0; p < param_count; ++p) {
    ParamSpec spec{"p" + std::to_string(p), {}, DType::kBFloat16};
    const int ndim = in.ConsumeIntegralInRange(1, 3);
    for (int d = 0; d < ndim; ++d) spec.shape.push_back(in.ConsumeIntegralInRange(1, 10));
    const DType dtypes[] = {DType::kBFloat16, DType::kFloat32, DType::kUInt8};
    spec.dtype = dtypes[in.ConsumeIntegralInRange(0, 2)];
    params.push_back(spec);
  }
  auto src = std::make_shared<Layout>();
  auto dst = std::make_shared<Layout>();
  const int src_ranks = in.ConsumeIntegralInRange(1, 6);
  const int dst_ranks = in.ConsumeIntegralInRange(1, 6);
  const PeId dst_offset = in.ConsumeBool() ? 0 : src_ranks;  // colocated or disjoint
  try {
    for (const ParamSpec& spec : params) {
      src->add_param(spec);
      dst->add_param(spec);
      for (PeId r = 0; r < src_ranks; ++r) {
        // Often the whole parameter (a replica), else a block; sometimes nothing.
        const int kind = in.ConsumeIntegralInRange(0, 3);
        if (kind == 0) continue;
        src->add_shard(r, spec.name,
                       kind == 1 ? Box::whole(spec.shape) : random_block(in, spec.shape));
      }
      for (PeId r = 0; r < dst_ranks; ++r) {
        if (in.ConsumeIntegralInRange(0, 4) == 0) continue;
        dst->add_shard(dst_offset + r, spec.name, random_block(in, spec.shape));
      }
    }
  } catch (const Error& error) {
    finding(std::string("building valid layouts failed: ") + error.what());
  }
  PlanOptions options;
  options.split_min_bytes = in.ConsumeIntegralInRange<std::uint64_t>(0, 64);
  options.split_row_align = in.ConsumeIntegralInRange<std::int64_t>(1, 4);
  ReshardPlan plan;
  try {
    plan = make_reshard_plan(src, dst, options);
  } catch (const Error& error) {
    if (error.code() != ErrorCode::kInvalidArgument && error.code() != ErrorCode::kValidation)
      finding(std::string("refused with an unexpected code: ") + error.what());
    return 0;
  }
  // Every destination element written exactly once, from a source that holds it.
  std::map<std::tuple<PeId, std::uint32_t, std::int64_t>, int> writes;
  for (const TransferOp& op : plan.ops()) {
    const ParamSpec& spec = plan.params()[op.param];
    const Shard* from = src->find_shard(op.src_pe, op.param);
    const Shard* to = dst->find_shard(op.dst_pe, dst->param_index(spec.name));
    if (from == nullptr || to == nullptr) finding("an op names a rank without a shard");
    if (!from->pieces[0].global.contains(op.region))
      finding("an op reads outside its source shard");
    if (!to->pieces[0].global.contains(op.region)) finding("an op writes outside its destination");
    if (op.bytes != static_cast<std::uint64_t>(op.region.elements()) * dtype_size(spec.dtype))
      finding("an op's bytes do not match its region");
    for_each_position(op.region, [&](const Extents& at) {
      ++writes[{op.dst_pe, op.param, linear(at, spec.shape)}];
    });
  }
  for (const Shard& shard : dst->shards()) {
    const ParamSpec& spec = dst->params()[shard.param];
    const std::uint32_t src_param = src->param_index(spec.name);
    for_each_position(shard.pieces[0].global, [&](const Extents& at) {
      const auto it = writes.find({shard.pe, src_param, linear(at, spec.shape)});
      if (it == writes.end() || it->second != 1) {
        finding("element " + std::to_string(linear(at, spec.shape)) + " of " + spec.name +
                " on rank " + std::to_string(shard.pe) + " written " +
                std::to_string(it == writes.end() ? 0 : it->second) + " times");
      }
    });
  }
  return 0;
}
