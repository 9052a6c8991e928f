// make_reshard_plan: cover every destination piece with source blocks, pick one source per block
// among replicas, merge what can travel as one block, number the operations.
#include <algorithm>
#include <functional>
#include <map>
#include <numeric>
#include <sstream>

#include "reshard/error.hpp"
#include "reshard/plan.hpp"

namespace reshard {
namespace {

std::uint64_t mix(std::uint64_t h, std::uint64_t value) {
  // splitmix64 finaliser over a running FNV-style combination: cheap and well spread.
  h ^= value + 0x9e3779b97f4a7c15ULL + (h << 6) + (h >> 2);
  h ^= h >> 30;
  h *= 0xbf58476d1ce4e5b9ULL;
  h ^= h >> 27;
  h *= 0x94d049bb133111ebULL;
  h ^= h >> 31;
  return h;
}

std::uint64_t hash_string(const std::string& text) {
  std::uint64_t h = 0xcbf29ce484222325ULL;
  for (unsigned char c : text) h = (h ^ c) * 0x100000001b3ULL;
  return mix(h, text.size());
}

std::uint64_t hash_box(std::uint64_t h, const Box& box) {
  for (int d = 0; d < box.ndim; ++d) {
    h = mix(h, static_cast<std::uint64_t>(box.offset[d]));
    h = mix(h, static_cast<std::uint64_t>(box.extent[d]));
  }
  return h;
}

bool box_less(const Box& a, const Box& b) {
  for (int d = 0; d < a.ndim; ++d) {
    if (a.offset[d] != b.offset[d]) return a.offset[d] < b.offset[d];
  }
  for (int d = 0; d < a.ndim; ++d) {
    if (a.extent[d] != b.extent[d]) return a.extent[d] < b.extent[d];
  }
  return false;
}

// `outer` minus `inner` (inner inside outer) as at most 2 * ndim disjoint boxes.
void subtract(const Box& outer, const Box& inner, std::vector<Box>& out) {
  Box rest = outer;
  for (int d = 0; d < outer.ndim; ++d) {
    const std::int64_t lo = inner.offset[d];
    const std::int64_t hi = inner.offset[d] + inner.extent[d];
    const std::int64_t rest_hi = rest.offset[d] + rest.extent[d];
    if (lo > rest.offset[d]) {
      Box below = rest;
      below.extent[d] = lo - rest.offset[d];
      out.push_back(below);
    }
    if (hi < rest_hi) {
      Box above = rest;
      above.offset[d] = hi;
      above.extent[d] = rest_hi - hi;
      out.push_back(above);
    }
    rest.offset[d] = lo;
    rest.extent[d] = hi - lo;
  }
}

struct SourceRef {
  PeId pe;
  std::uint32_t shard;
  std::uint32_t piece;
};

// Source pieces holding the same block: replicas of each other.
struct SourceGroup {
  Box box;
  std::vector<SourceRef> replicas;  // sorted by PE
};

struct Region {
  Box box;
  const SourceGroup* group;
  std::uint32_t dst_piece;
};

// A multi-replica region (or part of one) waiting for the balancing pass to pick its source.
struct Deferred {
  std::uint64_t bytes;
  const SourceGroup* group;
  std::uint32_t choice;  // index into group->replicas
};

// Two passes over the destination shards with the same traversal: the first settles what has no
// choice (local copies, single sources) and queues the rest; after balancing, the second emits the
// ops shard by shard, merging adjacent blocks. Nothing per op is kept between the passes except
// the balanced choices, which keeps planning a trillion-parameter model within memory and time.
class Planner {
 public:
  // With a sink, ops go to it as they are made instead of into the returned list.
  Planner(const Layout& src, const Layout& dst, const PlanOptions& options,
          std::function<void(const TransferOp&)> sink = {})
      : src_(src), dst_(dst), options_(options), sink_(std::move(sink)) {
    const PeId pes = std::max(src.max_pe(), dst.max_pe()) + 1;
    egress_.assign(static_cast<std::size_t>(pes), 0);
    ingress_.assign(static_cast<std::size_t>(pes), 0);
  }

  std::vector<TransferOp> plan() {
    match_params();
    for (const Shard& shard : dst_.shards()) settle_shard(shard);
    balance();
    if (!sink_) ops_.reserve(upper_bound_ops_);
    for (const Shard& shard : dst_.shards()) emit_shard(shard);
    check_unique_ids();
    return std::move(ops_);
  }

  std::vector<std::uint64_t>& egress() { return egress_; }
  std::vector<std::uint64_t>& ingress() { return ingress_; }

 private:
  std::uint32_t source_param(std::uint32_t dst_param) const {
    const ParamSpec& want = dst_.params()[dst_param];
    const ParamSpec* have = src_.find_param(want.name);
    if (have == nullptr) {
      if (dst_.shards_of(dst_param).empty()) return UINT32_MAX;
      throw_error(ErrorCode::kValidation, "parameter '" + want.name +
                                              "' is in the destination layout but not in the "
                                              "source layout");
    }
    // Padding may differ (each side pads as its framework does); the values may not.
    if (have->real() != want.real() || have->dtype != want.dtype) {
      const auto described = [](const ParamSpec& p) {
        return Box::whole(p.real()).str() + " " + dtype_name(p.dtype) +
               (p.real() != p.shape ? " (padded to " + shape_str(p.shape) + ")" : "");
      };
      throw_error(ErrorCode::kValidation,
                  "parameter '" + want.name + "' differs between the layouts: source " +
                      described(*have) + ", destination " + described(want));
    }
    return src_.param_index(want.name);
  }

  void match_params() {
    const std::size_t n = dst_.params().size();
    src_param_.resize(n);
    groups_.resize(n);
    for (std::uint32_t p = 0; p < n; ++p) {
      src_param_[p] = source_param(p);
      if (src_param_[p] != UINT32_MAX) groups_[p] = source_groups(src_param_[p]);
    }
    for (const ParamSpec& param : src_.params()) name_hash_.push_back(hash_string(param.name));
  }

  std::vector<SourceGroup> source_groups(std::uint32_t sp) const {
    std::vector<SourceGroup> groups;
    for (std::uint32_t shard_index : src_.shards_of(sp)) {
      const Shard& shard = src_.shards()[shard_index];
      for (std::uint32_t k = 0; k < shard.pieces.size(); ++k) {
        const Box& box = shard.pieces[k].global;
        auto it = std::find_if(groups.begin(), groups.end(),
                               [&](const SourceGroup& g) { return g.box == box; });
        if (it == groups.end()) {
          groups.push_back({box, {}});
          it = groups.end() - 1;
        }
        it->replicas.push_back({shard.pe, shard_index, k});
      }
    }
    for (SourceGroup& group : groups) {
      std::sort(group.replicas.begin(), group.replicas.end(),
                [](const SourceRef& a, const SourceRef& b) { return a.pe < b.pe; });
    }
    std::sort(groups.begin(), groups.end(),
              [](const SourceGroup& a, const SourceGroup& b) { return box_less(a.box, b.box); });
    return groups;
  }

  // Splits every piece of the destination shard into regions, each inside one source block;
  // blocks the destination PE holds itself go first, so they become local copies.
  void cover_shard(const Shard& shard, std::vector<Region>& regions) {
    regions.clear();
    const std::vector<SourceGroup>& groups = groups_[shard.param];
    // Only the real values move: a destination's padding keeps what it holds.
    const Box real = Box::whole(dst_.params()[shard.param].real());
    for (std::uint32_t k = 0; k < shard.pieces.size(); ++k) {
      const Box want = intersect(shard.pieces[k].global, real);
      if (want.empty()) continue;
      ordered_.clear();
      for (const SourceGroup& group : groups) {
        if (intersect(group.box, want).empty()) continue;
        const bool own = std::any_of(group.replicas.begin(), group.replicas.end(),
                                     [&](const SourceRef& s) { return s.pe == shard.pe; });
        ordered_.emplace_back(!own, &group);
      }
      std::stable_sort(ordered_.begin(), ordered_.end(),
                       [](const auto& a, const auto& b) { return a.first < b.first; });
      uncovered_.assign(1, want);
      for (const auto& [remote, group] : ordered_) {
        if (uncovered_.empty()) break;
        next_.clear();
        for (const Box& open : uncovered_) {
          const Box overlap = intersect(open, group->box);
          if (overlap.empty()) {
            next_.push_back(open);
            continue;
          }
          regions.push_back({overlap, group, k});
          subtract(open, overlap, next_);
        }
        uncovered_.swap(next_);
      }
      if (!uncovered_.empty()) {
        throw_error(
            ErrorCode::kValidation,
            "parameter '" + dst_.params()[shard.param].name + "': region " +
                uncovered_.front().str() + " of destination PE " + std::to_string(shard.pe) +
                " is held by no source PE" +
                (uncovered_.size() > 1 ? " (and " + std::to_string(uncovered_.size() - 1) + " more)"
                                       : std::string()));
      }
    }
  }

  std::uint64_t bytes_of(const Shard& shard, const Box& box) const {
    return static_cast<std::uint64_t>(box.elements()) *
           dtype_size(dst_.params()[shard.param].dtype);
  }

  // The replica a region must use without balancing: one on the destination PE, or the only
  // one. Null when there is a choice to make.
  static const SourceRef* fixed_source(const Region& region, PeId dst_pe) {
    const std::vector<SourceRef>& replicas = region.group->replicas;
    for (const SourceRef& s : replicas) {
      if (s.pe == dst_pe) return &s;
    }
    return replicas.size() == 1 ? &replicas.front() : nullptr;
  }

  // Splits a region along its first dimension into parts of at least split_min_bytes whose
  // boundaries fall on multiples of split_row_align, so replicas can share it.
  void split_for_replicas(const Shard& shard, const Region& region, std::vector<Box>& out) const {
    out.clear();
    const Box& box = region.box;
    const std::size_t replicas = region.group->replicas.size();
    const std::uint64_t bytes = bytes_of(shard, box);
    if (options_.split_min_bytes == 0 || replicas < 2 || box.ndim == 0 ||
        bytes < 2 * options_.split_min_bytes) {
      out.push_back(box);
      return;
    }
    const std::uint64_t parts = std::min<std::uint64_t>(replicas, bytes / options_.split_min_bytes);
    const std::int64_t align = std::max<std::int64_t>(1, options_.split_row_align);
    const std::int64_t begin = box.offset[0];
    const std::int64_t end = begin + box.extent[0];
    std::int64_t at = begin;
    for (std::uint64_t i = 1; i <= parts && at < end; ++i) {
      std::int64_t cut = begin + static_cast<std::int64_t>((box.extent[0] * i) / parts);
      if (i < parts) cut = ((cut + align / 2) / align) * align;
      cut = std::clamp(cut, at, end);
      if (i == parts) cut = end;
      if (cut == at) continue;
      Box part = box;
      part.offset[0] = at;
      part.extent[0] = cut - at;
      out.push_back(part);
      at = cut;
    }
  }

  void count(PeId src_pe, PeId dst_pe, std::uint64_t bytes) {
    if (src_pe == dst_pe) return;
    egress_[src_pe] += bytes;
    ingress_[dst_pe] += bytes;
  }

  void settle_shard(const Shard& shard) {
    if (src_param_[shard.param] == UINT32_MAX) return;
    cover_shard(shard, regions_);
    upper_bound_ops_ += regions_.size();
    for (const Region& region : regions_) {
      if (const SourceRef* source = fixed_source(region, shard.pe)) {
        count(source->pe, shard.pe, bytes_of(shard, region.box));
        continue;
      }
      split_for_replicas(shard, region, parts_);
      for (const Box& part : parts_) {
        deferred_.push_back({bytes_of(shard, part), region.group, 0});
        upper_bound_ops_ += 1;
        ingress_[shard.pe] += deferred_.back().bytes;
      }
    }
  }

  // Largest first to the least-loaded replica: the classic LPT rule (within 4/3 of optimal).
  void balance() {
    std::vector<std::uint32_t> order(deferred_.size());
    std::iota(order.begin(), order.end(), 0);
    std::stable_sort(order.begin(), order.end(), [&](std::uint32_t a, std::uint32_t b) {
      return deferred_[a].bytes > deferred_[b].bytes;
    });
    for (std::uint32_t i : order) {
      Deferred& item = deferred_[i];
      const std::vector<SourceRef>& replicas = item.group->replicas;
      std::uint32_t best = 0;
      for (std::uint32_t c = 1; c < replicas.size(); ++c) {
        if (egress_[replicas[c].pe] < egress_[replicas[best].pe]) best = c;
      }
      item.choice = best;
      egress_[replicas[best].pe] += item.bytes;
    }
  }

  TransferOp make_op(const Shard& shard, const Region& region, const Box& box,
                     const SourceRef& source) const {
    const Piece& dst_piece = shard.pieces[region.dst_piece];
    const Piece& src_piece = src_.shards()[source.shard].pieces[source.piece];
    TransferOp op;
    op.param = src_param_[shard.param];
    op.src_pe = source.pe;
    op.dst_pe = shard.pe;
    op.src_rank = op.src_pe;
    op.dst_rank = op.dst_pe;
    op.region = box;
    for (int d = 0; d < box.ndim; ++d) {
      op.src_at[d] = box.offset[d] - src_piece.global.offset[d] + src_piece.local_at[d];
      op.dst_at[d] = box.offset[d] - dst_piece.global.offset[d] + dst_piece.local_at[d];
    }
    op.bytes = bytes_of(shard, box);
    return op;
  }

  void emit_shard(const Shard& shard) {
    if (src_param_[shard.param] == UINT32_MAX) return;
    cover_shard(shard, regions_);
    shard_ops_.clear();
    for (const Region& region : regions_) {
      if (const SourceRef* source = fixed_source(region, shard.pe)) {
        shard_ops_.push_back(make_op(shard, region, region.box, *source));
        continue;
      }
      split_for_replicas(shard, region, parts_);
      for (const Box& part : parts_) {
        const Deferred& item = deferred_[next_deferred_++];
        shard_ops_.push_back(make_op(shard, region, part, item.group->replicas[item.choice]));
      }
    }
    if (shard_ops_.size() > 1) merge_adjacent(shard_ops_);
    for (TransferOp& op : shard_ops_) {
      const std::uint64_t h = hash_box(mix(name_hash_[op.param], op.dst_pe), op.region);
      op.task_id = (h >> kSubTaskBits) << kSubTaskBits;
      if (sink_) {
        ids_.push_back(op.task_id);
        sink_(op);
      } else {
        ops_.push_back(op);
      }
    }
  }

  // Two ops merge when they share a source PE and their blocks are adjacent along one
  // dimension in the full parameter and in both local tensors, agreeing on every other one.
  static bool try_merge(TransferOp& a, const TransferOp& b, int d) {
    if (a.src_pe != b.src_pe) return false;
    const int n = a.region.ndim;
    for (int e = 0; e < n; ++e) {
      if (e == d) continue;
      if (a.region.offset[e] != b.region.offset[e] || a.region.extent[e] != b.region.extent[e] ||
          a.src_at[e] != b.src_at[e] || a.dst_at[e] != b.dst_at[e]) {
        return false;
      }
    }
    const std::int64_t step = a.region.extent[d];
    if (b.region.offset[d] != a.region.offset[d] + step || b.src_at[d] != a.src_at[d] + step ||
        b.dst_at[d] != a.dst_at[d] + step) {
      return false;
    }
    a.region.extent[d] += b.region.extent[d];
    a.bytes += b.bytes;
    return true;
  }

  // The ops of one destination shard: few, so a sort per dimension is cheap.
  void merge_adjacent(std::vector<TransferOp>& ops) {
    const int n = ops.front().region.ndim;
    for (int d = n - 1; d >= 0; --d) {
      std::sort(ops.begin(), ops.end(), [d, n](const TransferOp& a, const TransferOp& b) {
        if (a.src_pe != b.src_pe) return a.src_pe < b.src_pe;
        for (int e = 0; e < n; ++e) {
          if (e != d && a.region.offset[e] != b.region.offset[e]) {
            return a.region.offset[e] < b.region.offset[e];
          }
        }
        return a.region.offset[d] < b.region.offset[d];
      });
      merged_.clear();
      for (const TransferOp& op : ops) {
        if (!merged_.empty() && try_merge(merged_.back(), op, d)) continue;
        merged_.push_back(op);
      }
      ops.swap(merged_);
    }
  }

  void check_unique_ids() const {
    std::vector<TaskId> ids = std::move(ids_);
    ids.reserve(ops_.size());
    for (const TransferOp& op : ops_) ids.push_back(op.task_id);
    std::sort(ids.begin(), ids.end());
    if (std::adjacent_find(ids.begin(), ids.end()) != ids.end()) {
      throw_error(ErrorCode::kValidation,
                  "two transfer operations hashed to the same task id; rename a parameter");
    }
  }

  const Layout& src_;
  const Layout& dst_;
  PlanOptions options_;
  std::vector<std::uint32_t> src_param_;          // per destination parameter
  std::vector<std::vector<SourceGroup>> groups_;  // per destination parameter
  std::vector<std::uint64_t> name_hash_;          // per source parameter
  std::vector<Deferred> deferred_;
  std::size_t next_deferred_ = 0;
  std::size_t upper_bound_ops_ = 0;
  std::vector<TransferOp> ops_;
  std::function<void(const TransferOp&)> sink_;
  std::vector<TaskId> ids_;  // of the ops handed to the sink, for the uniqueness check
  std::vector<std::uint64_t> egress_;
  std::vector<std::uint64_t> ingress_;
  // Scratch reused across shards.
  std::vector<Region> regions_;
  std::vector<Box> parts_, uncovered_, next_;
  std::vector<std::pair<bool, const SourceGroup*>> ordered_;
  std::vector<TransferOp> shard_ops_, merged_;
};

}  // namespace

Box TransferOp::src_box() const {
  Box box = region;
  box.offset = src_at;
  return box;
}

Box TransferOp::dst_box() const {
  Box box = region;
  box.offset = dst_at;
  return box;
}

std::string ReshardPlan::summary() const {
  std::ostringstream text;
  text << stats_.ops << " ops (" << stats_.local_ops << " local), "
       << format_bytes(stats_.total_bytes) << " moved (" << format_bytes(stats_.local_bytes)
       << " local), busiest PE " << format_bytes(stats_.lower_bound_bytes) << " (max egress "
       << format_bytes(stats_.max_egress_bytes) << ", max ingress "
       << format_bytes(stats_.max_ingress_bytes) << ")";
  return text.str();
}

ReshardPlan make_reshard_plan(std::shared_ptr<const Layout> src, std::shared_ptr<const Layout> dst,
                              const PlanOptions& options) {
  if (!src || !dst) throw_error(ErrorCode::kInvalidArgument, "make_reshard_plan: null layout");
  ReshardPlan plan;
  Planner planner(*src, *dst, options);
  plan.ops_ = planner.plan();
  plan.egress_ = std::move(planner.egress());
  plan.ingress_ = std::move(planner.ingress());
  plan.src_ = std::move(src);
  plan.dst_ = std::move(dst);
  PlanStats& stats = plan.stats_;
  std::uint64_t fingerprint = 0x5eed;
  for (const TransferOp& op : plan.ops_) {
    stats.ops += 1;
    stats.total_bytes += op.bytes;
    if (op.local()) {
      stats.local_ops += 1;
      stats.local_bytes += op.bytes;
    }
    fingerprint = mix(mix(mix(fingerprint, op.task_id), op.src_pe), op.dst_pe);
    fingerprint = hash_box(fingerprint, op.src_box());
    fingerprint = hash_box(fingerprint, op.dst_box());
  }
  plan.fingerprint_ = fingerprint;
  for (std::size_t r = 0; r < plan.egress_.size(); ++r) {
    stats.max_egress_bytes = std::max(stats.max_egress_bytes, plan.egress_[r]);
    stats.max_ingress_bytes = std::max(stats.max_ingress_bytes, plan.ingress_[r]);
  }
  stats.lower_bound_bytes = std::max(stats.max_egress_bytes, stats.max_ingress_bytes);
  return plan;
}

PlanStats for_each_reshard_op(const Layout& src, const Layout& dst,
                              const std::function<void(const TransferOp&)>& sink,
                              const PlanOptions& options) {
  PlanStats stats;
  Planner planner(src, dst, options, [&](const TransferOp& op) {
    stats.ops += 1;
    stats.total_bytes += op.bytes;
    if (op.local()) {
      stats.local_ops += 1;
      stats.local_bytes += op.bytes;
    }
    sink(op);
  });
  planner.plan();
  for (std::size_t r = 0; r < planner.egress().size(); ++r) {
    stats.max_egress_bytes = std::max(stats.max_egress_bytes, planner.egress()[r]);
    stats.max_ingress_bytes = std::max(stats.max_ingress_bytes, planner.ingress()[r]);
  }
  stats.lower_bound_bytes = std::max(stats.max_egress_bytes, stats.max_ingress_bytes);
  return stats;
}

ReshardPlan make_reshard_plan(const Layout& src, const Layout& dst, const PlanOptions& options) {
  return make_reshard_plan(std::make_shared<const Layout>(src), std::make_shared<const Layout>(dst),
                           options);
}

}  // namespace reshard
