// reshard._core's planner: parameters, layouts, model presets and plans.
#include <cstdint>
#include <string>
#include <vector>

#include "bindings/arrays.hpp"
#include "bindings/bindings.hpp"
#include "reshard/model_layouts.hpp"
#include "reshard/plan.hpp"

using namespace nb::literals;

namespace reshard::python {

namespace {

// ModelParam::stage as Python names it ("layer", "first", "last").
const char* stage_name(Stage stage) {
  switch (stage) {
    case Stage::kFirst:
      return "first";
    case Stage::kLast:
      return "last";
    case Stage::kLayer:
      break;
  }
  return "layer";
}

}  // namespace

void bind_layouts(nb::module_& m) {
  nb::class_<ParamSpec>(m, "ParamSpec",
                        "A parameter of a model: its name, global shape and dtype (\"bfloat16\", "
                        "\"float32\", \"float16\", \"fp8\", ...). `real_shape`, where the layout "
                        "pads the parameter (a vocabulary padded to a multiple of 128 x TP): the "
                        "block [0, real_shape[d]) holding the model's values, the only part plans "
                        "move, so two layouts may pad it differently (None: all of `shape`).")
      .def(
          "__init__",
          [](ParamSpec* self, std::string name, std::vector<std::int64_t> shape,
             const std::string& dtype, std::optional<std::vector<std::int64_t>> real_shape) {
            new (self) ParamSpec{std::move(name), std::move(shape), parse_dtype(dtype),
                                 real_shape.value_or(std::vector<std::int64_t>{})};
          },
          "name"_a, "shape"_a, "dtype"_a = "bfloat16", "real_shape"_a = nb::none())
      .def_ro("name", &ParamSpec::name)
      .def_ro("shape", &ParamSpec::shape)
      .def_prop_ro("real_shape", [](const ParamSpec& p) { return p.real(); })
      .def_prop_ro("dtype", [](const ParamSpec& p) { return std::string(dtype_name(p.dtype)); })
      .def_prop_ro("bytes", &ParamSpec::bytes)
      .def("__repr__", [](const ParamSpec& p) {
        std::string text =
            "ParamSpec('" + p.name + "', " + shape_str(p.shape) + ", " + dtype_name(p.dtype);
        if (p.real() != p.shape) text += ", real_shape=" + shape_str(p.real());
        return text + ")";
      });

  nb::class_<Layout>(m, "Layout",
                     "Which block of each parameter each PE holds. Made by build_layout() from "
                     "a ModelSpec and a Parallelism, or by hand: add_param() each parameter, then "
                     "add_shard(pe, name, offset, extent) per block a PE holds (its local "
                     "tensor is that block), or add_packed_shard() for a local tensor made of "
                     "several blocks (fused QKV). local_shape() and pieces() read it back.")
      .def(nb::init<>())
      .def("add_param", &Layout::add_param, "param"_a)
      .def(
          "add_shard",
          [](Layout& self, PeId pe, const std::string& param, std::vector<std::int64_t> offset,
             std::vector<std::int64_t> extent) {
            self.add_shard(pe, param, box_of(offset, extent));
          },
          "pe"_a, "param"_a, "offset"_a, "extent"_a)
      .def(
          "add_packed_shard",
          [](Layout& self, PeId pe, const std::string& param, std::vector<std::int64_t> local_shape,
             const std::vector<std::tuple<std::vector<std::int64_t>, std::vector<std::int64_t>,
                                          std::vector<std::int64_t>>>& pieces) {
            std::vector<Piece> converted;
            for (const auto& [offset, extent, local_at] : pieces) {
              Piece piece{box_of(offset, extent), {}};
              if (local_at.size() != offset.size()) {
                throw_error(ErrorCode::kInvalidArgument,
                            "a piece's local position needs one coordinate per dimension");
              }
              for (std::size_t d = 0; d < local_at.size(); ++d) piece.local_at[d] = local_at[d];
              converted.push_back(piece);
            }
            self.add_shard(pe, param, std::move(local_shape), std::move(converted));
          },
          "pe"_a, "param"_a, "local_shape"_a, "pieces"_a)
      .def_prop_ro("params", &Layout::params)
      .def_prop_ro("max_pe", &Layout::max_pe)
      .def_prop_ro("max_rank",
                   [](const Layout& self) {
                     warn_deprecated(
                         "Layout.max_rank is deprecated and goes in the next release: "
                         "read Layout.max_pe");
                     return self.max_pe();
                   })
      .def("__repr__",
           [](const Layout& self) {
             return "Layout(" + std::to_string(self.params().size()) + " params, PEs 0.." +
                    std::to_string(self.max_pe()) + ")";
           })
      .def(
          "local_shape",
          [](const Layout& self, PeId pe,
             const std::string& param) -> std::optional<std::vector<std::int64_t>> {
            const Shard* shard = self.find_shard(pe, self.param_index(param));
            if (shard == nullptr) return std::nullopt;
            return shard->local_shape;
          },
          "pe"_a, "param"_a)
      .def(
          "pieces",
          [](const Layout& self, PeId pe, const std::string& param) {
            std::vector<std::tuple<std::vector<std::int64_t>, std::vector<std::int64_t>,
                                   std::vector<std::int64_t>>>
                out;
            const Shard* shard = self.find_shard(pe, self.param_index(param));
            if (shard == nullptr) return out;
            for (const Piece& piece : shard->pieces) {
              const Box local = shard->local_box(piece);
              out.emplace_back(offsets(piece.global), extents(piece.global), offsets(local));
            }
            return out;
          },
          "pe"_a, "param"_a,
          "The blocks of `param` that PE `pe` holds: (offset, extent) in the parameter and the "
          "offset of each in the PE's local tensor; empty when it holds none.");

  nb::class_<ModelParam>(m, "ModelParam",
                         "A parameter as build_layout() lays it out: `spec` (ParamSpec); `tp_dim`, "
                         "the dimension tensor parallelism splits (-1: every TP PE holds it "
                         "whole); `packed`, the sizes of partitions along tp_dim that are split "
                         "separately and held one after the other (fused QKV: [q, k, v] rows; "
                         "empty: one); `stage`, the pipeline stage that holds it (\"layer\": the "
                         "stage of `layer`; \"first\": embeddings; \"last\": final norm and head); "
                         "`expert`, the expert it belongs to (-1: none); `vocab`, whether its "
                         "tp_dim (or dim 0) indexes the vocabulary, which a Parallelism's "
                         "vocab_multiple pads.")
      .def(
          "__init__",
          [](ModelParam* self, ParamSpec spec, int tp_dim, std::vector<std::int64_t> packed,
             const std::string& stage, int layer, int expert, bool vocab) {
            Stage where = Stage::kLayer;
            if (stage == "first") {
              where = Stage::kFirst;
            } else if (stage == "last") {
              where = Stage::kLast;
            } else if (stage != "layer") {
              throw_error(ErrorCode::kInvalidArgument,
                          "stage must be 'layer', 'first' or 'last', not '" + stage + "'");
            }
            new (self)
                ModelParam{std::move(spec), tp_dim, std::move(packed), where, layer, expert, vocab};
          },
          "spec"_a, "tp_dim"_a = -1, "packed"_a = std::vector<std::int64_t>{}, "stage"_a = "layer",
          "layer"_a = 0, "expert"_a = -1, "vocab"_a = false)
      .def_ro("spec", &ModelParam::spec)
      .def_ro("tp_dim", &ModelParam::tp_dim)
      .def_ro("packed", &ModelParam::packed)
      .def_prop_ro("stage", [](const ModelParam& p) { return stage_name(p.stage); })
      .def_ro("layer", &ModelParam::layer)
      .def_ro("expert", &ModelParam::expert)
      .def_ro("vocab", &ModelParam::vocab)
      .def("__repr__", [](const ModelParam& p) {
        std::string text = "ModelParam('" + p.spec.name + "', tp_dim=" + std::to_string(p.tp_dim);
        if (!p.packed.empty()) {
          text += ", packed=[";
          for (std::size_t i = 0; i < p.packed.size(); ++i)
            text += (i ? ", " : "") + std::to_string(p.packed[i]);
          text += "]";
        }
        text +=
            std::string(", stage='") + stage_name(p.stage) + "', layer=" + std::to_string(p.layer);
        if (p.expert >= 0) text += ", expert=" + std::to_string(p.expert);
        if (p.vocab) text += ", vocab=True";
        return text + ")";
      });

  nb::class_<ModelSpec>(m, "ModelSpec",
                        "A model's parameters (ModelParam) with its layer and routed-expert "
                        "counts: what build_layout() lays out under a Parallelism. "
                        "llama3_8b_model(), qwen3_30b_a3b_model(), moe_1t_model() and toy_model() "
                        "make ready ones.")
      .def(
          "__init__",
          [](ModelSpec* self, std::string name, int layers, int experts,
             std::vector<ModelParam> params) {
            new (self) ModelSpec{std::move(name), layers, experts, std::move(params)};
          },
          "name"_a, "layers"_a, "experts"_a, "params"_a)
      .def_ro("name", &ModelSpec::name)
      .def_ro("layers", &ModelSpec::layers)
      .def_ro("experts", &ModelSpec::experts)
      .def_ro("params", &ModelSpec::params)
      .def_prop_ro("total_bytes", &ModelSpec::total_bytes)
      .def("__repr__", [](const ModelSpec& s) {
        return "ModelSpec('" + s.name + "', layers=" + std::to_string(s.layers) +
               ", experts=" + std::to_string(s.experts) + ", " + std::to_string(s.params.size()) +
               " params, " + format_bytes(s.total_bytes()) + ")";
      });

  nb::class_<Parallelism>(m, "Parallelism",
                          "How a job shards a model: tensor (tp), data (dp), pipeline (pp) and "
                          "expert (ep, with etp-way tensor parallelism inside each expert) "
                          "parallelism, `replicas` whole copies side by side, on PEs "
                          "first_pe .. first_pe + world - 1 (Megatron's rank order: tp "
                          "fastest, then dp, then pp; `rank_offset` is first_pe's former name). "
                          "`vocab_multiple`: vocabulary rows "
                          "(ModelParam.vocab) padded up to a multiple of it, as the framework "
                          "pads them (Megatron-LM: 128 x tp; vLLM: 64); plans move the real rows "
                          "only, so each side may pad its own way.")
      .def(
          "__init__",
          [](Parallelism* self, int tp, int dp, int pp, int replicas, int ep, int etp,
             PeId first_pe, std::int64_t vocab_multiple, std::optional<PeId> rank_offset) {
            if (rank_offset) {
              warn_deprecated(
                  "Parallelism(rank_offset=) is deprecated and goes in the next "
                  "release: use first_pe=");
            }
            new (self) Parallelism{.tp = tp,
                                   .dp = dp,
                                   .pp = pp,
                                   .replicas = replicas,
                                   .ep = ep,
                                   .etp = etp,
                                   .first_pe = first_pe,
                                   .vocab_multiple = vocab_multiple,
                                   .rank_offset = rank_offset.value_or(0)};
          },
          "tp"_a = 1, "dp"_a = 1, "pp"_a = 1, "replicas"_a = 1, "ep"_a = 1, "etp"_a = 1,
          "first_pe"_a = 0, "vocab_multiple"_a = 0, "rank_offset"_a = nb::none())
      .def_rw("tp", &Parallelism::tp)
      .def_rw("dp", &Parallelism::dp)
      .def_rw("pp", &Parallelism::pp)
      .def_rw("replicas", &Parallelism::replicas)
      .def_rw("ep", &Parallelism::ep)
      .def_rw("etp", &Parallelism::etp)
      .def_rw("first_pe", &Parallelism::first_pe)
      .def_rw("rank_offset", &Parallelism::rank_offset)
      .def_rw("vocab_multiple", &Parallelism::vocab_multiple)
      .def_prop_ro("world", &Parallelism::world)
      .def("__repr__", [](const Parallelism& p) { return "Parallelism(" + p.str() + ")"; });

  m.def("build_layout", &build_layout, "model"_a, "parallelism"_a,
        "The Layout of `model` under `parallelism`: which block of each parameter each PE "
        "holds, as Megatron-LM (and vLLM, for tp/replicas) shard it. Uneven tensor-parallel "
        "splits follow torch.chunk.");
  m.def("llama3_8b_model", &llama3_8b_model, "layers"_a = 32);
  m.def("qwen3_30b_a3b_model", &qwen3_30b_a3b_model, "layers"_a = 48);
  m.def("moe_1t_model", &moe_1t_model, "layers"_a = 61, "experts"_a = 384);
  m.def("toy_model", &toy_model, "layers"_a, "hidden"_a, "experts"_a = 0);
}

void bind_plan(nb::module_& m) {
  nb::class_<TransferOp> transfer_op(
      m, "TransferOp",
      "One move of a plan: the block (offset, extent) of parameter `param` "
      "(an index into plan.params) from PE src_pe to PE dst_pe, `bytes` long, "
      "under `task_id`; src_offset / dst_offset say where it lies in each "
      "PE's local tensor.");
  transfer_op.def_ro("param", &TransferOp::param)
      .def_ro("src_pe", &TransferOp::src_pe)
      .def_ro("dst_pe", &TransferOp::dst_pe)
      .def_ro("bytes", &TransferOp::bytes)
      .def_ro("task_id", &TransferOp::task_id)
      .def_prop_ro("offset", [](const TransferOp& op) { return offsets(op.region); })
      .def_prop_ro("extent", [](const TransferOp& op) { return extents(op.region); })
      .def_prop_ro("src_offset", [](const TransferOp& op) { return offsets(op.src_box()); })
      .def_prop_ro("dst_offset", [](const TransferOp& op) { return offsets(op.dst_box()); })
      .def("__repr__", [](const TransferOp& op) {
        return "TransferOp(param " + std::to_string(op.param) + " " + op.region.str() + ", PE " +
               std::to_string(op.src_pe) + " -> " + std::to_string(op.dst_pe) + ", " +
               format_bytes(op.bytes) + ", task " + std::to_string(op.task_id) + ")";
      });
  def_former_name(transfer_op, "src_rank", &TransferOp::src_pe, "TransferOp.src_pe");
  def_former_name(transfer_op, "dst_rank", &TransferOp::dst_pe, "TransferOp.dst_pe");

  nb::class_<PlanStats>(m, "PlanStats",
                        "A plan's totals: bytes moved (local ones too), the most any PE sends "
                        "(egress) or receives (ingress), and the lower bound (the larger of the "
                        "two: no schedule moves the plan faster than that PE's bytes).")
      .def_ro("total_bytes", &PlanStats::total_bytes)
      .def_ro("local_bytes", &PlanStats::local_bytes)
      .def_ro("max_egress_bytes", &PlanStats::max_egress_bytes)
      .def_ro("max_ingress_bytes", &PlanStats::max_ingress_bytes)
      .def_ro("lower_bound_bytes", &PlanStats::lower_bound_bytes)
      .def_ro("ops", &PlanStats::ops)
      .def_ro("local_ops", &PlanStats::local_ops)
      .def("__repr__", [](const PlanStats& s) {
        return "PlanStats(" + std::to_string(s.ops) + " ops, " + std::to_string(s.local_ops) +
               " local, " + format_bytes(s.total_bytes) + " moved, lower bound " +
               format_bytes(s.lower_bound_bytes) + " on the busiest PE)";
      });

  nb::class_<ReshardPlan>(m, "ReshardPlan",
                          "The transfer operations that turn one layout into another "
                          "(make_reshard_plan): pure and deterministic, the same on every PE.")
      .def_prop_ro("params", &ReshardPlan::params)
      .def_prop_ro("ops", &ReshardPlan::ops)
      .def_prop_ro("stats", &ReshardPlan::stats)
      .def_prop_ro("src_layout", &ReshardPlan::src_layout)
      .def_prop_ro("dst_layout", &ReshardPlan::dst_layout)
      .def_prop_ro("fingerprint", &ReshardPlan::fingerprint)
      .def("summary", &ReshardPlan::summary)
      .def("__repr__", [](const ReshardPlan& p) { return "ReshardPlan(" + p.summary() + ")"; });

  m.def(
      "make_reshard_plan",
      [](const Layout& src, const Layout& dst, std::uint64_t split_min_bytes,
         std::int64_t split_row_align) {
        PlanOptions options;
        options.split_min_bytes = split_min_bytes;
        options.split_row_align = split_row_align;
        auto a = std::make_shared<const Layout>(src);
        auto b = std::make_shared<const Layout>(dst);
        nb::gil_scoped_release released;
        return std::make_shared<const ReshardPlan>(make_reshard_plan(a, b, options));
      },
      "src"_a, "dst"_a, "split_min_bytes"_a = PlanOptions{}.split_min_bytes,
      "split_row_align"_a = PlanOptions{}.split_row_align,
      "The plan that turns layout `src` into layout `dst` (same parameters, shapes and dtypes). "
      "Where several PEs hold a destination block's source (replicas), the block is split so "
      "they share the sending: into parts of at least `split_min_bytes` (0: never split), cut on "
      "multiples of `split_row_align` rows of the first dimension (keeps 128 x 128 FP8 tiles and "
      "MX blocks whole).");
}

}  // namespace reshard::python
