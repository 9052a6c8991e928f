// The planner on its own: coverage, conservation, determinism, balancing and refusals, checked by
// simulating every op element by element on fake tensors that hold each element's global index.
#include <gtest/gtest.h>

#include <algorithm>
#include <map>
#include <random>
#include <set>
#include <tuple>

#include "reshard/error.hpp"
#include "reshard/model_layouts.hpp"
#include "reshard/plan.hpp"
#include "support/boxes.hpp"

namespace reshard {
namespace {

using testing_support::for_each_position;
using testing_support::linear;

// Executes the plan element by element: every destination element must be written exactly once
// with the global index it stands for. Returns the number of problems (and reports the first).
std::size_t simulate(const ReshardPlan& plan) {
  const Layout& src = plan.src_layout();
  const Layout& dst = plan.dst_layout();
  // (rank, param) -> local tensor of global indices (source) or of written values (destination)
  std::map<std::pair<PeId, std::uint32_t>, std::vector<std::int64_t>> src_tensors, dst_values,
      dst_writes;
  for (const Shard& shard : src.shards()) {
    std::vector<std::int64_t> tensor(Box::whole(shard.local_shape).elements(), -1);
    const auto& shape = src.params()[shard.param].shape;
    for (const Piece& piece : shard.pieces) {
      for_each_position(piece.global, [&](const Extents& g) {
        Extents local = g;
        for (int d = 0; d < piece.global.ndim; ++d) {
          local[d] = g[d] - piece.global.offset[d] + piece.local_at[d];
        }
        tensor[linear(local, shard.local_shape)] = linear(g, shape);
      });
    }
    src_tensors[{shard.pe, shard.param}] = std::move(tensor);
  }
  for (const Shard& shard : dst.shards()) {
    const auto n = Box::whole(shard.local_shape).elements();
    dst_values[{shard.pe, shard.param}].assign(n, -1);
    dst_writes[{shard.pe, shard.param}].assign(n, 0);
  }
  std::size_t problems = 0;
  for (const TransferOp& op : plan.ops()) {
    const ParamSpec& param = src.params()[op.param];
    const std::uint32_t dst_param = dst.param_index(param.name);
    const Shard* from = src.find_shard(op.src_pe, op.param);
    const Shard* to = dst.find_shard(op.dst_pe, dst_param);
    if (from == nullptr || to == nullptr) {
      ADD_FAILURE() << "op for '" << param.name << "' names a rank without a shard";
      return 1;
    }
    EXPECT_EQ(op.bytes, op.region.elements() * dtype_size(param.dtype));
    EXPECT_EQ(op.task_id & ((1u << kSubTaskBits) - 1), 0u);
    auto& source = src_tensors[{op.src_pe, op.param}];
    auto& values = dst_values[{op.dst_pe, dst_param}];
    auto& writes = dst_writes[{op.dst_pe, dst_param}];
    for_each_position(op.region, [&](const Extents& g) {
      Extents s = g, t = g;
      for (int d = 0; d < op.region.ndim; ++d) {
        s[d] = g[d] - op.region.offset[d] + op.src_at[d];
        t[d] = g[d] - op.region.offset[d] + op.dst_at[d];
      }
      const std::int64_t value = source[linear(s, from->local_shape)];
      if (value != linear(g, param.shape) && problems++ == 0) {
        ADD_FAILURE() << "'" << param.name << "' op " << op.region.str() << " reads a source "
                      << "element holding " << value;
      }
      values[linear(t, to->local_shape)] = value;
      writes[linear(t, to->local_shape)] += 1;
    });
  }
  for (const Shard& shard : dst.shards()) {
    const auto& shape = dst.params()[shard.param].shape;
    const auto& values = dst_values[{shard.pe, shard.param}];
    const auto& writes = dst_writes[{shard.pe, shard.param}];
    for (const Piece& piece : shard.pieces) {
      for_each_position(shard.local_box(piece), [&](const Extents& l) {
        Extents g = l;
        for (int d = 0; d < piece.global.ndim; ++d) {
          g[d] = l[d] - piece.local_at[d] + piece.global.offset[d];
        }
        const std::int64_t i = linear(l, shard.local_shape);
        if ((writes[i] != 1 || values[i] != linear(g, shape)) && problems++ == 0) {
          ADD_FAILURE() << "rank " << shard.pe << " '" << dst.params()[shard.param].name
                        << "' element " << Box{piece.global.ndim, g, {}}.str() << " written "
                        << writes[i] << " times, holds " << values[i];
        }
      });
    }
  }
  return problems;
}

std::uint64_t destination_bytes(const Layout& dst) {
  std::uint64_t bytes = 0;
  for (const Shard& shard : dst.shards()) {
    for (const Piece& piece : shard.pieces) {
      bytes += piece.global.elements() * dtype_size(dst.params()[shard.param].dtype);
    }
  }
  return bytes;
}

void expect_valid(const ReshardPlan& plan) {
  EXPECT_EQ(simulate(plan), 0u);
  std::uint64_t bytes = 0;
  for (const TransferOp& op : plan.ops()) bytes += op.bytes;
  EXPECT_EQ(bytes, destination_bytes(plan.dst_layout())) << "bytes are not conserved";
  EXPECT_EQ(plan.stats().total_bytes, bytes);
  // A remote op for a region the destination rank already holds in the source layout would waste
  // the link: the planner must prefer the local copy.
  for (const TransferOp& op : plan.ops()) {
    if (op.local()) continue;
    const Shard* own = plan.src_layout().find_shard(op.dst_pe, op.param);
    if (own == nullptr) continue;
    for (const Piece& piece : own->pieces) {
      EXPECT_FALSE(piece.global.contains(op.region))
          << "rank " << op.dst_pe << " receives " << op.region.str() << " of '"
          << plan.params()[op.param].name << "' from rank " << op.src_pe << " but holds it itself";
    }
  }
}

using OpKey = std::tuple<std::string, PeId, PeId, std::string, TaskId>;
std::set<OpKey> op_keys(const ReshardPlan& plan) {
  std::set<OpKey> keys;
  for (const TransferOp& op : plan.ops()) {
    keys.insert({plan.params()[op.param].name, op.src_pe, op.dst_pe, op.region.str(), op.task_id});
  }
  return keys;
}

TEST(Planner, MegatronTensorParallelTransitionMatrix) {
  const ModelSpec model = toy_model(2, 64);
  for (int src_tp : {1, 2, 4, 8}) {
    for (int dst_tp : {1, 2, 4, 8}) {
      for (bool colocated : {true, false}) {
        SCOPED_TRACE("tp" + std::to_string(src_tp) + " -> tp" + std::to_string(dst_tp) +
                     (colocated ? " colocated" : " disjoint"));
        const Layout src = build_layout(model, {.tp = src_tp});
        const Layout dst = build_layout(model, {.tp = dst_tp, .first_pe = colocated ? 0 : src_tp});
        const ReshardPlan plan = make_reshard_plan(src, dst);
        expect_valid(plan);
        if (colocated && src_tp == dst_tp) {
          EXPECT_EQ(plan.stats().local_bytes, plan.stats().total_bytes);
          EXPECT_EQ(plan.stats().lower_bound_bytes, 0u);
        }
      }
    }
  }
}

TEST(Planner, PipelineExpertAndReplicaChanges) {
  const ModelSpec moe = toy_model(4, 64, 8);
  const std::vector<std::pair<Parallelism, Parallelism>> cases = {
      {{.tp = 2, .pp = 2}, {.tp = 4}},
      {{.tp = 1, .pp = 4}, {.tp = 2, .pp = 2}},
      {{.tp = 2, .dp = 2, .pp = 2, .ep = 4}, {.tp = 4, .ep = 4}},
      {{.tp = 2, .dp = 4, .ep = 8}, {.tp = 8, .replicas = 2, .ep = 2, .etp = 4}},
      {{.tp = 4, .dp = 2, .ep = 2, .etp = 2}, {.tp = 2, .replicas = 2, .ep = 1, .etp = 2}},
      {{.tp = 2, .dp = 2, .pp = 2, .ep = 2}, {.tp = 4, .replicas = 2, .ep = 4, .first_pe = 8}},
  };
  for (const auto& [from, to] : cases) {
    SCOPED_TRACE(from.str() + " -> " + to.str());
    const ReshardPlan plan = make_reshard_plan(build_layout(moe, from), build_layout(moe, to));
    expect_valid(plan);
  }
}

TEST(Planner, PackedPartitionsKeepTheirPiecesTogether) {
  // TP 2 -> TP 1 colocated: rank 0 already holds the first half of Q, K and V of the fused QKV
  // weight, so exactly the other halves arrive from rank 1, as three merged-where-possible ops.
  const ModelSpec model = toy_model(1, 64);
  const ReshardPlan plan =
      make_reshard_plan(build_layout(model, {.tp = 2}), build_layout(model, {.tp = 1}));
  expect_valid(plan);
  const std::uint32_t qkv = plan.src_layout().param_index("layers.0.self_attn.qkv_proj.weight");
  int remote = 0;
  for (const TransferOp& op : plan.ops()) {
    if (op.param == qkv && !op.local()) ++remote;
  }
  EXPECT_EQ(remote, 3);
}

TEST(Planner, ReplicasShareTheSendingEvenly) {
  // Four data-parallel replicas of a TP-1 trainer feed a disjoint TP-1 engine with five weights:
  // whole weights per replica would leave one replica sending two fifths; splitting them lets
  // each send about a quarter.
  ModelSpec model{"five", 1, 0, {}};
  for (int i = 0; i < 5; ++i) {
    model.params.push_back({{"w" + std::to_string(i), {1024, 256}, DType::kBFloat16}});
  }
  const PlanOptions options{.split_min_bytes = 64 << 10, .split_row_align = 128};
  const ReshardPlan plan = make_reshard_plan(build_layout(model, {.dp = 4}),
                                             build_layout(model, {.first_pe = 4}), options);
  expect_valid(plan);
  const std::uint64_t total = plan.stats().total_bytes;
  EXPECT_LE(plan.stats().max_egress_bytes, total / 4 + total / 20) << plan.summary();
  EXPECT_EQ(plan.stats().lower_bound_bytes, total);  // the one receiver takes everything
  // Without splitting, the largest-first rule still never puts two weights on one replica while
  // another sends nothing.
  const ReshardPlan whole = make_reshard_plan(
      build_layout(model, {.dp = 4}), build_layout(model, {.first_pe = 4}), {.split_min_bytes = 0});
  EXPECT_EQ(whole.stats().max_egress_bytes, 2 * total / 5);
  for (PeId rank = 0; rank < 4; ++rank) EXPECT_GT(whole.egress()[rank], 0u);
}

TEST(Planner, LocalCopiesWinOverRemoteReplicas) {
  ModelSpec model = toy_model(1, 64);
  // Every rank of an 8-way DP trainer holds everything; an engine on the same ranks needs no link.
  const ReshardPlan plan =
      make_reshard_plan(build_layout(model, {.dp = 8}), build_layout(model, {.tp = 8}));
  expect_valid(plan);
  EXPECT_EQ(plan.stats().local_bytes, plan.stats().total_bytes);
}

// Random N-D layouts: each source is 1-3 replicated grid tilings on random ranks, the destination
// a finer or coarser grid; a rank holding several tiles keeps them at their global positions.
struct RandomLayouts {
  Layout src, dst;
};

std::vector<std::vector<std::int64_t>> random_cuts(std::mt19937& rng,
                                                   const std::vector<std::int64_t>& shape) {
  std::vector<std::vector<std::int64_t>> cuts;
  for (std::int64_t dim : shape) {
    std::set<std::int64_t> points{0, dim};
    const int extra = std::uniform_int_distribution<int>(0, 3)(rng);
    for (int i = 0; i < extra && dim > 1; ++i) {
      points.insert(std::uniform_int_distribution<std::int64_t>(1, dim - 1)(rng));
    }
    cuts.emplace_back(points.begin(), points.end());
  }
  return cuts;
}

void add_tiling(std::mt19937& rng, Layout& layout, const ParamSpec& param, int ranks,
                std::map<PeId, std::vector<Piece>>& held) {
  const auto cuts = random_cuts(rng, param.shape);
  Extents index{};
  const int n = static_cast<int>(param.shape.size());
  while (true) {
    Piece piece{Box::whole(param.shape), {}};
    for (int d = 0; d < n; ++d) {
      piece.global.offset[d] = cuts[d][index[d]];
      piece.global.extent[d] = cuts[d][index[d] + 1] - cuts[d][index[d]];
    }
    piece.local_at = piece.global.offset;
    // A rank may hold a tile only once (replicas live on different ranks).
    for (int tries = 0; tries < 16; ++tries) {
      const PeId rank = std::uniform_int_distribution<int>(0, ranks - 1)(rng);
      auto& pieces = held[rank];
      const bool clash = std::any_of(pieces.begin(), pieces.end(), [&](const Piece& p) {
        return !intersect(p.global, piece.global).empty();
      });
      if (!clash) {
        pieces.push_back(piece);
        break;
      }
    }
    int d = n - 1;
    for (; d >= 0; --d) {
      if (++index[d] + 1 < static_cast<std::int64_t>(cuts[d].size())) break;
      index[d] = 0;
    }
    if (d < 0) break;
  }
  (void)layout;
}

RandomLayouts random_layouts(std::uint32_t seed, int ranks) {
  std::mt19937 rng(seed);
  RandomLayouts out;
  const int params = std::uniform_int_distribution<int>(1, 4)(rng);
  for (int p = 0; p < params; ++p) {
    const int ndim = std::uniform_int_distribution<int>(1, 4)(rng);
    std::vector<std::int64_t> shape;
    for (int d = 0; d < ndim; ++d) shape.push_back(std::uniform_int_distribution<int>(1, 9)(rng));
    const ParamSpec spec{"p" + std::to_string(p), shape,
                         p % 2 ? DType::kFloat32 : DType::kBFloat16};
    out.src.add_param(spec);
    out.dst.add_param(spec);
    for (Layout* layout : {&out.src, &out.dst}) {
      std::map<PeId, std::vector<Piece>> held;
      const int tilings = layout == &out.src ? std::uniform_int_distribution<int>(1, 3)(rng) : 1;
      for (int t = 0; t < tilings; ++t) add_tiling(rng, *layout, spec, ranks, held);
      for (auto& [rank, pieces] : held) layout->add_shard(rank, spec.name, shape, pieces);
    }
  }
  return out;
}

bool fully_covered(const Layout& src, const Layout& dst) {
  // A random source tiling may lose a tile when every rank it tried already held one there.
  try {
    make_reshard_plan(src, dst);
  } catch (const Error& error) {
    if (std::string(error.what()).find("held by no source") == std::string::npos) throw;
    return false;
  }
  return true;
}

TEST(Planner, RandomLayoutsCoverConserveAndAgree) {
  int checked = 0;
  for (std::uint32_t seed = 1; seed <= 300; ++seed) {
    SCOPED_TRACE("seed " + std::to_string(seed));
    const int ranks = 1 + static_cast<int>(seed % 7);
    RandomLayouts layouts = random_layouts(seed, ranks);
    if (!fully_covered(layouts.src, layouts.dst)) continue;
    ++checked;
    const PlanOptions options{.split_min_bytes = seed % 3 == 0 ? 16u : 0u, .split_row_align = 1};
    const ReshardPlan plan = make_reshard_plan(layouts.src, layouts.dst, options);
    expect_valid(plan);
    // Every rank builds its own copy of the layouts: the ops and task ids must agree.
    RandomLayouts again = random_layouts(seed, ranks);
    const ReshardPlan replay = make_reshard_plan(again.src, again.dst, options);
    EXPECT_EQ(op_keys(plan), op_keys(replay));
    EXPECT_EQ(plan.fingerprint(), replay.fingerprint());
    std::set<TaskId> ids;
    for (const TransferOp& op : plan.ops()) EXPECT_TRUE(ids.insert(op.task_id).second);
    if (HasFailure()) break;
  }
  EXPECT_GT(checked, 150);
}

TEST(Planner, AddingARankDoesNotRenumberTheOthers) {
  const ModelSpec model = toy_model(2, 64, 4);
  const Layout src = build_layout(model, {.tp = 4, .ep = 2});
  const ReshardPlan before = make_reshard_plan(src, build_layout(model, {.tp = 2, .ep = 2}));
  // A second engine replica joins on ranks 2-3: the first replica's operations keep their ids.
  const ReshardPlan after =
      make_reshard_plan(src, build_layout(model, {.tp = 2, .replicas = 2, .ep = 2}));
  expect_valid(after);
  const std::set<OpKey> old_keys = op_keys(before);
  const std::set<OpKey> new_keys = op_keys(after);
  EXPECT_TRUE(std::includes(new_keys.begin(), new_keys.end(), old_keys.begin(), old_keys.end()));
  EXPECT_GT(new_keys.size(), old_keys.size());
}

TEST(Planner, RefusesUncoveredRegionsNamingThem) {
  Layout src, dst;
  const ParamSpec w{"w", {8, 6}, DType::kBFloat16};
  src.add_param(w);
  dst.add_param(w);
  src.add_shard(0, "w", Box{2, {0, 0}, {4, 6}});
  dst.add_shard(1, "w", Box::whole(w.shape));
  try {
    make_reshard_plan(src, dst);
    FAIL() << "expected a refusal";
  } catch (const Error& error) {
    EXPECT_EQ(error.code(), ErrorCode::kValidation);
    EXPECT_NE(std::string(error.what())
                  .find("parameter 'w': region [4:8, 0:6] of destination "
                        "PE 1 is held by no source PE"),
              std::string::npos)
        << error.what();
  }
}

TEST(Planner, RefusesMismatchedOrMissingParameters) {
  Layout src, dst;
  src.add_param({"w", {8, 6}, DType::kBFloat16});
  dst.add_param({"w", {8, 6}, DType::kFloat32});
  src.add_shard(0, "w", Box::whole({8, 6}));
  dst.add_shard(0, "w", Box::whole({8, 6}));
  EXPECT_THROW(
      {
        try {
          make_reshard_plan(src, dst);
        } catch (const Error& e) {
          EXPECT_NE(std::string(e.what()).find("'w' differs between the layouts"),
                    std::string::npos);
          throw;
        }
      },
      Error);
  Layout only_dst;
  only_dst.add_param({"v", {4}, DType::kFloat32});
  only_dst.add_shard(0, "v", Box::whole({4}));
  EXPECT_THROW(make_reshard_plan(src, only_dst), Error);
}

TEST(Layouts, RefuseBadShardsAndIndivisibleSplits) {
  Layout layout;
  layout.add_param({"w", {8, 6}, DType::kBFloat16});
  EXPECT_THROW(layout.add_shard(0, "w", Box{2, {4, 0}, {8, 6}}), Error);  // outside
  EXPECT_THROW(layout.add_shard(0, "nope", Box::whole({8, 6})), Error);
  EXPECT_THROW(
      layout.add_shard(0, "w", {8, 6},
                       {Piece{Box{2, {0, 0}, {4, 6}}, {}}, Piece{Box{2, {4, 0}, {4, 6}}, {}}}),
      Error);  // both pieces at local (0, 0)
  layout.add_shard(0, "w", Box::whole({8, 6}));
  EXPECT_THROW(layout.add_shard(0, "w", Box::whole({8, 6})), Error);  // twice
  EXPECT_THROW(layout.add_param({"w", {8, 7}, DType::kBFloat16}), Error);

  const ModelSpec model = toy_model(1, 64);
  EXPECT_THROW(build_layout(model, {.pp = 2}), Error);                         // one layer
  EXPECT_THROW(build_layout(toy_model(2, 64, 6), {.tp = 4, .ep = 4}), Error);  // 6 experts
}

// A tensor-parallel dim that does not divide splits as torch.chunk does, each packed partition
// on its own: every element on exactly one TP rank, the first ranks holding ceil(size / tp); and a
// plan between such a layout and another covers every destination element once.
TEST(Layouts, UnevenTensorParallelSplitsAsTorchChunks) {
  const ModelSpec model = toy_model(2, 64);
  for (const int tp : {3, 5, 7}) {
    SCOPED_TRACE("tp " + std::to_string(tp));
    const Layout layout = build_layout(model, {.tp = tp});
    for (const ModelParam& param : model.params) {
      if (param.tp_dim < 0) continue;
      const std::uint32_t index = layout.param_index(param.spec.name);
      const int dim = param.tp_dim;
      std::vector<std::int64_t> partitions = param.packed;
      if (partitions.empty()) partitions.push_back(param.spec.shape[dim]);
      std::vector<int> held(param.spec.shape[dim], 0);
      for (int rank = 0; rank < tp; ++rank) {
        std::int64_t expected_local = 0;
        for (std::int64_t size : partitions) {
          const std::int64_t chunk = (size + tp - 1) / tp;
          expected_local += std::max<std::int64_t>(
              0, std::min(size, (rank + 1) * chunk) - std::min(size, rank * chunk));
        }
        const Shard* shard = layout.find_shard(rank, index);
        ASSERT_NE(shard, nullptr);
        EXPECT_EQ(shard->local_shape[dim], expected_local) << param.spec.name << " rank " << rank;
        for (const Piece& piece : shard->pieces) {
          for (std::int64_t i = 0; i < piece.global.extent[dim]; ++i)
            ++held[piece.global.offset[dim] + i];
        }
      }
      EXPECT_EQ(std::count(held.begin(), held.end(), 1), static_cast<long>(held.size()))
          << param.spec.name << ": an element on no rank or on two";
    }
    const auto src = std::make_shared<const Layout>(layout);
    const auto dst = std::make_shared<const Layout>(build_layout(model, {.tp = 2, .replicas = 2}));
    const ReshardPlan plan = make_reshard_plan(src, dst);
    std::uint64_t destination_bytes = 0;
    for (const Shard& shard : dst->shards()) {
      std::int64_t elements = 1;
      for (std::int64_t extent : shard.local_shape) elements *= extent;
      destination_bytes += static_cast<std::uint64_t>(elements) * 2;
    }
    EXPECT_EQ(plan.stats().total_bytes, destination_bytes);
  }
}

// A vocabulary of 1,000 rows padded as Megatron pads it over TP 2 (to a multiple of 128 x 2:
// 1,024) on one side and as another framework pads it over TP 3 (to a multiple of 96: 1,056) on
// the other: the plan moves every real row into its place once and no padding row.
TEST(Layouts, VocabulariesPaddedDifferentlyMoveOnlyTheirRealRows) {
  const auto vocab_model = [](std::int64_t vocab) {
    ModelSpec model{"padded", 1, 0, {}};
    for (const char* name : {"embed.weight", "head.weight"}) {
      ModelParam param;
      param.spec = {name, {vocab, 16}, DType::kBFloat16};
      param.tp_dim = 0;
      param.stage = name[0] == 'e' ? Stage::kFirst : Stage::kLast;
      param.vocab = true;
      model.params.push_back(param);
    }
    return model;
  };
  const ModelSpec model = vocab_model(1000);
  const auto src =
      std::make_shared<const Layout>(build_layout(model, {.tp = 2, .vocab_multiple = 256}));
  const auto dst =
      std::make_shared<const Layout>(build_layout(model, {.tp = 3, .vocab_multiple = 96}));
  ASSERT_EQ(src->params()[0].shape, (std::vector<std::int64_t>{1024, 16}));
  ASSERT_EQ(src->params()[0].real(), (std::vector<std::int64_t>{1000, 16}));
  ASSERT_EQ(dst->params()[0].shape, (std::vector<std::int64_t>{1056, 16}));
  EXPECT_EQ(dst->find_shard(2, 0)->local_shape, (std::vector<std::int64_t>{352, 16}));
  const ReshardPlan plan = make_reshard_plan(src, dst);
  for (std::uint32_t param = 0; param < 2; ++param) {
    std::vector<int> written(1056, 0);
    for (const TransferOp& op : plan.ops()) {
      if (op.param != param) continue;
      const Shard* to = dst->find_shard(op.dst_pe, param);
      ASSERT_NE(to, nullptr);
      // Lands where the destination rank holds those rows, from where the source rank holds them.
      EXPECT_EQ(op.dst_box().offset[0] + to->pieces[0].global.offset[0], op.region.offset[0]);
      const Shard* from = src->find_shard(op.src_pe, param);
      ASSERT_NE(from, nullptr);
      EXPECT_EQ(op.src_box().offset[0] + from->pieces[0].global.offset[0], op.region.offset[0]);
      for (std::int64_t row = 0; row < op.region.extent[0]; ++row)
        ++written[op.region.offset[0] + row];
    }
    for (std::int64_t row = 0; row < 1056; ++row)
      EXPECT_EQ(written[row], row < 1000 ? 1 : 0) << "row " << row;
  }
  EXPECT_EQ(plan.stats().total_bytes, 2ull * 1000 * 16 * 2);

  // The real rows must agree; padding alone may differ.
  const auto other = std::make_shared<const Layout>(build_layout(vocab_model(1001), {.tp = 3}));
  try {
    make_reshard_plan(src, other);
    FAIL() << "vocabularies of 1,000 and 1,001 rows were planned";
  } catch (const Error& error) {
    EXPECT_NE(
        std::string(error.what())
            .find("source [0:1000, 0:16] bfloat16 (padded to [1024, 16]), destination [0:1001"),
        std::string::npos)
        << error.what();
  }
  Layout layout;
  EXPECT_THROW(layout.add_param({"p", {8, 4}, DType::kBFloat16, {9, 4}}), Error);
  EXPECT_THROW(layout.add_param({"p", {8, 4}, DType::kBFloat16, {8}}), Error);
}

// The process a block lives on is a PE everywhere; the former names (rank, src_rank, dst_rank,
// rank_offset) stay for one release and say the same.
TEST(Layouts, FormerRankNamesSayWhatThePeNamesSay) {
  const ModelSpec model = toy_model(2, 64);
  const Layout by_former_name = build_layout(model, {.tp = 2, .rank_offset = 4});
  const Layout by_name = build_layout(model, {.tp = 2, .first_pe = 4});
  ASSERT_EQ(by_former_name.shards().size(), by_name.shards().size());
  for (std::size_t i = 0; i < by_name.shards().size(); ++i) {
    EXPECT_EQ(by_former_name.shards()[i].pe, by_name.shards()[i].pe);
    EXPECT_EQ(by_name.shards()[i].rank, by_name.shards()[i].pe);
  }
  EXPECT_EQ(by_name.max_pe(), 5);
  try {
    build_layout(model, {.tp = 2, .first_pe = 4, .rank_offset = 2});
    ADD_FAILURE() << "first_pe 4 and rank_offset 2 were accepted";
  } catch (const Error& error) {
    EXPECT_NE(std::string(error.what()).find("first_pe = 4 and rank_offset (its former name) = 2"),
              std::string::npos)
        << error.what();
  }
  const ReshardPlan plan = make_reshard_plan(build_layout(model, {.tp = 2}), by_name);
  ASSERT_FALSE(plan.ops().empty());
  for (const TransferOp& op : plan.ops()) {
    EXPECT_GE(op.dst_pe, 4);
    EXPECT_EQ(op.src_rank, op.src_pe);
    EXPECT_EQ(op.dst_rank, op.dst_pe);
  }
}

TEST(Layouts, MegatronRankOrderIsTensorThenDataThenPipeline) {
  const ModelSpec model = toy_model(2, 64);
  const Layout layout = build_layout(model, {.tp = 2, .dp = 2, .pp = 2, .first_pe = 10});
  EXPECT_EQ(layout.max_pe(), 17);
  const std::uint32_t first = layout.param_index("layers.0.self_attn.o_proj.weight");
  const std::uint32_t last = layout.param_index("layers.1.self_attn.o_proj.weight");
  // Stage 0 = ranks 10..13 (tp fastest, then dp); stage 1 = ranks 14..17.
  for (PeId rank : {10, 11, 12, 13}) EXPECT_NE(layout.find_shard(rank, first), nullptr);
  for (PeId rank : {14, 15, 16, 17}) EXPECT_EQ(layout.find_shard(rank, first), nullptr);
  for (PeId rank : {14, 15, 16, 17}) EXPECT_NE(layout.find_shard(rank, last), nullptr);
  // o_proj is row-parallel: tp rank 1 (ranks 11 and 13) holds the second half of dim 1.
  EXPECT_EQ(layout.find_shard(11, first)->pieces[0].global.offset[1], 32);
  EXPECT_EQ(layout.find_shard(13, first)->pieces[0].global.offset[1], 32);
  EXPECT_EQ(layout.find_shard(12, first)->pieces[0].global.offset[1], 0);
}

}  // namespace
}  // namespace reshard
