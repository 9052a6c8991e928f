// reshard._core's refits: execute_reshard_plan, bound and staged refits, and transforms (the
// built-in ones, and hooks written in Python that the C++ executor calls).
#include <cstdint>
#include <span>
#include <string>
#include <vector>

#include "bindings/arrays.hpp"
#include "bindings/bindings.hpp"
#include "bindings/tensor_snapshot.hpp"
#include "reshard/options.hpp"
#include "reshard/plan.hpp"
#include "reshard/staged_refit.hpp"
#include "reshard/transform.hpp"
#include "service/service_slot.hpp"
#include "service/test_hooks.hpp"

using namespace nb::literals;

namespace reshard::python {

namespace {

// An op's slice as Python sees it: plain values, valid after the hook returns.
struct SliceInfo {
  std::string param;
  std::vector<std::int64_t> offset, extent;  // the block in the full parameter
  std::vector<std::int64_t> local_offset;    // where it sits in this rank's local tensor
  std::vector<std::int64_t> local_shape;     // of this rank's local tensor
  PeId src_pe = 0, dst_pe = 0;
  TaskId task_id = 0;
};

SliceInfo slice_info(const OpSlice& slice) {
  return {slice.param.name,     offsets(slice.op.region), extents(slice.op.region),
          offsets(slice.local), slice.local_shape,        slice.op.src_pe,
          slice.op.dst_pe,      slice.op.task_id};
}

// A transform written in Python (a subclass of reshard.ReshardTransform): the engine's hooks call
// its _hook_* methods with the GIL held. It refers to the Python object weakly (that object holds
// this one, and a cycle through C++ would never be collected); the caller keeps it alive by
// passing it to every refit.
class PythonTransform final : public ReshardTransform {
 public:
  explicit PythonTransform(const nb::object& transform)
      : transform_(nb::module_::import_("weakref").attr("ref")(transform)),
        name_(nb::cast<std::string>(nb::str(transform.attr("name")))) {}
  ~PythonTransform() override {
    if (!Py_IsInitialized()) {
      transform_.release();  // the interpreter is gone: nothing left to decrement
      return;
    }
    nb::gil_scoped_acquire gil;
    transform_.reset();
  }

  std::string name() const override { return name_; }
  bool should_transform(const ParamSpec& param) const override {
    nb::gil_scoped_acquire gil;
    return nb::cast<bool>(self().attr("should_transform")(param));
  }
  std::vector<Buffer> prepare_send(const OpSlice& slice, const LocalTensor&,
                                   void* stream) override {
    nb::gil_scoped_acquire gil;
    return buffers(self().attr("_hook_prepare_send")(slice_info(slice), handle(stream)), slice);
  }
  std::vector<Buffer> prepare_recv(const OpSlice& slice, const LocalTensor&) override {
    nb::gil_scoped_acquire gil;
    return buffers(self().attr("_hook_prepare_recv")(slice_info(slice)), slice);
  }
  void finalize_recv(const OpSlice& slice, const LocalTensor&, std::span<const Buffer>,
                     void* stream) override {
    nb::gil_scoped_acquire gil;
    self().attr("_hook_finalize_recv")(slice_info(slice), handle(stream));
  }

 private:
  nb::object self() const {
    nb::object transform = transform_();
    if (transform.is_none()) {
      throw_error(ErrorCode::kInvalidState,
                  "the Python transform '" + name_ +
                      "' was garbage-collected while reshard "
                      "still uses it; keep a reference and pass it to every refit");
    }
    return transform;
  }
  static nb::object handle(void* stream) {
    if (stream == nullptr) return nb::none();
    return nb::int_(reinterpret_cast<std::uintptr_t>(stream));
  }
  std::vector<Buffer> buffers(const nb::handle& result, const OpSlice& slice) const {
    std::vector<Buffer> out;
    std::size_t index = 0;
    for (nb::handle item : result) {
      const std::string what = "wire buffer " + std::to_string(index++) + " that transform '" +
                               name_ + "' returned for '" + slice.param.name + "'";
      Array array;
      if (!nb::try_cast(item, array)) {
        throw_error(ErrorCode::kInvalidArgument, what + " is not an array (DLPack or buffer)");
      }
      out.push_back(buffer_of(array, what));
    }
    return out;
  }

  nb::object transform_;
  std::string name_;
};

// The options execute_reshard_plan, bind and the staged refit take from Python's keywords.
ReshardOptions refit_options(std::optional<std::uint64_t> staging_budget,
                             bool quantize_colocated_on_sender, bool strict) {
  ReshardOptions options;
  options.staging_budget = staging_budget;
  options.quantize_colocated_on_sender = quantize_colocated_on_sender;
  options.allow_unknown_names = !strict;
  return options;
}

}  // namespace

void bind_execution(nb::module_& m) {
  nb::class_<ScaleTensor>(m, "ScaleTensor")
      .def_prop_ro("dtype", [](const ScaleTensor& s) { return std::string(dtype_name(s.dtype)); })
      .def_prop_ro("shape",
                   [](const ScaleTensor& s) {
                     nb::list extents;
                     for (std::int64_t extent : s.shape) extents.append(extent);
                     return nb::steal<nb::tuple>(PySequence_Tuple(extents.ptr()));
                   })
      .def_prop_ro("nbytes", &ScaleTensor::bytes)
      .def("__repr__", [](const ScaleTensor& s) {
        std::string shape;
        for (std::int64_t extent : s.shape) {
          shape += (shape.empty() ? "" : ", ") + std::to_string(extent);
        }
        return "ScaleTensor(dtype='" + std::string(dtype_name(s.dtype)) + "', shape=(" + shape +
               (s.shape.size() == 1 ? ",))" : "))");
      });
  nb::class_<ReshardTransform>(m, "ReshardTransform")
      .def_prop_ro("name", &ReshardTransform::name)
      .def("should_transform", &ReshardTransform::should_transform, "param"_a)
      .def(
          "should_transform",
          [](const ReshardTransform& self, const std::string& name) -> bool {
            // Megatron's hooks take a name; the built-ins choose by shape and dtype too.
            throw_error(
                ErrorCode::kInvalidArgument,
                self.name() + ".should_transform('" + name +
                    "'): a transform chooses by a parameter's shape and dtype as well as "
                    "its name: pass a ParamSpec, e.g. should_transform(reshard.ParamSpec('" +
                    name + "', [4096, 4096], 'bfloat16'))");
          },
          "param_name"_a)
      .def("destination_scale", &ReshardTransform::destination_scale, "local_shape"_a);

  m.def(
      "make_cast_transform",
      [](const std::string& wire) { return make_cast_transform(parse_dtype(wire)); }, "wire"_a);
  auto side_of = [](const std::string& side) {
    if (side == "sender") return QuantizeSide::kSender;
    if (side == "receiver") return QuantizeSide::kReceiver;
    throw_error(ErrorCode::kInvalidArgument,
                "side must be 'sender' or 'receiver', not '" + side + "'");
  };
  m.def(
      "make_mxfp8_transform",
      [side_of](const std::string& side, const std::string& rounding, std::string filter,
                const std::string& scale_layout) {
        MxScaleRounding rule = MxScaleRounding::kOcp;
        if (rounding == "round_up") {
          rule = MxScaleRounding::kRoundUp;
        } else if (rounding == "megatron") {
          rule = MxScaleRounding::kMegatron;
        } else if (rounding != "ocp") {
          throw_error(ErrorCode::kInvalidArgument,
                      "rounding must be 'ocp', 'round_up' or 'megatron', not '" + rounding + "'");
        }
        MxScaleLayout layout = MxScaleLayout::kRowMajor;
        if (scale_layout == "swizzled") {
          layout = MxScaleLayout::kSwizzled;
        } else if (scale_layout != "row_major") {
          throw_error(ErrorCode::kInvalidArgument,
                      "scale_layout must be 'row_major' or 'swizzled', not '" + scale_layout + "'");
        }
        return make_mxfp8_transform(side_of(side), rule, std::move(filter), layout);
      },
      "side"_a = "sender", "rounding"_a = "ocp", "name_filter"_a = "",
      "scale_layout"_a = "row_major");
  m.def(
      "make_fp8_block_transform",
      [side_of](const std::string& side, std::string filter) {
        return make_fp8_block_transform(side_of(side), std::move(filter));
      },
      "side"_a = "sender", "name_filter"_a = "");

  nb::class_<SliceInfo> slice_info_class(m, "SliceInfo");
  slice_info_class.def_ro("param", &SliceInfo::param)
      .def_ro("offset", &SliceInfo::offset)
      .def_ro("extent", &SliceInfo::extent)
      .def_ro("local_offset", &SliceInfo::local_offset)
      .def_ro("local_shape", &SliceInfo::local_shape)
      .def_ro("src_pe", &SliceInfo::src_pe)
      .def_ro("dst_pe", &SliceInfo::dst_pe)
      .def_ro("task_id", &SliceInfo::task_id)
      .def("__repr__", [](const SliceInfo& s) {
        return "SliceInfo('" + s.param + "', task " + std::to_string(s.task_id) + ", PE " +
               std::to_string(s.src_pe) + " -> " + std::to_string(s.dst_pe) + ")";
      });
  def_former_name(slice_info_class, "src_rank", &SliceInfo::src_pe, "SliceInfo.src_pe");
  def_former_name(slice_info_class, "dst_rank", &SliceInfo::dst_pe, "SliceInfo.dst_pe");
  m.def(
      "python_transform",
      [](nb::object transform) -> std::shared_ptr<ReshardTransform> {
        return std::make_shared<PythonTransform>(transform);
      },
      "transform"_a);

  nb::class_<ReshardTimings>(m, "ReshardTimings")
      .def_ro("check_seconds", &ReshardTimings::check_seconds)
      .def_ro("agree_seconds", &ReshardTimings::agree_seconds)
      .def_ro("prepare_seconds", &ReshardTimings::prepare_seconds)
      .def_ro("transfer_seconds", &ReshardTimings::transfer_seconds)
      .def_ro("finalize_seconds", &ReshardTimings::finalize_seconds)
      .def_ro("issue_seconds", &ReshardTimings::issue_seconds);

  nb::class_<ReshardReport> report(m, "ReshardReport");
  report.def_ro("rescheduled", &ReshardReport::rescheduled)
      .def_ro("bytes_sent", &ReshardReport::bytes_sent)
      .def_ro("bytes_received", &ReshardReport::bytes_received)
      .def_ro("packed_bytes", &ReshardReport::packed_bytes)
      .def_ro("strided_bytes", &ReshardReport::strided_bytes)
      .def_ro("locally_converted_bytes", &ReshardReport::locally_converted_bytes)
      .def_ro("staging_bytes", &ReshardReport::staging_bytes)
      .def_ro("phases", &ReshardReport::phases)
      .def_ro("pipelined", &ReshardReport::pipelined)
      .def_ro("conversions_replayed", &ReshardReport::conversions_replayed)
      .def_ro("timing", &ReshardReport::timing);
  // The timings under their former names, for one release: each read warns.
  for (const auto& [name, field] :
       std::initializer_list<std::pair<const char*, double ReshardTimings::*>>{
           {"check_seconds", &ReshardTimings::check_seconds},
           {"agree_seconds", &ReshardTimings::agree_seconds},
           {"prepare_seconds", &ReshardTimings::prepare_seconds},
           {"transfer_seconds", &ReshardTimings::transfer_seconds},
           {"finalize_seconds", &ReshardTimings::finalize_seconds}}) {
    report.def_prop_ro(name, [name = std::string(name), field](const ReshardReport& r) {
      warn_deprecated("ReshardReport." + name + " is deprecated and goes in the next release: " +
                      "read ReshardReport.timing." + name);
      return r.timing.*field;
    });
  }

  m.def(
      "execute_reshard_plan",
      [](const std::shared_ptr<const ReshardPlan>& plan, const TensorLists& src,
         const TensorLists& dst, CopyService& service, std::shared_ptr<ReshardTransform> transform,
         std::optional<std::uintptr_t> stream, std::optional<std::uint64_t> staging_budget,
         bool quantize_colocated_on_sender, bool strict) {
        const auto [src_map, dst_map] =
            tensor_maps_or_refuse(src, dst, service, "execute_reshard_plan()");
        const ReshardOptions options =
            refit_options(staging_budget, quantize_colocated_on_sender, strict);
        nb::gil_scoped_release released;
        return execute_reshard_plan(plan, src_map, dst_map, service, std::move(transform),
                                    stream_of(stream), options);
      },
      "plan"_a, "src"_a, "dst"_a, "service"_a, "transform"_a = nb::none(), "stream"_a = nb::none(),
      "staging_budget"_a = nb::none(), "quantize_colocated_on_sender"_a = true, "strict"_a = true);
  m.def(
      "layer_groups",
      [](const std::vector<std::string>& params) {
        std::vector<std::string> names;
        std::vector<std::uint32_t> groups =
            layer_groups(std::span<const std::string>(params), &names);
        return std::make_pair(std::move(groups), std::move(names));
      },
      "params"_a);
  nb::class_<Refit>(m, "Refit")
      .def(
          "__init__",
          [](Refit* self, std::shared_ptr<const ReshardPlan> plan, const TensorLists& src,
             const TensorLists& dst, CopyService& service,
             std::shared_ptr<ReshardTransform> transform, std::optional<std::uintptr_t> stream,
             std::optional<std::uint64_t> staging_budget, bool quantize_colocated_on_sender,
             bool strict, std::vector<std::uint32_t> param_groups) {
            auto [src_map, dst_map] = tensor_maps_or_refuse(src, dst, service, "bind()");
            ReshardOptions options =
                refit_options(staging_budget, quantize_colocated_on_sender, strict);
            options.param_groups = std::move(param_groups);
            nb::gil_scoped_release released;
            new (self) Refit(std::move(plan), std::move(src_map), std::move(dst_map), service,
                             std::move(transform), options, stream_of(stream));
          },
          "plan"_a, "src"_a, "dst"_a, "service"_a, "transform"_a = nb::none(),
          "stream"_a = nb::none(), "staging_budget"_a = nb::none(),
          "quantize_colocated_on_sender"_a = true, "strict"_a = true,
          "param_groups"_a = std::vector<std::uint32_t>{}, nb::keep_alive<1, 5>())
      .def(
          "run",
          [](Refit& self, std::optional<std::uintptr_t> stream) {
            nb::gil_scoped_release released;
            return self.run(stream_of(stream));
          },
          "stream"_a = nb::none())
      .def(
          "run_groups",
          [](Refit& self, const std::vector<std::uint32_t>& groups,
             std::optional<std::uintptr_t> stream) {
            nb::gil_scoped_release released;
            return self.run(std::span<const std::uint32_t>(groups), stream_of(stream));
          },
          "groups"_a, "stream"_a = nb::none())
      .def_prop_ro("groups", [](const Refit& self) { return self.groups(); })
      .def(
          "update",
          [](Refit& self, const TensorLists& src, const TensorLists& dst,
             std::optional<std::uintptr_t> stream) {
            const auto [src_map, dst_map] =
                tensor_maps_or_refuse(src, dst, self.service(), "update()");
            nb::gil_scoped_release released;
            return self.update(src_map, dst_map, stream_of(stream));
          },
          "src"_a, "dst"_a, "stream"_a = nb::none())
      .def_prop_ro("report", &Refit::report);
  nb::class_<RefitGraph>(m, "RefitGraph")
      .def(
          "__init__",
          [](RefitGraph* self, Refit& refit, std::optional<std::uintptr_t> stream) {
            nb::gil_scoped_release released;  // a custom transform's hooks run in the capture
            new (self) RefitGraph(refit, stream_of(stream));
          },
          "refit"_a, "stream"_a = nb::none(), nb::keep_alive<1, 2>())
      // The stream as an int handle, None, or an object holding one (a torch.cuda.Stream's
      // cuda_stream, a CuPy stream's ptr), read here: a replay is one launch, and a Python
      // wrapper converting it would cost more than the launch. The GIL stays held: releasing
      // it would too.
      .def(
          "replay",
          [](RefitGraph& self, nb::handle stream) {
            self.replay(stream_handle_of(stream, "RefitGraph.replay"));
          },
          "stream"_a = nb::none());
  nb::class_<StagedRefit>(m, "StagedRefit")
      .def(
          "__init__",
          [](StagedRefit* self, std::shared_ptr<const ReshardPlan> plan, const TensorLists& src,
             const TensorLists& dst, CopyService& service,
             std::shared_ptr<ReshardTransform> transform, std::optional<std::uintptr_t> stream,
             std::optional<std::uint64_t> staging_budget, bool quantize_colocated_on_sender,
             bool strict, std::optional<std::uint64_t> max_staged_bytes,
             std::vector<std::uint32_t> param_groups) {
            auto [src_map, dst_map] = tensor_maps_or_refuse(src, dst, service, "bind()");
            ReshardOptions options =
                refit_options(staging_budget, quantize_colocated_on_sender, strict);
            options.param_groups = std::move(param_groups);
            nb::gil_scoped_release released;
            new (self)
                StagedRefit(std::move(plan), std::move(src_map), std::move(dst_map), service,
                            std::move(transform), options, stream_of(stream), max_staged_bytes);
          },
          "plan"_a, "src"_a, "dst"_a, "service"_a, "transform"_a = nb::none(),
          "stream"_a = nb::none(), "staging_budget"_a = nb::none(),
          "quantize_colocated_on_sender"_a = true, "strict"_a = true,
          "max_staged_bytes"_a = nb::none(), "param_groups"_a = std::vector<std::uint32_t>{},
          nb::keep_alive<1, 5>())
      .def(
          "stage",
          [](StagedRefit& self, std::optional<std::uintptr_t> stream) {
            nb::gil_scoped_release released;
            return self.stage(stream_of(stream));
          },
          "stream"_a = nb::none())
      .def(
          "stage_groups",
          [](StagedRefit& self, const std::vector<std::uint32_t>& groups,
             std::optional<std::uintptr_t> stream) {
            nb::gil_scoped_release released;
            return self.stage(std::span<const std::uint32_t>(groups), stream_of(stream));
          },
          "groups"_a, "stream"_a = nb::none())
      .def(
          "commit",
          [](StagedRefit& self, std::optional<std::uintptr_t> stream) {
            nb::gil_scoped_release released;
            self.commit(stream_of(stream));
          },
          "stream"_a = nb::none())
      .def(
          "commit_groups",
          [](StagedRefit& self, const std::vector<std::uint32_t>& groups,
             std::optional<std::uintptr_t> stream) {
            nb::gil_scoped_release released;
            self.commit(std::span<const std::uint32_t>(groups), stream_of(stream));
          },
          "groups"_a, "stream"_a = nb::none())
      .def_prop_ro("staged_groups", &StagedRefit::staged_groups)
      .def(
          "update",
          [](StagedRefit& self, const TensorLists& src, const TensorLists& dst,
             std::optional<std::uintptr_t> stream) {
            const auto [src_map, dst_map] =
                tensor_maps_or_refuse(src, dst, self.service(), "update()");
            nb::gil_scoped_release released;
            return self.update(src_map, dst_map, stream_of(stream));
          },
          "src"_a, "dst"_a, "stream"_a = nb::none())
      .def_prop_ro("version", &StagedRefit::version)
      .def_prop_ro("staged", &StagedRefit::staged)
      .def_prop_ro("staged_bytes", &StagedRefit::staged_bytes)
      .def_prop_ro("report", &StagedRefit::report);
  m.def(
      "execute_as_prepared",
      [](const std::shared_ptr<const ReshardPlan>& plan, CopyService& service,
         std::shared_ptr<ReshardTransform> transform, std::optional<std::uintptr_t> stream,
         std::optional<std::uint64_t> staging_budget, bool quantize_colocated_on_sender,
         bool strict) {
        const ReshardOptions options =
            refit_options(staging_budget, quantize_colocated_on_sender, strict);
        nb::gil_scoped_release released;
        return execution::execute_as_prepared(plan, service, transform, stream_of(stream), options);
      },
      "plan"_a, "service"_a, "transform"_a = nb::none(), "stream"_a = nb::none(),
      "staging_budget"_a = nb::none(), "quantize_colocated_on_sender"_a = true, "strict"_a = true,
      "execute_reshard_plan with the tensors its last call prepared with, which the caller "
      "vouches it was given again (TensorSnapshot.matches); None, with nothing done, where the "
      "service keeps no such refit.");
  m.def(
      "rerun_reshard_plan",
      [](const std::shared_ptr<const ReshardPlan>& plan, CopyService& service,
         std::shared_ptr<ReshardTransform> transform, std::optional<std::uintptr_t> stream) {
        nb::gil_scoped_release released;
        return rerun_reshard_plan(plan, service, transform, stream_of(stream));
      },
      "plan"_a, "service"_a, "transform"_a = nb::none(), "stream"_a = nb::none());
}

}  // namespace reshard::python
