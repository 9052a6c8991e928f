// End to end: build two model layouts, plan, execute on the copy service, verify every destination
// byte (plain moves bit for bit; transforms against the CPU reference applied to the whole
// parameter). Runs on the host transport under reshard-run, and on GPUs (tensors in device memory)
// when RESHARD_TEST_TRANSPORT names a GPU transport.
#include "reshard/reshard.hpp"

#include <gtest/gtest.h>

#include <algorithm>
#include <cstring>
#include <map>
#include <optional>
#include <set>

#include "reshard/model_layouts.hpp"
#include "reshard/resharder.hpp"
#include "reshard/staged_refit.hpp"
#include "service/service_slot.hpp"
#include "support/boxes.hpp"
#include "support/gpu_pes.hpp"
#include "support/pe_tests.hpp"
#include "transforms/number_formats.hpp"

#ifdef RESHARD_WITH_CUDA
#include <cuda_runtime.h>
#endif

namespace reshard {
namespace {

using testing_support::for_each_position;
using testing_support::linear;

using testing_support::all_pes;
using testing_support::bootstrap;

std::string transport_under_test() {
  const char* name = std::getenv("RESHARD_TEST_TRANSPORT");
  return name ? name : "host";
}
// RESHARD_TEST_MEMORY=host|cuda where the transport does not say (auto).
bool on_gpu() {
  if (const char* memory = std::getenv("RESHARD_TEST_MEMORY")) return std::string(memory) == "cuda";
  return transport_under_test() != "host";
}

std::unique_ptr<CopyService> make_service() { return testing_support::make_test_service("host"); }

// A tensor in host or device memory, filled and read back through host vectors.
class TestMemory {
 public:
  TestMemory(std::size_t bytes, int device) : bytes_(bytes), device_(device) {
    if (!on_gpu()) {
      host_.assign(bytes, std::byte{0xcd});
      return;
    }
#ifdef RESHARD_WITH_CUDA
    cudaMalloc(&gpu_, bytes == 0 ? 1 : bytes);
    cudaMemset(gpu_, 0xcd, bytes);
#endif
  }
  ~TestMemory() {
#ifdef RESHARD_WITH_CUDA
    if (gpu_) cudaFree(gpu_);
#endif
  }
  TestMemory(const TestMemory&) = delete;
  Buffer buffer() {
    return on_gpu() ? Buffer::cuda(gpu_, bytes_, device_) : Buffer::host(host_.data(), bytes_);
  }
  void upload(const std::vector<std::byte>& data) {
    if (!on_gpu()) {
      host_ = data;
      return;
    }
#ifdef RESHARD_WITH_CUDA
    cudaMemcpy(gpu_, data.data(), data.size(), cudaMemcpyHostToDevice);
#endif
  }
  std::vector<std::byte> download() const {
    if (!on_gpu()) return host_;
    std::vector<std::byte> out(bytes_);
#ifdef RESHARD_WITH_CUDA
    cudaMemcpy(out.data(), gpu_, bytes_, cudaMemcpyDeviceToHost);
#endif
    return out;
  }

 private:
  std::size_t bytes_;
  int device_;
  std::vector<std::byte> host_;
  void* gpu_ = nullptr;
};

// Parameter `p`'s element at global linear index i, as bf16 bits: a spread of magnitudes
// (including zeros and values that need MX scales far from 1) that differs between parameters.
std::uint16_t source_value(std::uint32_t p, std::int64_t i) {
  const std::uint64_t h = (static_cast<std::uint64_t>(i) * 2654435761u) ^ (p * 40503u);
  const int exponent = static_cast<int>(h % 29) - 14;
  const float mantissa = static_cast<float>((h >> 8) % 2001) / 1000.0f - 1.0f;
  return formats::float_to_bf16(std::ldexp(mantissa, exponent));
}

// Calls fn(global position, local position) for every element this shard holds.
template <typename Fn>
void for_each_element(const Shard& shard, Fn fn) {
  for (const Piece& piece : shard.pieces) {
    for_each_position(piece.global, [&](const Extents& g) {
      Extents l = g;
      for (int d = 0; d < piece.global.ndim; ++d) {
        l[d] = g[d] - piece.global.offset[d] + piece.local_at[d];
      }
      fn(g, l);
    });
  }
}

// kCastFp32 sends bf16 and widens on arrival; kFp32Wire widens on the sender, so the wire and
// the destination share a dtype and contiguous slices land in place.
enum class Mode {
  kPlain,
  kCastFp32,
  kFp32Wire,
  kMxReceiver,
  kMxSender,
  kBlockReceiver,
  kBlockSender
};

const char* mode_name(Mode mode) {
  switch (mode) {
    case Mode::kPlain:
      return "plain";
    case Mode::kCastFp32:
      return "cast-fp32";
    case Mode::kFp32Wire:
      return "fp32-wire";
    case Mode::kMxReceiver:
      return "mxfp8-receiver";
    case Mode::kMxSender:
      return "mxfp8-sender";
    case Mode::kBlockReceiver:
      return "fp8-block-receiver";
    case Mode::kBlockSender:
      return "fp8-block-sender";
  }
  return "?";
}

std::shared_ptr<ReshardTransform> transform_for(Mode mode) {
  switch (mode) {
    case Mode::kPlain:
      return nullptr;
    case Mode::kCastFp32:
      return make_cast_transform(DType::kBFloat16);
    case Mode::kFp32Wire:
      return make_cast_transform(DType::kFloat32);
    case Mode::kMxReceiver:
      return make_mxfp8_transform(QuantizeSide::kReceiver, MxScaleRounding::kOcp);
    case Mode::kMxSender:
      return make_mxfp8_transform(QuantizeSide::kSender, MxScaleRounding::kRoundUp);
    case Mode::kBlockReceiver:
      return make_fp8_block_transform(QuantizeSide::kReceiver, "mlp.");
    case Mode::kBlockSender:
      return make_fp8_block_transform(QuantizeSide::kSender, "mlp.");
  }
  return nullptr;
}

// What the destination holds for a parameter: the bf16 source, its fp32 cast, or FP8 + scales
// from the reference applied to the whole parameter.
struct Expected {
  DType dtype = DType::kBFloat16;
  std::vector<std::uint16_t> bf16;      // plain
  std::vector<float> fp32;              // cast
  std::vector<std::uint8_t> fp8;        // MX or block data, per global element
  std::vector<std::uint8_t> mx_scales;  // [rows, cols / 32]
  std::vector<float> block_scales;      // [rows / 128, cols / 128] (rounded up)
};

Expected expected_for(const ParamSpec& param, std::uint32_t p, Mode mode,
                      const ReshardTransform* transform) {
  Expected out;
  const std::int64_t n = param.elements();
  std::vector<std::uint16_t> source(n);
  for (std::int64_t i = 0; i < n; ++i) source[i] = source_value(p, i);
  const bool converted = transform && transform->should_transform(param);
  const std::int64_t cols = param.shape.back();
  const std::int64_t rows = n / std::max<std::int64_t>(1, cols);
  if (!converted) {
    out.bf16 = std::move(source);
  } else if (mode == Mode::kCastFp32 || mode == Mode::kFp32Wire) {
    out.dtype = DType::kFloat32;
    for (std::uint16_t v : source) out.fp32.push_back(formats::bf16_to_float(v));
  } else if (mode == Mode::kMxReceiver || mode == Mode::kMxSender) {
    out.dtype = DType::kFloat8E4M3;
    out.fp8.resize(n);
    out.mx_scales.resize(n / 32);
    reference_mxfp8_quantize(
        source.data(), rows, cols,
        mode == Mode::kMxSender ? MxScaleRounding::kRoundUp : MxScaleRounding::kOcp, out.fp8.data(),
        out.mx_scales.data());
  } else {
    out.dtype = DType::kFloat8E4M3;
    out.fp8.resize(n);
    out.block_scales.resize(((rows + 127) / 128) * ((cols + 127) / 128));
    reference_fp8_block_quantize(source.data(), rows, cols, out.fp8.data(),
                                 out.block_scales.data());
  }
  return out;
}

// What every parameter's destination must hold, by name.
std::map<std::string, Expected> expectations(const ReshardPlan& plan, Mode mode,
                                             const ReshardTransform* transform) {
  std::map<std::string, Expected> out;
  for (std::uint32_t p = 0; p < plan.params().size(); ++p) {
    out[plan.params()[p].name] = expected_for(plan.params()[p], p, mode, transform);
  }
  return out;
}

struct RankTensors {
  std::map<std::string, std::unique_ptr<TestMemory>> src, dst, dst_scale;
  TensorMap src_map, dst_map;
};

// `transform` (or null) says how large the scale tensors of its FP8 destinations are.
RankTensors make_tensors(const ReshardPlan& plan, PeId me, int device,
                         const std::map<std::string, Expected>& expected,
                         const ReshardTransform* transform) {
  RankTensors t;
  const Layout& src = plan.src_layout();
  for (std::uint32_t p = 0; p < src.params().size(); ++p) {
    const Shard* shard = src.find_shard(me, p);
    if (shard == nullptr) continue;
    const ParamSpec& param = src.params()[p];
    std::vector<std::byte> bytes(Box::whole(shard->local_shape).elements() * 2);
    auto* values = reinterpret_cast<std::uint16_t*>(bytes.data());
    for_each_element(*shard, [&](const Extents& g, const Extents& l) {
      values[linear(l, shard->local_shape)] = source_value(p, linear(g, param.shape));
    });
    auto memory = std::make_unique<TestMemory>(bytes.size(), device);
    memory->upload(bytes);
    t.src_map[param.name] = {memory->buffer(), DType::kBFloat16, {}, shard->local_shape};
    t.src[param.name] = std::move(memory);
  }
  const Layout& dst = plan.dst_layout();
  for (std::uint32_t p = 0; p < dst.params().size(); ++p) {
    const Shard* shard = dst.find_shard(me, p);
    if (shard == nullptr) continue;
    const ParamSpec& param = dst.params()[p];
    const Expected& want = expected.at(param.name);
    const std::int64_t n = Box::whole(shard->local_shape).elements();
    auto memory = std::make_unique<TestMemory>(n * dtype_size(want.dtype), device);
    LocalTensor tensor{memory->buffer(), want.dtype, {}, shard->local_shape};
    if (!want.mx_scales.empty() || !want.block_scales.empty()) {
      auto scales = std::make_unique<TestMemory>(
          transform->destination_scale(shard->local_shape).value().bytes(), device);
      tensor.scale = scales->buffer();
      t.dst_scale[param.name] = std::move(scales);
    }
    t.dst_map[param.name] = tensor;
    t.dst[param.name] = std::move(memory);
  }
  return t;
}

// Compares every element (and scale) this rank's destination holds; returns the mismatches.
// Where `only` is given, the parameters it marks (by index) alone.
std::size_t verify(const ReshardPlan& plan, PeId me, RankTensors& t,
                   const std::map<std::string, Expected>& expected,
                   const std::vector<bool>* only = nullptr) {
  std::size_t wrong = 0;
  const Layout& dst = plan.dst_layout();
  for (std::uint32_t p = 0; p < dst.params().size(); ++p) {
    const Shard* shard = dst.find_shard(me, p);
    if (shard == nullptr || (only != nullptr && !(*only)[p])) continue;
    const ParamSpec& param = dst.params()[p];
    const Expected& want = expected.at(param.name);
    const std::vector<std::byte> got = t.dst[param.name]->download();
    std::vector<std::byte> scales;
    if (t.dst_scale.count(param.name)) scales = t.dst_scale[param.name]->download();
    const auto& local_shape = shard->local_shape;
    const std::int64_t cols = param.shape.back(), local_cols = local_shape.back();
    auto report = [&](const Extents& g, const std::string& what) {
      if (wrong++ < 3) {
        ADD_FAILURE()
            << "rank " << me << " '" << param.name << "' at "
            << Box{param.shape.empty() ? 0 : static_cast<int>(param.shape.size()), g, {}}.str()
            << ": " << what;
      }
    };
    for_each_element(*shard, [&](const Extents& g, const Extents& l) {
      const std::int64_t gi = linear(g, param.shape), li = linear(l, local_shape);
      switch (want.dtype) {
        case DType::kBFloat16: {
          std::uint16_t v;
          std::memcpy(&v, got.data() + 2 * li, 2);
          if (v != want.bf16[gi]) report(g, "bf16 bits differ");
          break;
        }
        case DType::kFloat32: {
          float v;
          std::memcpy(&v, got.data() + 4 * li, 4);
          if (std::memcmp(&v, &want.fp32[gi], 4) != 0) report(g, "fp32 bits differ");
          break;
        }
        default: {
          if (static_cast<std::uint8_t>(got[li]) != want.fp8[gi]) report(g, "fp8 bits differ");
          const std::int64_t g_row = gi / cols, l_row = li / local_cols;
          const std::int64_t g_col = g[param.shape.size() - 1], l_col = l[param.shape.size() - 1];
          if (!want.mx_scales.empty() && g_col % 32 == 0 &&
              static_cast<std::uint8_t>(scales[l_row * (local_cols / 32) + l_col / 32]) !=
                  want.mx_scales[g_row * (cols / 32) + g_col / 32]) {
            report(g, "MX scale differs");
          }
          if (!want.block_scales.empty() && g_col % 128 == 0 && g_row % 128 == 0) {
            const std::int64_t g_tiles = (cols + 127) / 128, l_tiles = (local_cols + 127) / 128;
            const std::int64_t rows_m = param.shape[param.shape.size() - 2];
            const std::int64_t local_rows_m = local_shape[local_shape.size() - 2];
            const std::int64_t g_tile_rows = (rows_m + 127) / 128;
            const std::int64_t l_tile_rows = (local_rows_m + 127) / 128;
            const std::int64_t g_tile =
                (g_row / rows_m * g_tile_rows + (g_row % rows_m) / 128) * g_tiles + g_col / 128;
            const std::int64_t l_tile =
                (l_row / local_rows_m * l_tile_rows + (l_row % local_rows_m) / 128) * l_tiles +
                l_col / 128;
            float v;
            std::memcpy(&v, scales.data() + 4 * l_tile, 4);
            if (std::memcmp(&v, &want.block_scales[g_tile], 4) != 0)
              report(g, "tile scale differs");
          }
        }
      }
    });
  }
  return wrong;
}

struct Case {
  std::string name;
  Parallelism src, dst;
};

// Layout changes that fit the job's PE count: colocated (both sides on every PE) and disjoint
// (each side on half the PEs).
std::vector<Case> cases_for(int n) {
  std::vector<Case> cases;
  auto add = [&](Parallelism a, Parallelism b) {
    cases.push_back({a.str() + " -> " + b.str(), a, b});
  };
  const int p2 = n & -n;  // the largest power of two dividing n: the TP sizes that fit
  const int half_p2 = std::max(1, p2 / 2);
  add({.tp = p2, .dp = n / p2}, {.tp = half_p2, .replicas = n / half_p2});
  if (p2 >= 2) add({.tp = half_p2, .dp = n / p2, .pp = 2}, {.tp = p2, .replicas = n / p2});
  add({.dp = n}, {.tp = p2, .replicas = n / p2});
  if (n % 2 == 0) {
    const int half = n / 2, q = half & -half;
    add({.tp = q, .dp = half / q},
        {.tp = std::max(1, q / 2), .replicas = half / std::max(1, q / 2), .first_pe = half});
  }
  if (n % 4 == 0) add({.tp = 2, .dp = n / 2, .ep = 2}, {.tp = 4, .replicas = n / 4, .ep = 4});
  return cases;
}

int my_device() {
#ifdef RESHARD_WITH_CUDA
  if (on_gpu()) {
    int device = 0;
    cudaGetDevice(&device);
    return device;
  }
#endif
  return -1;
}

// The UUID of this PE's GPU as bytes (empty where the test runs on host memory).
std::string my_gpu_uuid() {
#ifdef RESHARD_WITH_CUDA
  if (on_gpu()) {
    cudaDeviceProp properties{};
    if (cudaGetDeviceProperties(&properties, my_device()) == cudaSuccess)
      return std::string(properties.uuid.bytes, sizeof properties.uuid.bytes);
  }
#endif
  return {};
}

// Whether `box` is one contiguous run of a row-major tensor of `shape`: every dimension after
// the first one it spans more than once of is spanned whole.
bool contiguous_in(const Box& box, const std::vector<std::int64_t>& shape) {
  int d = 0;
  while (d < box.ndim && box.extent[d] == 1) ++d;
  for (++d; d < box.ndim; ++d)
    if (box.extent[d] != shape[d]) return false;
  return true;
}

// Bytes of this rank's slices (each side of a local op counted once) that are not contiguous.
std::uint64_t strided_slice_bytes(const ReshardPlan& plan, PeId me) {
  std::uint64_t bytes = 0;
  for (const TransferOp& op : plan.ops()) {
    for (bool sending : {true, false}) {
      if ((sending ? op.src_pe : op.dst_pe) != me) continue;
      const Layout& layout = sending ? plan.src_layout() : plan.dst_layout();
      const Shard* shard = layout.find_shard(me, layout.param_index(plan.params()[op.param].name));
      if (!contiguous_in(sending ? op.src_box() : op.dst_box(), shard->local_shape))
        bytes += op.bytes;
    }
  }
  return bytes;
}

// A staging budget that holds any one op of the plan that may stage (of a parameter the transform
// converts; any, without one) but not a whole refit of the test models. An op's wire buffers on
// one rank are at most its bytes, or twice that for fp32 on the wire of a bf16 parameter and for
// both ends of a local op packed (no transform).
std::uint64_t small_budget(const ReshardPlan& plan, const ReshardTransform* transform, Mode mode,
                           int ops = 1) {
  std::uint64_t largest = 0;
  for (const TransferOp& op : plan.ops()) {
    if (transform == nullptr || transform->should_transform(plan.params()[op.param]))
      largest = std::max(largest, op.bytes);
  }
  const bool twice = mode == Mode::kFp32Wire || mode == Mode::kPlain;
  return ops * ((twice ? 2 : 1) * largest + 4096);
}

// The phases the refits ran in and the staging they held (the largest of the refits').
struct CaseResult {
  std::uint32_t phases = 1;
  std::uint64_t staging_bytes = 0;
  bool pipelined = false;  // a refit's phases alternated between two staging regions
};

// `bounded`: the refits run within small_budget() for `ops_in_budget` of the largest ops (0 where
// the transform and the transport need no staging), in phases; every byte is checked all the
// same.
CaseResult run_case(CopyService& service, const ModelSpec& model, const Case& c, Mode mode,
                    bool bounded = false, int ops_in_budget = 1) {
  SCOPED_TRACE(c.name + " " + mode_name(mode) +
               (bounded ? " within a budget of " + std::to_string(ops_in_budget) + " op(s)" : ""));
  auto plan = std::make_shared<const ReshardPlan>(
      make_reshard_plan(build_layout(model, c.src), build_layout(model, c.dst)));
  ReshardOptions options;
  // Quantized on arrival, slices between PEs on one GPU are quantized by the sender unless told
  // otherwise: the cases alternate, so both ways run (every PE calls run_case in the same order).
  static int calls = 0;
  options.quantize_colocated_on_sender = calls++ % 2 == 0;
  // Which PEs share a GPU, by its UUID (processes may see one GPU under different ordinals, or
  // different GPUs under one; empty: host memory).
  const std::string gpu = my_gpu_uuid();
  std::vector<std::string> gpu_of_pe;
  for (const auto& part : service.all_gather(std::as_bytes(std::span(gpu))))
    gpu_of_pe.emplace_back(reinterpret_cast<const char*>(part.data()), part.size());
  auto sender_quantizes = [&](const TransferOp& op) {
    if (mode == Mode::kMxSender) return true;
    return mode == Mode::kMxReceiver && options.quantize_colocated_on_sender &&
           !gpu_of_pe[op.src_pe].empty() && gpu_of_pe[op.src_pe] == gpu_of_pe[op.dst_pe];
  };
  CaseResult result;
  // Bounded: phases are needed exactly where some rank's refit needs more staging than the
  // budget, which a first refit without a bound says.
  bool phases_needed = false;
  if (bounded) {
    const bool stages =
        mode != Mode::kPlain || !execution::ServiceSlot::moves_rows_in_place(service);
    auto transform = transform_for(mode);
    options.staging_budget = stages ? small_budget(*plan, transform.get(), mode, ops_in_budget) : 0;
    const auto expected = expectations(*plan, mode, transform.get());
    RankTensors tensors =
        make_tensors(*plan, service.my_pe(), my_device(), expected, transform.get());
    ReshardOptions unlimited = options;
    unlimited.staging_budget = ReshardOptions::kUnlimited;
    const std::uint64_t staging = execute_reshard_plan(plan, tensors.src_map, tensors.dst_map,
                                                       service, transform, nullptr, unlimited)
                                      .staging_bytes;
    EXPECT_EQ(verify(*plan, service.my_pe(), tensors, expected), 0u) << "without a bound";
    phases_needed = !all_pes(staging <= *options.staging_budget);
  }
  auto transform = transform_for(mode);
  const std::map<std::string, Expected> expected = expectations(*plan, mode, transform.get());
  const PeId me = service.my_pe();
  // Local ops skip the wire where the transform converts them in place, beside the transfer:
  // cast (bf16 -> fp32 here, the wire being one of the two), or quantized, except where the
  // sender quantizes a slice that other ops send too (replicas): by the sender-side variant, or
  // on a PE whose GPU other PEs share (quantized by itself, as its other slices, unless told not
  // to). Those go through the wire, converted once for all.
  const bool gpu_shared = !gpu.empty() && std::count(gpu_of_pe.begin(), gpu_of_pe.end(), gpu) > 1;
  const bool scaled = mode != Mode::kPlain && mode != Mode::kCastFp32 && mode != Mode::kFp32Wire;
  const bool sender_converts = mode == Mode::kMxSender || mode == Mode::kBlockSender ||
                               (gpu_shared && options.quantize_colocated_on_sender);
  auto also_sent = [&](const TransferOp& local) {
    return std::any_of(plan->ops().begin(), plan->ops().end(), [&](const TransferOp& op) {
      return &op != &local && op.src_pe == local.src_pe && op.param == local.param &&
             op.src_box() == local.src_box();
    });
  };
  std::uint64_t locally_converted = 0;
  for (const TransferOp& op : plan->ops()) {
    if (mode != Mode::kPlain && op.local() && op.src_pe == me &&
        transform->should_transform(plan->params()[op.param]) &&
        !(scaled && sender_converts && also_sent(op))) {
      locally_converted += op.bytes;
    }
  }
  // The third refit gets new tensors on one rank only (the old ones stay alive, so the addresses
  // differ; the rank changes from case to case): every rank must schedule again with it.
  static int cases = 0;
  const PeId changing = static_cast<PeId>(cases++ % service.n_pes());
  std::vector<RankTensors> generations;
  generations.push_back(make_tensors(*plan, me, my_device(), expected, transform.get()));
  for (int refit = 0; refit < 3; ++refit) {
    if (refit == 2 && me == changing)
      generations.push_back(make_tensors(*plan, me, my_device(), expected, transform.get()));
    RankTensors& tensors = generations.back();
    const ReshardReport report = execute_reshard_plan(plan, tensors.src_map, tensors.dst_map,
                                                      service, transform, nullptr, options);
    EXPECT_EQ(report.rescheduled, refit != 1) << "refit " << refit;
    EXPECT_GT(report.timing.agree_seconds, 0.0)
        << "refit " << refit << ": the PEs agree at every execute";
    EXPECT_EQ(report.agree_seconds, report.timing.agree_seconds) << "the former name, a copy";
    EXPECT_EQ(report.check_seconds, report.timing.check_seconds) << "the former name, a copy";
    // The second refit, with the tensors of the first, replays the built-in transform's
    // conversions as the first queued them (and the byte checks below hold it to them).
    EXPECT_EQ(report.conversions_replayed, mode != Mode::kPlain && refit == 1) << "refit " << refit;
    if (options.staging_budget) EXPECT_LE(report.staging_bytes, *options.staging_budget);
    if (bounded) EXPECT_EQ(report.phases > 1, phases_needed) << report.phases << " phases";
    if (report.pipelined) EXPECT_GT(report.phases, 1u) << "pipelined: two phases at least";
    if (!on_gpu()) EXPECT_FALSE(report.pipelined) << "no pipeline without a GPU";
    result.pipelined = result.pipelined || report.pipelined;
    result.phases = std::max(result.phases, report.phases);
    result.staging_bytes = std::max(result.staging_bytes, report.staging_bytes);
    EXPECT_EQ(report.locally_converted_bytes, locally_converted)
        << "refit " << refit << ": local ops of transformed parameters converted in place";
    // What crossed the wire from this rank: FP8 data and one scale per 32 elements where the
    // sender quantizes (bf16 parameters: half the bytes, and a 64th).
    if (mode == Mode::kPlain || mode == Mode::kMxSender || mode == Mode::kMxReceiver) {
      std::uint64_t wire = 0;
      for (const TransferOp& op : plan->ops()) {
        if (op.src_pe != me || op.local()) continue;
        const bool quantized = mode != Mode::kPlain && sender_quantizes(op) &&
                               transform->should_transform(plan->params()[op.param]);
        wire += quantized ? op.bytes / 2 + op.bytes / 64 : op.bytes;
      }
      EXPECT_EQ(report.bytes_sent, wire) << "refit " << refit;
    }
    if (mode == Mode::kPlain) {
      // Strided slices travel in place, row by row, where the transport allows; else packed.
      const std::uint64_t strided = strided_slice_bytes(*plan, me);
      EXPECT_EQ(report.strided_bytes,
                execution::ServiceSlot::moves_rows_in_place(service) ? strided : 0);
      EXPECT_EQ(report.packed_bytes,
                execution::ServiceSlot::moves_rows_in_place(service) ? 0 : strided);
    }
    EXPECT_EQ(verify(*plan, me, tensors, expected), 0u) << "refit " << refit;
    // Poison the destination so the next refit must write it again.
    for (auto& [name, memory] : tensors.dst) {
      memory->upload(std::vector<std::byte>(memory->download().size(), std::byte{0xee}));
    }
  }
  // The last refit again, its tensors taken as they were: nothing scheduled, a built-in
  // transform's conversions replayed, every byte written again.
  const ReshardReport rerun = rerun_reshard_plan(plan, service, transform);
  EXPECT_FALSE(rerun.rescheduled);
  EXPECT_EQ(rerun.timing.check_seconds + rerun.timing.agree_seconds, 0.0)
      << "a rerun checks nothing";
  EXPECT_EQ(rerun.conversions_replayed, mode != Mode::kPlain);
  EXPECT_EQ(rerun.locally_converted_bytes, locally_converted);
  EXPECT_EQ(verify(*plan, me, generations.back(), expected), 0u) << "rerun";
  return result;
}

ModelSpec test_model(bool moe) { return toy_model(2, 256, moe ? 4 : 0); }

class Reshard : public testing::TestWithParam<Mode> {};

TEST_P(Reshard, EveryDestinationElementMatchesItsReference) {
  auto service = make_service();
  for (const Case& c : cases_for(service->n_pes())) {
    const bool moe = c.src.ep > 1 || c.dst.ep > 1;
    // 128 x 128 tiles of the toy MLP weights stay whole up to 4-way splits.
    const bool block = GetParam() == Mode::kBlockReceiver || GetParam() == Mode::kBlockSender;
    if (block && (c.src.tp > 4 || c.dst.tp > 4)) continue;
    run_case(*service, test_model(moe), c, GetParam());
  }
  EXPECT_TRUE(all_pes(!HasFailure()));
}

INSTANTIATE_TEST_SUITE_P(Modes, Reshard,
                         testing::Values(Mode::kPlain, Mode::kCastFp32, Mode::kFp32Wire,
                                         Mode::kMxReceiver, Mode::kMxSender, Mode::kBlockReceiver,
                                         Mode::kBlockSender),
                         [](const auto& info) {
                           std::string name = mode_name(info.param);
                           for (char& ch : name) ch = ch == '-' ? '_' : ch;
                           return name;
                         });

// A budget that holds one op but not the refit: the refits run in phases that reuse the same
// staging, the memory held stays within the budget, and every element still matches. Plain bf16
// on a transport that moves rows in place needs no staging: it runs within a budget of 0.
class ReshardInPhases : public testing::TestWithParam<Mode> {};

TEST_P(ReshardInPhases, EveryDestinationElementMatchesWithinASmallBudget) {
  auto service = make_service();
  // Every case refits four times: 1-4 PEs cover the phases; 8 would double the suite's time.
  if (service->n_pes() > 4) GTEST_SKIP() << "covered at 1-4 PEs";
  std::uint32_t most_phases = 1;
  std::uint64_t most_staging = 0;
  for (const Case& c : cases_for(service->n_pes())) {
    const bool moe = c.src.ep > 1 || c.dst.ep > 1;
    const bool block = GetParam() == Mode::kBlockReceiver || GetParam() == Mode::kBlockSender;
    if (block && (c.src.tp > 4 || c.dst.tp > 4)) continue;
    const CaseResult result = run_case(*service, test_model(moe), c, GetParam(), true);
    most_phases = std::max(most_phases, result.phases);
    most_staging = std::max(most_staging, result.staging_bytes);
  }
  if (GetParam() == Mode::kPlain && execution::ServiceSlot::moves_rows_in_place(*service)) {
    EXPECT_EQ(most_phases, 1u);
    EXPECT_EQ(most_staging, 0u);
  } else if (GetParam() != Mode::kPlain && service->n_pes() % 2 == 0) {
    EXPECT_GT(most_phases, 1u) << "the budget was meant to be smaller than a refit";
  }
  EXPECT_TRUE(all_pes(!HasFailure()));
}

// On GPUs of their own, where bytes land in staging that is read again (conversions on arrival;
// packed slices on transports that do not move rows in place), a budget of two ops: the phases
// alternate between its halves, each phase's arrivals read beside the next phase's transfer, and
// every element still matches.
TEST_P(ReshardInPhases, PipelinedPhasesMatchEveryDestinationElement) {
  auto service = make_service();
  if (!on_gpu()) GTEST_SKIP() << "a pipeline needs GPU streams";
  if (service->n_pes() > 4) GTEST_SKIP() << "covered at 1-4 PEs";
  const Mode mode = GetParam();
  const bool reads_arrivals =
      mode == Mode::kMxReceiver ||
      (mode == Mode::kPlain && !execution::ServiceSlot::moves_rows_in_place(*service));
  if (!reads_arrivals) GTEST_SKIP() << "nothing is read after it lands";
  const std::string gpu = my_gpu_uuid();
  std::set<std::string> gpus;
  for (const auto& part : service->all_gather(std::as_bytes(std::span(gpu))))
    gpus.emplace(reinterpret_cast<const char*>(part.data()), part.size());
  if (gpus.size() < static_cast<std::size_t>(service->n_pes()))
    GTEST_SKIP() << "PEs share a GPU: their phases run one after the other";
  // Every refit that runs in phases pipelines them. How many do depends on the transport: one
  // that sends contiguous slices straight from and into the tensors (NCCL) stages only the packed
  // ones, and a plain refit of few PEs may fit the budget whole.
  bool pipelined = false;
  for (const Case& c : cases_for(service->n_pes())) {
    const bool moe = c.src.ep > 1 || c.dst.ep > 1;
    const CaseResult result = run_case(*service, test_model(moe), c, mode, true, 2);
    EXPECT_EQ(result.pipelined, result.phases > 1) << c.name << ": " << result.phases << " phases";
    pipelined = result.pipelined || pipelined;
  }
  if (service->n_pes() % 2 == 0 && mode != Mode::kPlain)
    EXPECT_TRUE(pipelined) << "no refit ran pipelined";
  EXPECT_TRUE(all_pes(!HasFailure()));
}

// Every kind of staging: packed slices (plain, where rows do not move in place), the sender's
// wire (fp32 cast, MXFP8, block FP8) and the receiver's (MXFP8 on arrival; the bf16-wire cast and
// block FP8 on arrival stage the same way).
INSTANTIATE_TEST_SUITE_P(Modes, ReshardInPhases,
                         testing::Values(Mode::kPlain, Mode::kFp32Wire, Mode::kMxReceiver,
                                         Mode::kMxSender, Mode::kBlockSender),
                         [](const auto& info) {
                           std::string name = mode_name(info.param);
                           for (char& ch : name) ch = ch == '-' ? '_' : ch;
                           return name;
                         });

// A MoE model of 1,152 small expert weights, every rank receiving all of them: more ops than a
// transform launches at once (512 jobs), so on GPUs the conversions go in batches while the hooks
// still run; replicas of a slice come from one conversion on the sender.
TEST(ReshardBatches, ManySmallWeightsAreConvertedInBatches) {
  auto service = make_service();
  const int n = service->n_pes();
  const ModelSpec model = toy_model(4, 64, 96);  // 1,152 expert weights
  const Case c{"ep " + std::to_string(n) + " -> tp 1 x " + std::to_string(n),
               {.dp = n, .ep = n},
               {.replicas = n}};
  for (Mode mode : {Mode::kMxSender, Mode::kMxReceiver, Mode::kFp32Wire}) {
    run_case(*service, model, c, mode);
  }
  // In phases: a slice converted once for several replicas shares its wire only within a phase.
  if (n <= 4) run_case(*service, model, c, Mode::kMxSender, true);
  EXPECT_TRUE(all_pes(!HasFailure()));
}

// The experts spread over the n PEs (the rest of the weights on each) -> a whole replica on each.
std::shared_ptr<const ReshardPlan> experts_to_replicas(const ModelSpec& model, int n) {
  return std::make_shared<const ReshardPlan>(make_reshard_plan(
      build_layout(model, {.dp = n, .ep = n}), build_layout(model, {.replicas = n})));
}

// Thousands of tensors a rank, which a refit checks against its schedule: one tensor given new
// storage, first, last or between in the plan, on either side and on one rank alone, makes every
// rank schedule again, and its bytes land in the new storage.
TEST(ReshardReuse, OneNewTensorAmongThousandsIsScheduledAgain) {
  auto service = make_service();
  const int n = service->n_pes();
  const PeId me = service->my_pe();
  const ModelSpec model = toy_model(2, 16, 768);  // 3,072 small expert weights
  const auto plan = experts_to_replicas(model, n);
  const auto expected = expectations(*plan, Mode::kPlain, nullptr);
  RankTensors tensors = make_tensors(*plan, me, my_device(), expected, nullptr);
  ASSERT_GT(tensors.dst_map.size(), 3000u);
  EXPECT_TRUE(execute_reshard_plan(plan, tensors.src_map, tensors.dst_map, *service).rescheduled);
  EXPECT_EQ(verify(*plan, me, tensors, expected), 0u);
  // The plan's first parameter, one a third in, its last; each side in turn, changed on
  // one rank that holds it (in turn, where several do).
  const std::size_t count = plan->params().size();
  int change = 0;
  std::vector<std::unique_ptr<TestMemory>> replaced;  // alive to the end: no address comes back
  for (const std::size_t at : {std::size_t{0}, count / 3, count - 1}) {
    const auto p = static_cast<std::uint32_t>(at);
    const std::string& name = plan->params()[p].name;
    for (const bool source : {true, false}) {
      SCOPED_TRACE(name + (source ? " (source)" : " (destination)"));
      const Layout& layout = source ? plan->src_layout() : plan->dst_layout();
      std::vector<PeId> holders;
      for (PeId pe = 0; pe < n; ++pe) {
        if (layout.find_shard(pe, p) != nullptr) holders.push_back(pe);
      }
      ASSERT_FALSE(holders.empty());
      if (me == holders[change++ % holders.size()]) {
        auto& memory = source ? tensors.src : tensors.dst;
        auto fresh = std::make_unique<TestMemory>(memory.at(name)->download().size(), my_device());
        if (source) fresh->upload(memory.at(name)->download());
        (source ? tensors.src_map : tensors.dst_map).at(name).data = fresh->buffer();
        replaced.push_back(std::exchange(memory.at(name), std::move(fresh)));
      }
      for (auto& [dst_name, dst_memory] : tensors.dst) {  // every byte must be written again
        dst_memory->upload(std::vector<std::byte>(dst_memory->download().size(), std::byte{0xee}));
      }
      EXPECT_TRUE(
          execute_reshard_plan(plan, tensors.src_map, tensors.dst_map, *service).rescheduled);
      EXPECT_EQ(verify(*plan, me, tensors, expected), 0u) << "the refit after the change";
      EXPECT_FALSE(
          execute_reshard_plan(plan, tensors.src_map, tensors.dst_map, *service).rescheduled);
      EXPECT_EQ(verify(*plan, me, tensors, expected), 0u) << "the refit after that";
    }
  }
  EXPECT_TRUE(all_pes(!HasFailure()));
}

// An FP8 destination given a new scale buffer alone (the same data buffer) on one rank: every
// rank schedules again, and the scales land in the new buffer.
TEST(ReshardReuse, ANewScaleBufferAloneIsScheduledAgain) {
  auto service = make_service();
  const int n = service->n_pes();
  const PeId me = service->my_pe();
  const ModelSpec model = test_model(false);
  auto plan = std::make_shared<const ReshardPlan>(
      make_reshard_plan(build_layout(model, {.dp = n}), build_layout(model, {.replicas = n})));
  auto transform = transform_for(Mode::kMxReceiver);
  const auto expected = expectations(*plan, Mode::kMxReceiver, transform.get());
  RankTensors tensors = make_tensors(*plan, me, my_device(), expected, transform.get());
  ASSERT_FALSE(tensors.dst_scale.empty());
  execute_reshard_plan(plan, tensors.src_map, tensors.dst_map, *service, transform);
  EXPECT_EQ(verify(*plan, me, tensors, expected), 0u);
  const std::string name = tensors.dst_scale.rbegin()->first;
  std::unique_ptr<TestMemory> old_scale;  // alive to the end: its address does not come back
  if (me == n - 1) {
    auto& scale = tensors.dst_scale.at(name);
    auto fresh = std::make_unique<TestMemory>(scale->download().size(), my_device());
    tensors.dst_map.at(name).scale = fresh->buffer();
    old_scale = std::exchange(scale, std::move(fresh));
  }
  const ReshardReport report =
      execute_reshard_plan(plan, tensors.src_map, tensors.dst_map, *service, transform);
  EXPECT_TRUE(report.rescheduled);
  EXPECT_EQ(verify(*plan, me, tensors, expected), 0u) << "the scales of '" << name << "'";
  EXPECT_TRUE(all_pes(!HasFailure()));
}

// A refit's maps built again, as the Python binding builds them at every call: with the same
// entries, in their order or in another, or with a tensor the plan does not use beside them, every
// rank runs its schedule again; with one entry given new storage on one rank, every rank schedules
// again, and then reuses that. Every byte lands each time.
TEST(ReshardReuse, MapsBuiltAgainAreCheckedEntryByEntry) {
  auto service = make_service();
  const int n = service->n_pes();
  const PeId me = service->my_pe();
  const ModelSpec model = toy_model(2, 8, 240);
  const auto plan = experts_to_replicas(model, n);
  const auto expected = expectations(*plan, Mode::kPlain, nullptr);
  RankTensors tensors = make_tensors(*plan, me, my_device(), expected, nullptr);
  ReshardOptions extras;  // maps below hold a tensor the plan does not have
  extras.allow_unknown_names = true;
  EXPECT_TRUE(execute_reshard_plan(plan, tensors.src_map, tensors.dst_map, *service, nullptr,
                                   nullptr, extras)
                  .rescheduled);
  EXPECT_EQ(verify(*plan, me, tensors, expected), 0u);
  const auto refit = [&](const TensorMap& src, const TensorMap& dst, const char* what) {
    SCOPED_TRACE(what);
    for (auto& [name, memory] : tensors.dst) {  // every byte must be written again
      memory->upload(std::vector<std::byte>(memory->download().size(), std::byte{0xee}));
    }
    const bool rescheduled =
        execute_reshard_plan(plan, src, dst, *service, nullptr, nullptr, extras).rescheduled;
    EXPECT_EQ(verify(*plan, me, tensors, expected), 0u);
    return rescheduled;
  };
  const auto built_again = [](const TensorMap& map, bool reversed) {
    std::vector<std::pair<std::string, LocalTensor>> entries(map.begin(), map.end());
    if (reversed) std::reverse(entries.begin(), entries.end());
    TensorMap copy;
    for (const auto& entry : entries) copy.insert(entry);
    return copy;
  };
  EXPECT_FALSE(refit(tensors.src_map, tensors.dst_map, "the same maps"));
  EXPECT_FALSE(refit(built_again(tensors.src_map, false), built_again(tensors.dst_map, false),
                     "built again"));
  EXPECT_FALSE(refit(built_again(tensors.src_map, true), built_again(tensors.dst_map, true),
                     "built again in the other order"));
  TensorMap more = tensors.src_map;
  more.emplace("not.in.the.plan", tensors.src_map.begin()->second);
  EXPECT_FALSE(refit(more, tensors.dst_map, "with a tensor the plan does not use"));
  // The last destination, new storage on the last rank, in a map built again.
  TensorMap changed = built_again(tensors.dst_map, false);
  const std::string name = tensors.dst.rbegin()->first;
  std::unique_ptr<TestMemory> old;  // alive to the end: its address does not come back
  if (me == n - 1) {
    auto& memory = tensors.dst.at(name);
    auto fresh = std::make_unique<TestMemory>(memory->download().size(), my_device());
    changed.at(name).data = fresh->buffer();
    old = std::exchange(memory, std::move(fresh));
  }
  EXPECT_TRUE(refit(tensors.src_map, changed, "one destination in new storage"));
  EXPECT_FALSE(refit(tensors.src_map, changed, "the same maps after that"));
  // Maps holding a tensor the plan does not use (a rank handed more than it moves), kept from
  // refit to refit: they run again; a used tensor given new storage in the kept map, on one rank,
  // schedules again (first, last, and then with the unused tensor in other storage too).
  EXPECT_FALSE(refit(more, changed, "a source map with an unused tensor"));
  std::vector<std::unique_ptr<TestMemory>> replaced;  // alive to the end: no address comes back
  const auto new_storage = [&](const std::string& source, PeId on) {
    if (me != on) return;
    auto& memory = tensors.src.at(source);
    auto fresh = std::make_unique<TestMemory>(memory->download().size(), my_device());
    fresh->upload(memory->download());
    more.at(source).data = fresh->buffer();
    replaced.push_back(std::exchange(memory, std::move(fresh)));
  };
  new_storage(tensors.src.begin()->first, 0);
  EXPECT_TRUE(refit(more, changed, "the first source in new storage, beside an unused tensor"));
  EXPECT_FALSE(refit(more, changed, "the same maps with an unused tensor"));
  new_storage(tensors.src.rbegin()->first, n - 1);
  EXPECT_TRUE(refit(more, changed, "the last source in new storage, beside an unused tensor"));
  more.at("not.in.the.plan").data = changed.begin()->second.data;
  EXPECT_FALSE(refit(more, changed, "the unused tensor in other storage"));
  new_storage(tensors.src.begin()->first, n - 1);
  EXPECT_TRUE(refit(more, changed, "the first source in new storage again"));
  EXPECT_TRUE(all_pes(!HasFailure()));
}

// What `call` throws, or nullopt where it throws nothing.
template <typename Call>
std::optional<Error> error_of(Call&& call) {
  try {
    call();
  } catch (const Error& error) {
    return error;
  }
  return std::nullopt;
}

// The error this PE's refit of `t` is refused with; a test failure where the refit ran.
std::optional<Error> refusal_of(CopyService& service,
                                const std::shared_ptr<const ReshardPlan>& plan,
                                const RankTensors& t,
                                std::shared_ptr<ReshardTransform> transform = nullptr) {
  std::optional<Error> refused = error_of(
      [&] { execute_reshard_plan(plan, t.src_map, t.dst_map, service, std::move(transform)); });
  if (!refused) ADD_FAILURE() << "expected a refusal";
  return refused;
}

TEST(ReshardErrors, MissingTensorIsNamedBeforeAnyByteMoves) {
  auto service = make_service();
  const ModelSpec model = test_model(false);
  // Every rank copies its own replica of every weight, so every rank refuses on its own.
  const int n = service->n_pes();
  auto plan = std::make_shared<const ReshardPlan>(
      make_reshard_plan(build_layout(model, {.dp = n}), build_layout(model, {.replicas = n})));
  const std::map<std::string, Expected> expected = expectations(*plan, Mode::kPlain, nullptr);
  RankTensors t = make_tensors(*plan, service->my_pe(), my_device(), expected, nullptr);
  t.src_map.erase("layers.1.mlp.down_proj.weight");
  if (const auto error = refusal_of(*service, plan, t)) {
    EXPECT_EQ(error->code(), ErrorCode::kInvalidArgument);
    EXPECT_NE(
        std::string(error->what()).find("no source tensor for 'layers.1.mlp.down_proj.weight'"),
        std::string::npos)
        << error->what();
  }
  EXPECT_TRUE(all_pes(!HasFailure()));
}

// A budget smaller than one slice's wire buffers is refused on every rank before anything moves,
// naming the slice, the rank and what it needs; the service stays usable. Ranks that pass
// different budgets are told so.
TEST(ReshardErrors, ABudgetTooSmallForOneSliceIsRefusedNamingIt) {
  auto service = make_service();
  const int n = service->n_pes();
  // Quantized by the sender, a slice sent to several replicas stages its FP8 wire buffers (a
  // slice kept only by its own rank is converted in place, with no staging).
  const int tp = n & -n;
  if (tp < 2) GTEST_SKIP() << "needs a tensor-parallel split";
  const ModelSpec model = test_model(false);
  auto plan = std::make_shared<const ReshardPlan>(make_reshard_plan(
      build_layout(model, {.tp = tp, .dp = n / tp}), build_layout(model, {.replicas = n})));
  auto transform = make_mxfp8_transform(QuantizeSide::kSender, MxScaleRounding::kRoundUp);
  const std::map<std::string, Expected> expected =
      expectations(*plan, Mode::kMxSender, transform.get());
  RankTensors t = make_tensors(*plan, service->my_pe(), my_device(), expected, transform.get());
  auto refusal = [&](std::uint64_t budget, std::uint64_t other_ranks_budget) {
    ReshardOptions options;
    options.staging_budget = service->my_pe() == 0 ? budget : other_ranks_budget;
    try {
      execute_reshard_plan(plan, t.src_map, t.dst_map, *service, transform, nullptr, options);
    } catch (const Error& error) {
      EXPECT_EQ(error.code(), ErrorCode::kInvalidArgument);
      return std::string(error.what());
    }
    return std::string();
  };
  const std::string too_small = refusal(1000, 1000);
  EXPECT_NE(too_small.find("the staging budget of 1000 B per PE is smaller than '"),
            std::string::npos)
      << too_small;
  EXPECT_NE(too_small.find("needs on PE "), std::string::npos) << too_small;
  EXPECT_NE(too_small.find("RESHARD_STAGING_BUDGET"), std::string::npos) << too_small;
  if (n > 1) {
    const std::string differ = refusal(1 << 20, 2 << 20);
    EXPECT_NE(differ.find("the staging budget differs between PEs"), std::string::npos) << differ;
    ReshardOptions mixed;
    mixed.quantize_colocated_on_sender = service->my_pe() == 0;
    try {
      execute_reshard_plan(plan, t.src_map, t.dst_map, *service, transform, nullptr, mixed);
      ADD_FAILURE() << "ranks disagreeing on quantize_colocated_on_sender were not refused";
    } catch (const Error& error) {
      EXPECT_EQ(error.code(), ErrorCode::kInvalidArgument);
      EXPECT_NE(std::string(error.what()).find("quantize_colocated_on_sender differs between PEs"),
                std::string::npos)
          << error.what();
    }
  }
  // Nothing moved (destinations hold what TestMemory filled them with), and the same tensors
  // refit within a budget that fits.
  for (auto& [name, memory] : t.dst) {
    const std::vector<std::byte> bytes = memory->download();
    EXPECT_EQ(std::count(bytes.begin(), bytes.end(), std::byte{0xcd}),
              static_cast<std::ptrdiff_t>(bytes.size()))
        << "'" << name << "' was written by a refused refit";
  }
  ReshardOptions fits;
  fits.staging_budget = small_budget(*plan, transform.get(), Mode::kMxSender);
  execute_reshard_plan(plan, t.src_map, t.dst_map, *service, transform, nullptr, fits);
  EXPECT_EQ(verify(*plan, service->my_pe(), t, expected), 0u);
  EXPECT_TRUE(all_pes(!HasFailure()));
}

TEST(ReshardErrors, MisalignedMxSlicesAreRefusedNamingTheRegion) {
  auto service = make_service();
  const int tp = service->n_pes() & -service->n_pes();
  if (tp < 2) GTEST_SKIP() << "needs a tensor-parallel split";
  const ModelSpec model = toy_model(1, 32);  // o_proj [32, 32] split on its last dimension
  auto plan = std::make_shared<const ReshardPlan>(
      make_reshard_plan(build_layout(model, {.tp = tp}), build_layout(model, {.tp = 1})));
  auto transform = make_mxfp8_transform(QuantizeSide::kSender, MxScaleRounding::kOcp, "o_proj");
  const std::map<std::string, Expected> expected =
      expectations(*plan, Mode::kMxSender, transform.get());
  RankTensors t = make_tensors(*plan, service->my_pe(), my_device(), expected, transform.get());
  if (const auto error = refusal_of(*service, plan, t, transform)) {
    const std::string what = error->what();
    EXPECT_NE(what.find("multiples of 32"), std::string::npos) << what;
    EXPECT_NE(what.find("o_proj"), std::string::npos) << what;
  }
  EXPECT_TRUE(all_pes(!HasFailure()));
}

// A tensor-parallel split that cuts block FP8's 128 x 128 tiles (o_proj [192, 192] split in two
// on its last dimension: 96 columns a rank) is refused before anything moves, naming the
// parameter, the cut and the way out (the transform's name filter).
TEST(ReshardErrors, BlockFp8SlicesThatCutTilesAreRefusedNamingTheWayOut) {
  auto service = make_service();
  if (service->n_pes() != 2) GTEST_SKIP() << "the split is for 2 ranks";
  const ModelSpec model = toy_model(1, 192);
  auto plan = std::make_shared<const ReshardPlan>(
      make_reshard_plan(build_layout(model, {.tp = 2}), build_layout(model, {.tp = 1})));
  auto transform = make_fp8_block_transform(QuantizeSide::kSender, "o_proj");
  const std::map<std::string, Expected> expected =
      expectations(*plan, Mode::kBlockSender, transform.get());
  RankTensors t = make_tensors(*plan, service->my_pe(), my_device(), expected, transform.get());
  if (const auto error = refusal_of(*service, plan, t, transform)) {
    const std::string what = error->what();
    EXPECT_EQ(error->code(), ErrorCode::kInvalidArgument);
    EXPECT_NE(what.find("o_proj"), std::string::npos) << what;
    EXPECT_NE(what.find("cuts 128 x 128 tiles"), std::string::npos) << what;
    EXPECT_NE(what.find("name filter"), std::string::npos) << what;
  }
  EXPECT_TRUE(all_pes(!HasFailure()));
}

// Sends two wire buffers per op but receives into one: both sides reach schedule(), which must
// refuse naming the parameter and the mismatch rather than move anything.
class LopsidedTransform final : public ReshardTransform {
 public:
  std::string name() const override { return "lopsided"; }
  bool should_transform(const ParamSpec& param) const override {
    return param.name == "norm.weight";
  }
  std::vector<Buffer> prepare_send(const OpSlice& slice, const LocalTensor& src, void*) override {
    const std::size_t half = slice.op.bytes / 2;
    return {Buffer{src.data.data, half, src.data.kind, src.data.device},
            Buffer{static_cast<std::byte*>(src.data.data) + half, slice.op.bytes - half,
                   src.data.kind, src.data.device}};
  }
  std::vector<Buffer> prepare_recv(const OpSlice& slice, const LocalTensor& dst) override {
    return {Buffer{dst.data.data, slice.op.bytes, dst.data.kind, dst.data.device}};
  }
  void finalize_recv(const OpSlice&, const LocalTensor&, std::span<const Buffer>, void*) override {}
};

TEST(ReshardErrors, TransformsThatDisagreeOnWireBuffersAreRefused) {
  auto service = make_service();
  if (service->n_pes() < 2) GTEST_SKIP() << "needs two ranks";
  const ModelSpec model = test_model(false);
  // norm.weight lives on the last stage (PE 1) and moves to PE 0.
  auto plan = std::make_shared<const ReshardPlan>(
      make_reshard_plan(build_layout(model, {.pp = 2}), build_layout(model, {.first_pe = 0})));
  const std::map<std::string, Expected> expected = expectations(*plan, Mode::kPlain, nullptr);
  RankTensors t = make_tensors(*plan, service->my_pe(), my_device(), expected, nullptr);
  if (const auto error = refusal_of(*service, plan, t, std::make_shared<LopsidedTransform>())) {
    EXPECT_EQ(error->code(), ErrorCode::kValidation);
    const std::string text = error->what();
    EXPECT_NE(text.find("wire buffer 1 of 2 of 'norm.weight'"), std::string::npos) << text;
    EXPECT_NE(text.find("wire buffer 1 of 1 of 'norm.weight'"), std::string::npos) << text;
  }
  EXPECT_TRUE(all_pes(!HasFailure()));
}

// A tensor of the right size but the wrong shape (a transposed view of the same bytes, a
// destination with a row too many) would scramble the parameter: every PE refuses it before
// anything is registered, naming the parameter, the rank and both shapes, and the same service
// then runs the correct refit.
TEST(ReshardErrors, ATensorOfTheWrongShapeIsRefusedBeforeAnyByteMoves) {
  auto service = make_service();
  const PeId me = service->my_pe();
  const ModelSpec model = test_model(false);
  const int n = service->n_pes(), tp = n & -n;
  auto plan = std::make_shared<const ReshardPlan>(make_reshard_plan(
      build_layout(model, {.tp = tp, .dp = n / tp}), build_layout(model, {.replicas = n})));
  const std::map<std::string, Expected> expected = expectations(*plan, Mode::kPlain, nullptr);
  RankTensors t = make_tensors(*plan, me, my_device(), expected, nullptr);
  // A 2-D parameter whose local shapes on both sides are not square.
  std::string name;
  for (std::uint32_t p = 0; p < plan->params().size() && name.empty(); ++p) {
    const Shard* from = plan->src_layout().find_shard(me, p);
    const Shard* to = plan->dst_layout().find_shard(me, p);
    if (from && to && from->local_shape.size() == 2 &&
        from->local_shape[0] != from->local_shape[1] && to->local_shape.size() == 2)
      name = plan->params()[p].name;
  }
  ASSERT_FALSE(name.empty());
  auto expect_refusal = [&](TensorMap src, TensorMap dst, const std::string& role,
                            const std::vector<std::int64_t>& given,
                            const std::vector<std::int64_t>& wanted) {
    try {
      execute_reshard_plan(plan, src, dst, *service);
      ADD_FAILURE() << "a " << role << " of shape " << shape_str(given) << " was accepted";
    } catch (const Error& error) {
      EXPECT_EQ(error.code(), ErrorCode::kInvalidArgument);
      const std::string text = error.what();
      for (const std::string& part :
           {role + " tensor '" + name + "'", "PE " + std::to_string(me),
            "shape " + shape_str(given), "local shape is " + shape_str(wanted)})
        EXPECT_NE(text.find(part), std::string::npos) << part << " not in: " << text;
    }
  };
  TensorMap transposed = t.src_map;
  auto& source_shape = transposed[name].shape;
  std::swap(source_shape[0], source_shape[1]);
  expect_refusal(transposed, t.dst_map, "source", source_shape, t.src_map[name].shape);
  TensorMap taller = t.dst_map;
  taller[name].shape[0] += 1;
  expect_refusal(t.src_map, taller, "destination", taller[name].shape, t.dst_map[name].shape);

  execute_reshard_plan(plan, t.src_map, t.dst_map, *service);
  EXPECT_EQ(verify(*plan, me, t, expected), 0u);
  // Once a refit ran, the same buffers under another shape are not taken for the same tensors:
  // refused as before, and the correct refit runs again after it.
  expect_refusal(transposed, t.dst_map, "source", source_shape, t.src_map[name].shape);
  execute_reshard_plan(plan, t.src_map, t.dst_map, *service);
  EXPECT_EQ(verify(*plan, me, t, expected), 0u);
  EXPECT_TRUE(all_pes(!HasFailure()));
}

// rerun_reshard_plan needs a refit of the plan executed on the service first: refused, naming
// what to call, before one and after clear_requests() dropped it; the service stays usable.
TEST(ReshardErrors, ARerunWithoutAnExecutedRefitIsRefused) {
  auto service = make_service();
  const PeId me = service->my_pe();
  const int n = service->n_pes();
  const ModelSpec model = test_model(false);
  auto plan = std::make_shared<const ReshardPlan>(
      make_reshard_plan(build_layout(model, {.dp = n}), build_layout(model, {.replicas = n})));
  const std::map<std::string, Expected> expected = expectations(*plan, Mode::kPlain, nullptr);
  RankTensors t = make_tensors(*plan, me, my_device(), expected, nullptr);
  auto expect_refused = [&](const char* when) {
    try {
      rerun_reshard_plan(plan, *service);
      ADD_FAILURE() << "a rerun " << when << " ran";
    } catch (const Error& error) {
      EXPECT_EQ(error.code(), ErrorCode::kInvalidState) << when;
      EXPECT_NE(std::string(error.what()).find("call execute_reshard_plan"), std::string::npos)
          << when << ": " << error.what();
    }
  };
  expect_refused("before any refit");
  execute_reshard_plan(plan, t.src_map, t.dst_map, *service);
  EXPECT_EQ(verify(*plan, me, t, expected), 0u);
  service->clear_requests();
  expect_refused("after clear_requests()");
  execute_reshard_plan(plan, t.src_map, t.dst_map, *service);
  rerun_reshard_plan(plan, *service);
  EXPECT_EQ(verify(*plan, me, t, expected), 0u);
  EXPECT_TRUE(all_pes(!HasFailure()));
}

// Ranks that built their plans from different layouts are told so on every rank, before any
// request is registered, rather than being handed a list of unmatched task ids.
TEST(ReshardErrors, RanksWithDifferentPlansAreToldSo) {
  auto service = make_service();
  const PeId me = service->my_pe();
  const int n = service->n_pes();
  if (n < 2) GTEST_SKIP() << "needs two ranks";
  const ModelSpec model = test_model(false);
  const Parallelism engine = me == n - 1 ? Parallelism{} : Parallelism{.replicas = n};
  auto plan = std::make_shared<const ReshardPlan>(
      make_reshard_plan(build_layout(model, {.dp = n}), build_layout(model, engine)));
  const std::map<std::string, Expected> expected = expectations(*plan, Mode::kPlain, nullptr);
  RankTensors t = make_tensors(*plan, me, my_device(), expected, nullptr);
  try {
    execute_reshard_plan(plan, t.src_map, t.dst_map, *service);
    ADD_FAILURE() << "plans that differ between ranks were accepted";
  } catch (const Error& error) {
    EXPECT_EQ(error.code(), ErrorCode::kValidation);
    const std::string text = error.what();
    EXPECT_NE(text.find("the reshard plan differs between PEs"), std::string::npos) << text;
    EXPECT_NE(text.find("the first parameter whose transfers differ is '"), std::string::npos)
        << text;
  }
  EXPECT_TRUE(all_pes(!HasFailure()));
}

// ---- the bound refit (Refit): bind once, run many ----

// A MoE model's experts spread over the ranks (the rest of the weights on each) to a replica on
// every rank: every rank sends to every other one.
std::shared_ptr<const ReshardPlan> dp_to_replicas(int n) {
  return experts_to_replicas(toy_model(2, 64, 24), n);
}

// The bound-refit tests' refit in one mode on this rank: dp_to_replicas(n), the mode's transform,
// the values every destination must hold, and this rank's tensors.
struct ModeRefit {
  std::shared_ptr<const ReshardPlan> plan;
  std::shared_ptr<ReshardTransform> transform;
  std::map<std::string, Expected> expected;
  RankTensors tensors;
};

ModeRefit mode_refit(Mode mode, PeId me, int n) {
  ModeRefit r{dp_to_replicas(n), transform_for(mode), {}, {}};
  r.expected = expectations(*r.plan, mode, r.transform.get());
  r.tensors = make_tensors(*r.plan, me, my_device(), r.expected, r.transform.get());
  return r;
}

// Without a transform, a cast, MXFP8 quantized on arrival.
constexpr Mode kBoundRefitModes[] = {Mode::kPlain, Mode::kCastFp32, Mode::kMxReceiver};

void poison(RankTensors& tensors) {
  for (auto& [name, memory] : tensors.dst)
    memory->upload(std::vector<std::byte>(memory->download().size(), std::byte{0xee}));
}

// Runs a bound refit into poisoned destinations: every byte must be written again, as expected.
void expect_run_writes_all(Refit& refit, const ReshardPlan& plan, PeId me, RankTensors& tensors,
                           const std::map<std::string, Expected>& expected,
                           const std::string& when) {
  poison(tensors);
  refit.run();
  EXPECT_EQ(verify(plan, me, tensors, expected), 0u) << when;
}

// On the last PE, the last destination moved into new memory (the old one kept alive in
// `old`): the map to update() a refit with (empty on the other PEs).
TensorMap last_destination_moved_on_last_pe(RankTensors& tensors, PeId me, int n,
                                            std::unique_ptr<TestMemory>& old) {
  TensorMap changed;
  if (me != n - 1) return changed;
  const std::string name = tensors.dst.rbegin()->first;
  auto fresh = std::make_unique<TestMemory>(tensors.dst.at(name)->download().size(), my_device());
  LocalTensor tensor = tensors.dst_map.at(name);
  tensor.data = fresh->buffer();
  tensors.dst_map.at(name) = tensor;
  changed.emplace(name, tensor);
  old = std::exchange(tensors.dst.at(name), std::move(fresh));
  return changed;
}

// Bound once, a refit runs with nothing checked, every byte written again at every run, with a
// transform converting on the wire; update() of one tensor on one rank schedules again on every
// rank, and one that changes nothing on any rank does not.
TEST(BoundRefit, RunsAgainAndUpdatesOneTensor) {
  auto service = make_service();
  const PeId me = service->my_pe();
  const int n = service->n_pes();
  for (const Mode mode : kBoundRefitModes) {
    SCOPED_TRACE(mode_name(mode));
    ModeRefit refit_of_mode = mode_refit(mode, me, n);
    auto& [plan, transform, expected, tensors] = refit_of_mode;
    Refit refit(plan, tensors.src_map, tensors.dst_map, *service, transform);
    EXPECT_TRUE(refit.report().rescheduled);
    for (int run = 0; run < 3; ++run) {
      poison(tensors);
      const ReshardReport report = refit.run();
      EXPECT_FALSE(report.rescheduled);
      EXPECT_EQ(report.timing.check_seconds + report.timing.agree_seconds, 0.0)
          << "a run checks nothing";
      EXPECT_EQ(verify(*plan, me, tensors, expected), 0u) << "run " << run;
    }
    // One destination in new storage on the last rank: every rank schedules again, and the
    // bytes land in the new storage.
    std::unique_ptr<TestMemory> old;
    EXPECT_TRUE(
        refit.update({}, last_destination_moved_on_last_pe(tensors, me, n, old)).rescheduled);
    expect_run_writes_all(refit, *plan, me, tensors, expected, "after the update");
    // The same tensors again: one small all-gather, nothing scheduled.
    EXPECT_FALSE(refit.update(tensors.src_map, {}).rescheduled);
    expect_run_writes_all(refit, *plan, me, tensors, expected,
                          "after an update that changed nothing");
  }
  EXPECT_TRUE(all_pes(!HasFailure()));
}

// A bound refit captured once in a CUDA graph (RefitGraph) replays every byte bitwise, with a
// transform converting on arrival, at every replay; after an update() that scheduled it again a
// replay is refused. A refit on any other transport, or of host memory, is refused at capture.
TEST(BoundRefit, ReplaysFromACudaGraph) {
  auto service = make_service();
  const PeId me = service->my_pe();
  const int n = service->n_pes();
  for (const Mode mode : kBoundRefitModes) {
    SCOPED_TRACE(mode_name(mode));
    ModeRefit refit_of_mode = mode_refit(mode, me, n);
    auto& [plan, transform, expected, tensors] = refit_of_mode;
    Refit refit(plan, tensors.src_map, tensors.dst_map, *service, transform);
    if (service->transport_name() != "cuda" || !on_gpu()) {
      const auto refused = error_of([&] { RefitGraph graph(refit); });
      ASSERT_TRUE(refused.has_value()) << "a refit on " << service->transport_name() << " memory "
                                       << (on_gpu() ? "cuda" : "host") << " was captured";
      const bool other_transport = service->transport_name() != "cuda";
      EXPECT_EQ(refused->code(),
                other_transport ? ErrorCode::kUnsupported : ErrorCode::kInvalidArgument);
      EXPECT_NE(std::string(refused->what())
                    .find(other_transport ? "only the cuda transport's runs" : "are host memory"),
                std::string::npos)
          << refused->what();
      expect_run_writes_all(refit, *plan, me, tensors, expected, "after the refused capture");
      continue;
    }
#ifdef RESHARD_WITH_CUDA
    cudaStream_t stream = nullptr;
    ASSERT_EQ(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking), cudaSuccess);
    {
      RefitGraph graph(refit, stream);
      for (int replay = 0; replay < 3; ++replay) {
        poison(tensors);
        graph.replay(stream);
        ASSERT_EQ(cudaStreamSynchronize(stream), cudaSuccess);
        EXPECT_EQ(verify(*plan, me, tensors, expected), 0u) << "replay " << replay;
      }
      RefitGraph own_stream(refit);  // captured on a stream of its own, replayed on the default
      poison(tensors);
      own_stream.replay();
      ASSERT_EQ(cudaDeviceSynchronize(), cudaSuccess);
      EXPECT_EQ(verify(*plan, me, tensors, expected), 0u) << "replay on the default stream";
      // One destination in new memory on the last PE: every PE schedules again, and a replay
      // (which would write into the old memory) is refused on every PE.
      std::unique_ptr<TestMemory> old;
      EXPECT_TRUE(
          refit.update({}, last_destination_moved_on_last_pe(tensors, me, n, old)).rescheduled);
      const auto refused = error_of([&] { graph.replay(stream); });
      ASSERT_TRUE(refused.has_value()) << "a replay after the refit was scheduled again";
      EXPECT_EQ(refused->code(), ErrorCode::kInvalidState);
      EXPECT_NE(std::string(refused->what()).find("capture the refit again"), std::string::npos)
          << refused->what();
      RefitGraph again(refit, stream);
      poison(tensors);
      again.replay(stream);
      ASSERT_EQ(cudaStreamSynchronize(stream), cudaSuccess);
      EXPECT_EQ(verify(*plan, me, tensors, expected), 0u) << "captured again after the update";
    }
    cudaStreamDestroy(stream);
#endif
  }
  EXPECT_TRUE(all_pes(!HasFailure()));
}

// Staged, a refit leaves every destination byte as it was through stage() and writes exactly what
// a plain run writes at commit(), on each rank alone, the version advancing only there; a commit
// with nothing staged is refused.
TEST(StagedRefit, StageLeavesTheDestinationsAndCommitWritesWhatARunWrites) {
  auto service = make_service();
  const PeId me = service->my_pe();
  const int n = service->n_pes();
  for (const Mode mode : kBoundRefitModes) {
    SCOPED_TRACE(mode_name(mode));
    ModeRefit refit_of_mode = mode_refit(mode, me, n);
    auto& [plan, transform, expected, tensors] = refit_of_mode;
    StagedRefit refit(plan, tensors.src_map, tensors.dst_map, *service, transform);
    std::uint64_t destination_bytes = 0;
    for (const auto& [name, tensor] : tensors.dst_map)
      destination_bytes += tensor.data.bytes + tensor.scale.bytes;
    EXPECT_EQ(refit.staged_bytes(), destination_bytes);
    for (std::uint64_t step = 1; step <= 2; ++step) {
      poison(tensors);
      refit.stage();
      EXPECT_TRUE(refit.staged());
      for (const auto& [name, memory] : tensors.dst) {
        const auto bytes = memory->download();
        EXPECT_EQ(std::count(bytes.begin(), bytes.end(), std::byte{0xee}),
                  static_cast<std::ptrdiff_t>(bytes.size()))
            << "'" << name << "' was written before commit()";
      }
      EXPECT_EQ(refit.version(), step - 1);
      refit.commit();
      EXPECT_EQ(refit.version(), step);
      EXPECT_FALSE(refit.staged());
      EXPECT_EQ(verify(*plan, me, tensors, expected), 0u) << "commit " << step;
    }
    try {
      refit.commit();
      ADD_FAILURE() << "a commit() with nothing staged ran";
    } catch (const Error& error) {
      EXPECT_EQ(error.code(), ErrorCode::kInvalidState);
      EXPECT_NE(std::string(error.what()).find("nothing is staged"), std::string::npos);
    }
  }
  EXPECT_TRUE(all_pes(!HasFailure()));
}

// Bound with a group per layer, a run of one group writes exactly its parameters' destinations
// (every other byte stays poisoned), with and without a transform; a run of every group one at a
// time writes what a whole run writes; groups past the refit's are refused.
TEST(RefitGroups, EachGroupAloneWritesItsParametersAndNothingElse) {
  auto service = make_service();
  const PeId me = service->my_pe();
  const int n = service->n_pes();
  for (const Mode mode : kBoundRefitModes) {
    SCOPED_TRACE(mode_name(mode));
    ModeRefit refit_of_mode = mode_refit(mode, me, n);
    auto& [plan, transform, expected, tensors] = refit_of_mode;
    std::vector<std::string> names;
    ReshardOptions options;
    options.param_groups = layer_groups(*plan, &names);
    Refit refit(plan, tensors.src_map, tensors.dst_map, *service, transform, options);
    ASSERT_EQ(refit.groups(), names.size());
    ASSERT_GT(names.size(), 1u);
    for (std::uint32_t g = 0; g < refit.groups(); ++g) {
      poison(tensors);
      const std::uint32_t chosen[] = {g};
      refit.run(chosen);
      std::vector<bool> in_group(plan->params().size());
      for (std::size_t p = 0; p < in_group.size(); ++p) in_group[p] = options.param_groups[p] == g;
      EXPECT_EQ(verify(*plan, me, tensors, expected, &in_group), 0u) << "group " << names[g];
      for (std::uint32_t p = 0; p < plan->params().size(); ++p) {
        const std::string& name = plan->params()[p].name;
        if (in_group[p] || !tensors.dst.count(name)) continue;
        const auto bytes = tensors.dst.at(name)->download();
        EXPECT_EQ(std::count(bytes.begin(), bytes.end(), std::byte{0xee}),
                  static_cast<std::ptrdiff_t>(bytes.size()))
            << "'" << name << "' was written by a run of group " << names[g];
      }
    }
    poison(tensors);
    for (std::uint32_t g = 0; g < refit.groups(); ++g) refit.run(std::span(&g, 1));
    EXPECT_EQ(verify(*plan, me, tensors, expected), 0u) << "a group at a time";
    expect_run_writes_all(refit, *plan, me, tensors, expected, "a whole run of a grouped refit");
    const std::uint32_t past[] = {refit.groups()};
    try {
      refit.run(past);
      ADD_FAILURE() << "a group past the refit's ran";
    } catch (const Error& error) {
      EXPECT_EQ(error.code(), ErrorCode::kInvalidArgument);
    }
  }
  EXPECT_TRUE(all_pes(!HasFailure()));
}

// A refusal found on one rank only (its tensor missing or of the wrong shape) is the same error on
// every rank, naming that rank, instead of leaving the others in a collective it never enters; the
// service stays usable and the corrected call works, for execute_reshard_plan, for binding and for
// update().
TEST(BoundRefit, ARefusalOnOneRankIsEveryRanksErrorAndTheRetryWorks) {
  auto service = make_service();
  const PeId me = service->my_pe();
  const int n = service->n_pes();
  const auto plan = dp_to_replicas(n);
  const auto expected = expectations(*plan, Mode::kPlain, nullptr);
  RankTensors good = make_tensors(*plan, me, my_device(), expected, nullptr);
  const PeId culprit = n - 1;
  const std::string missing =
      "layers.1.mlp.experts." + std::to_string(24 / n * culprit) + ".down_proj.weight";
  TensorMap src_without = good.src_map;
  if (me == culprit) src_without.erase(missing);
  auto expect_named = [&](const Error& error, const char* when) {
    EXPECT_EQ(error.code(), ErrorCode::kInvalidArgument) << when;
    const std::string text = error.what();
    EXPECT_NE(text.find("PE " + std::to_string(culprit) + " refused the refit"), std::string::npos)
        << when << ": " << text;
    EXPECT_NE(text.find("no source tensor for '" + missing + "'"), std::string::npos)
        << when << ": " << text;
  };
  for (int attempt = 0; attempt < 2; ++attempt) {  // a refusal, a retry that works, again
    try {
      execute_reshard_plan(plan, src_without, good.dst_map, *service);
      ADD_FAILURE() << "execute_reshard_plan ran without PE " << culprit << "'s tensor";
    } catch (const Error& error) {
      expect_named(error, "execute_reshard_plan");
    }
    poison(good);
    EXPECT_TRUE(execute_reshard_plan(plan, good.src_map, good.dst_map, *service).rescheduled);
    EXPECT_EQ(verify(*plan, me, good, expected), 0u) << "the corrected execute_reshard_plan";
  }
  try {
    Refit refused(plan, src_without, good.dst_map, *service);
    ADD_FAILURE() << "a refit was bound without PE " << culprit << "'s tensor";
  } catch (const Error& error) {
    expect_named(error, "binding");
  }
  Refit refit(plan, good.src_map, good.dst_map, *service);
  expect_run_writes_all(refit, *plan, me, good, expected, "the refit bound after a refusal");
  // update() with a name the refit does not hold, on one rank: refused everywhere, and the refit
  // runs on as it was.
  TensorMap unknown;
  if (me == culprit) unknown.emplace("not.a.parameter", good.src_map.begin()->second);
  try {
    refit.update(unknown, {});
    ADD_FAILURE() << "update() took a name the refit does not hold";
  } catch (const Error& error) {
    EXPECT_NE(std::string(error.what()).find("'not.a.parameter' is not a source tensor"),
              std::string::npos)
        << error.what();
    EXPECT_NE(std::string(error.what()).find("PE " + std::to_string(culprit)), std::string::npos)
        << error.what();
  }
  expect_run_writes_all(refit, *plan, me, good, expected, "the refit after a refused update");
  // update() with a tensor of the wrong shape on one rank: refused everywhere before anything is
  // scheduled; run() then says why it cannot run, and a corrected update() restores it.
  const std::string name = good.dst_map.begin()->first;
  TensorMap misshapen;
  if (me == culprit) {
    LocalTensor tensor = good.dst_map.at(name);
    std::reverse(tensor.shape.begin(), tensor.shape.end());
    tensor.shape.push_back(1);
    misshapen.emplace(name, tensor);
  }
  try {
    refit.update({}, misshapen);
    ADD_FAILURE() << "update() took a tensor of the wrong shape";
  } catch (const Error& error) {
    EXPECT_NE(std::string(error.what()).find("PE " + std::to_string(culprit) + " refused"),
              std::string::npos)
        << error.what();
  }
  if (n > 1 || me == culprit) {
    try {
      refit.run();
      ADD_FAILURE() << "a refit whose update failed ran";
    } catch (const Error& error) {
      EXPECT_EQ(error.code(), ErrorCode::kInvalidState);
      EXPECT_NE(std::string(error.what()).find("update() again"), std::string::npos)
          << error.what();
    }
  }
  refit.update(good.src_map, good.dst_map);
  expect_run_writes_all(refit, *plan, me, good, expected, "the refit after a corrected update");
  EXPECT_TRUE(all_pes(!HasFailure()));
}

// A service holds one schedule: a refit whose schedule another one replaced, or that
// clear_requests() dropped, refuses to run rather than running someone else's schedule.
TEST(BoundRefit, ARefitWhoseScheduleWentRefusesToRun) {
  auto service = make_service();
  const PeId me = service->my_pe();
  const auto plan = dp_to_replicas(service->n_pes());
  const auto expected = expectations(*plan, Mode::kPlain, nullptr);
  RankTensors a = make_tensors(*plan, me, my_device(), expected, nullptr);
  RankTensors b = make_tensors(*plan, me, my_device(), expected, nullptr);
  Refit first(plan, a.src_map, a.dst_map, *service);
  Refit second(plan, b.src_map, b.dst_map, *service);
  auto expect_refused = [&](Refit& refit, const char* when) {
    try {
      refit.run();
      ADD_FAILURE() << when << ": ran";
    } catch (const Error& error) {
      EXPECT_EQ(error.code(), ErrorCode::kInvalidState) << when;
      EXPECT_NE(std::string(error.what()).find("no longer holds this refit's schedule"),
                std::string::npos)
          << when << ": " << error.what();
    }
  };
  expect_refused(first, "a refit replaced by another on its service");
  second.run();
  EXPECT_EQ(verify(*plan, me, b, expected), 0u);
  service->clear_requests();
  expect_refused(second, "after clear_requests()");
  EXPECT_TRUE(all_pes(!HasFailure()));
}

// GPU memory freed and allocated again at the same address is new memory: the peers' IPC
// mappings of the old allocation would receive its bytes. execute_reshard_plan schedules again
// where peers map it (the allocation's id differs), and the bytes land in the new memory.
TEST(ReshardReuse, GpuMemoryFreedAndAllocatedAgainIsScheduledAgain) {
  if (!on_gpu()) GTEST_SKIP() << "GPU memory only (RESHARD_TEST_MEMORY=cuda)";
  auto service = make_service();
  const PeId me = service->my_pe();
  const int n = service->n_pes();
  const auto plan = dp_to_replicas(n);
  const auto expected = expectations(*plan, Mode::kPlain, nullptr);
  RankTensors tensors = make_tensors(*plan, me, my_device(), expected, nullptr);
  EXPECT_TRUE(execute_reshard_plan(plan, tensors.src_map, tensors.dst_map, *service).rescheduled);
  EXPECT_FALSE(execute_reshard_plan(plan, tensors.src_map, tensors.dst_map, *service).rescheduled);
  // Every destination freed and allocated again (the allocator hands the same addresses back).
  int same_address = 0;
  for (auto& [name, memory] : tensors.dst) {
    const std::size_t bytes = memory->download().size();
    void* before = memory->buffer().data;
    memory.reset();
    memory = std::make_unique<TestMemory>(bytes, my_device());
    same_address += memory->buffer().data == before;
    tensors.dst_map.at(name).data = memory->buffer();
  }
  std::printf("PE %d: %d of %zu destinations came back at the same address\n", me, same_address,
              tensors.dst.size());
  // A new allocation at the same address is scheduled again only where peers map this PE's
  // memory (the CUDA transport, alone or mixed): NCCL and NVSHMEM take the buffers by address at
  // every run, which the new allocation satisfies. A destination the allocator placed elsewhere
  // (on any PE: every PE schedules together) is scheduled again on every transport.
  const bool peers_map_memory = service->transport_name().find("cuda") != std::string::npos;
  const bool moved = !all_pes(same_address == static_cast<int>(tensors.dst.size()));
  EXPECT_EQ(execute_reshard_plan(plan, tensors.src_map, tensors.dst_map, *service).rescheduled,
            peers_map_memory || moved);
  EXPECT_EQ(verify(*plan, me, tensors, expected), 0u) << "the bytes in the new allocations";
  EXPECT_TRUE(all_pes(!HasFailure()));
}

// A tensor under a name the plan does not have (an engine parameter the model spec lacks) would
// never be written: refused on every rank, naming it, unless tensors the plan does not move are
// allowed; a name added to a kept map later is refused too.
TEST(ReshardErrors, TensorsUnderNamesThePlanLacksAreRefused) {
  auto service = make_service();
  const PeId me = service->my_pe();
  const int n = service->n_pes();
  const auto plan = dp_to_replicas(n);
  const auto expected = expectations(*plan, Mode::kPlain, nullptr);
  RankTensors tensors = make_tensors(*plan, me, my_device(), expected, nullptr);
  TensorMap with_extra = tensors.dst_map;
  if (me == n - 1) with_extra.emplace("bogus.weight", tensors.dst_map.begin()->second);
  auto expect_refused = [&](const char* when) {
    try {
      execute_reshard_plan(plan, tensors.src_map, with_extra, *service);
      ADD_FAILURE() << when << ": a tensor the plan lacks was taken";
    } catch (const Error& error) {
      EXPECT_EQ(error.code(), ErrorCode::kInvalidArgument) << when;
      EXPECT_NE(std::string(error.what())
                    .find("destination tensor 'bogus.weight' on PE " + std::to_string(n - 1) +
                          " is not a parameter of the plan"),
                std::string::npos)
          << when << ": " << error.what();
    }
  };
  expect_refused("the first refit");
  EXPECT_TRUE(execute_reshard_plan(plan, tensors.src_map, tensors.dst_map, *service).rescheduled);
  EXPECT_EQ(verify(*plan, me, tensors, expected), 0u);
  expect_refused("a name added after the first refit");
  try {
    Refit refused(plan, tensors.src_map, with_extra, *service);
    ADD_FAILURE() << "a refit was bound with a tensor the plan lacks";
  } catch (const Error& error) {
    EXPECT_NE(std::string(error.what()).find("'bogus.weight'"), std::string::npos) << error.what();
  }
  ReshardOptions extras;
  extras.allow_unknown_names = true;
  execute_reshard_plan(plan, tensors.src_map, with_extra, *service, nullptr, nullptr, extras);
  EXPECT_EQ(verify(*plan, me, tensors, expected), 0u);
  EXPECT_TRUE(all_pes(!HasFailure()));
}

// This process's resident memory in bytes.
std::uint64_t resident_bytes() {
  std::FILE* file = std::fopen("/proc/self/statm", "r");
  unsigned long pages = 0, resident = 0;
  if (file == nullptr) return 0;
  if (std::fscanf(file, "%lu %lu", &pages, &resident) != 2) resident = 0;
  std::fclose(file);
  return static_cast<std::uint64_t>(resident) * 4096;
}

// A caller making a new transform or plan object at every refit: execute_reshard_plan keeps one
// executor on the service, not one per object, so memory stays flat; a new built-in transform
// that does what the last one did reuses its schedule.
TEST(ReshardReuse, FreshTransformsAndPlansKeepMemoryFlat) {
#if defined(__SANITIZE_ADDRESS__)
  GTEST_SKIP() << "AddressSanitizer's quarantine keeps freed memory resident";
#endif
  auto service = make_service();
  const PeId me = service->my_pe();
  const int n = service->n_pes();
  auto plan = dp_to_replicas(n);
  const auto expected = expectations(*plan, Mode::kCastFp32, transform_for(Mode::kCastFp32).get());
  RankTensors tensors =
      make_tensors(*plan, me, my_device(), expected, transform_for(Mode::kCastFp32).get());
  ReshardOptions options;
  options.staging_budget = ReshardOptions::kUnlimited;
  std::uint64_t staging = 0, settled = 0;
  // The allocator's own pools settle within the first few dozen refits (measured flat from the
  // 40th to the 200th, 3 PEs); growth is measured after that.
  constexpr int kRefits = 120, kSettled = 40;
  for (int refit = 0; refit < kRefits; ++refit) {
    // A fresh transform at every refit, and a fresh plan object at every other one.
    if (refit % 2 == 1) plan = dp_to_replicas(n);
    const ReshardReport report =
        execute_reshard_plan(plan, tensors.src_map, tensors.dst_map, *service,
                             transform_for(Mode::kCastFp32), nullptr, options);
    EXPECT_EQ(report.rescheduled, refit == 0 || refit % 2 == 1) << "refit " << refit;
    staging = std::max(staging, report.staging_bytes);
    if (refit == kSettled) settled = resident_bytes();
  }
  EXPECT_EQ(verify(*plan, me, tensors, expected), 0u);
  if (n > 1) ASSERT_GT(staging, 0u) << "the cast stages its wire buffers";
  // 80 more executors kept would hold 80 times the staging; one kept holds it once.
  const std::uint64_t grown = resident_bytes() - std::min(settled, resident_bytes());
  EXPECT_LT(grown, 4 * staging + (4u << 20))
      << "resident memory grew by " << grown << " bytes over " << kRefits - kSettled
      << " refits; one refit stages " << staging;
  EXPECT_TRUE(all_pes(!HasFailure()));
}

}  // namespace
}  // namespace reshard

int main(int argc, char** argv) {
  using namespace reshard;
  if (on_gpu()) {
    // GPU runs need the transport in this build and a GPU (shared by PEs where there are fewer
    // GPUs than PEs, except under NCCL); otherwise every PE skips (77).
    const auto names = available_transports();
    if (transport_under_test() != "auto" &&
        std::find(names.begin(), names.end(), transport_under_test()) == names.end()) {
      std::printf("skipped: this build has no %s transport\n", transport_under_test().c_str());
      return 77;
    }
    int devices = 0;
#ifdef RESHARD_WITH_CUDA
    if (cudaGetDeviceCount(&devices) != cudaSuccess) devices = 0;
#endif
    if (const std::string why = testing_support::gpu_skip_reason(devices); !why.empty()) {
      std::printf("skipped: %s\n", why.c_str());
      return 77;
    }
  }
  return testing_support::run_pe_tests(argc, argv);
}
