// `reshard bench-convert`: the executor's conversion kernels (MXFP8, 128 x 128 block FP8, casts,
// packing strided slices into wire buffers and unpacking them) on one GPU, each queued through
// execution::ConversionQueue as a refit queues them, timed against a device-to-device copy of the
// same bytes in the same run (both cycling through copies of their buffers, so small cases come
// from memory, not the L2 cache). Rates count bytes read plus bytes written; every result is
// checked against the host reference (all rows of small tensors, the first tile row of large ones).
#include <cuda_runtime.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <fstream>
#include <functional>
#include <memory>
#include <random>
#include <sstream>

#include "bench/bench.hpp"
#include "bench/bench_cuda.hpp"
#include "execution/box_view.hpp"
#include "reshard/error.hpp"
#include "transforms/conversions.hpp"
#include "transforms/number_formats.hpp"

namespace reshard::bench {
namespace {

using execution::BlockRef;
using execution::BoxView;

struct DeviceBuffer {
  explicit DeviceBuffer(std::size_t n) : bytes(std::max<std::size_t>(n, 1)) {
    BENCH_CUDA(cudaMalloc(&data, bytes));
  }
  ~DeviceBuffer() { cudaFree(data); }
  DeviceBuffer(const DeviceBuffer&) = delete;
  DeviceBuffer& operator=(const DeviceBuffer&) = delete;
  std::byte* at(std::size_t offset) const { return static_cast<std::byte*>(data) + offset; }
  void* data = nullptr;
  std::size_t bytes;
};

struct Matrix {
  std::int64_t rows, cols;
};

// One line of the table: a set of matrices converted in one flush.
struct Case {
  std::string name;
  std::vector<Matrix> matrices;
};

std::int64_t tiles(std::int64_t extent) { return (extent + 127) / 128; }

// "14336x4096" one matrix; "256x1024x512" 512 matrices of 256 x 1024.
Case parse_shape(const std::string& text) {
  std::vector<std::int64_t> numbers;
  std::stringstream in(text);
  std::string part;
  while (std::getline(in, part, 'x')) {
    try {
      numbers.push_back(std::stoll(part));
    } catch (const std::exception&) {
      numbers.clear();
      break;
    }
  }
  if (numbers.size() < 2 || numbers.size() > 3 ||
      std::any_of(numbers.begin(), numbers.end(), [](std::int64_t v) { return v <= 0; }) ||
      numbers[1] % 64 != 0) {
    throw_error(ErrorCode::kInvalidArgument,
                "--shapes: '" + text +
                    "' is not ROWSxCOLS or ROWSxCOLSxCOUNT with positive numbers and COLS a "
                    "multiple of 64");
  }
  const std::int64_t count = numbers.size() == 3 ? numbers[2] : 1;
  return {text, std::vector<Matrix>(static_cast<std::size_t>(count), {numbers[0], numbers[1]})};
}

Case model_case(const std::string& model, int layers) {
  const ModelSpec spec =
      model == "qwen3-30b-a3b" ? qwen3_30b_a3b_model(layers) : llama3_8b_model(layers);
  Case c{model + " " + std::to_string(layers) + "L", {}};
  for (const ModelParam& param : spec.params) {
    const auto& shape = param.spec.shape;
    if (shape.size() != 2 || shape[1] % 64 != 0) continue;  // norms and biases are not quantized
    c.matrices.push_back({shape[0], shape[1]});
  }
  c.name += " (" + std::to_string(c.matrices.size()) + " matrices)";
  return c;
}

// Realistic weights: bf16 of magnitudes 2^-14..2^-7 with a few outliers 64x larger, some zeros;
// every mantissa drawn on its own (drawn from the bits that select outliers, the outliers' low
// mantissa bits were all zero, so block FP8's tile maxima had 3 significant bits and 1 quotient in
// 130 lay on a rounding tie, a rare case made common).
std::vector<std::uint16_t> weight_pattern(std::size_t n, std::uint32_t seed) {
  std::mt19937 rng(seed);
  std::vector<std::uint16_t> out(n);
  for (auto& v : out) {
    const std::uint32_t r = rng(), mantissa = rng() & 0x7f;
    std::uint32_t exponent = 120 - (r >> 24 & 7);
    if ((r & 0xfff) == 0) exponent += 6;
    v = static_cast<std::uint16_t>((r >> 31) << 15 | exponent << 7 | mantissa);
    if ((r & 0x3ff000) == 0) v = 0;
  }
  return out;
}

// Fills `bytes` of device memory by repeating a host pattern (a copy of 64 MiB at most).
void fill(void* device, std::size_t bytes, DType dtype, std::uint32_t seed) {
  const std::size_t pattern_bytes = std::min<std::size_t>(bytes, 64u << 20);
  std::vector<std::byte> pattern(pattern_bytes);
  const auto bf16 = weight_pattern(pattern_bytes / dtype_size(dtype) + 1, seed);
  if (dtype == DType::kFloat32) {
    std::mt19937 rng(seed + 1);
    for (std::size_t i = 0; i < pattern_bytes / 4; ++i) {
      const std::uint32_t bits = static_cast<std::uint32_t>(bf16[i]) << 16 | (rng() & 0xffff);
      std::memcpy(pattern.data() + 4 * i, &bits, 4);
    }
  } else {
    std::memcpy(pattern.data(), bf16.data(), pattern_bytes);
  }
  BENCH_CUDA(cudaMemcpy(device, pattern.data(), pattern_bytes, cudaMemcpyHostToDevice));
  for (std::size_t done = pattern_bytes; done < bytes;) {
    const std::size_t n = std::min(done, bytes - done);
    BENCH_CUDA(
        cudaMemcpy(static_cast<std::byte*>(device) + done, device, n, cudaMemcpyDeviceToDevice));
    done += n;
  }
}

std::vector<std::byte> download(const void* device, std::size_t bytes) {
  std::vector<std::byte> out(bytes);
  BENCH_CUDA(cudaMemcpy(out.data(), device, bytes, cudaMemcpyDeviceToHost));
  return out;
}

// The box of a matrix a conversion works on: all of it, or its left half of the columns (a
// column block: rows one full row apart, as a row-parallel weight's TP slice).
Box box_of(const Matrix& m, bool column_block) {
  return Box{2, {0, 0}, {m.rows, column_block ? m.cols / 2 : m.cols}};
}

// A conversion's buffers for one matrix, placed in shared device allocations.
struct Placed {
  std::size_t src = 0, out = 0, scale = 0;  // byte offsets
};

// What one conversion reads and writes per matrix, and how to queue and check it.
struct Conversion {
  std::string name;
  DType src_dtype = DType::kBFloat16;
  DType out_dtype = DType::kBFloat16;
  enum class Kind { kMx, kMxRoundUp, kMxMegatron, kBlock, kCast, kPack, kUnpack } kind;

  bool mx() const {
    return kind == Kind::kMx || kind == Kind::kMxRoundUp || kind == Kind::kMxMegatron;
  }

  std::size_t src_bytes(const Matrix& m) const {
    return static_cast<std::size_t>(m.rows * m.cols) * dtype_size(src_dtype);
  }
  std::size_t out_bytes(const Matrix& m) const {
    return static_cast<std::size_t>(m.rows * m.cols) * dtype_size(out_dtype);
  }
  std::size_t scale_bytes(const Matrix& m) const {
    if (kind == Kind::kMxMegatron)
      return static_cast<std::size_t>(formats::swizzled_scale_bytes(m.rows, m.cols / 32));
    if (mx()) return static_cast<std::size_t>(m.rows * m.cols / 32);
    if (kind == Kind::kBlock) return static_cast<std::size_t>(tiles(m.rows) * tiles(m.cols)) * 4;
    return 0;
  }
  // Bytes read plus written for the box.
  double moved(const Matrix& m, bool column_block) const {
    const Box box = box_of(m, column_block);
    const double elements = static_cast<double>(box.extent[0] * box.extent[1]);
    double scales = 0;
    if (mx()) scales = elements / 32;
    if (kind == Kind::kBlock) scales = 4.0 * tiles(box.extent[0]) * tiles(box.extent[1]);
    return elements * (dtype_size(src_dtype) + dtype_size(out_dtype)) + scales;
  }
};

std::vector<Conversion> all_conversions() {
  using K = Conversion::Kind;
  return {{"mxfp8", DType::kBFloat16, DType::kFloat8E4M3, K::kMx},
          {"mxfp8-round-up", DType::kBFloat16, DType::kFloat8E4M3, K::kMxRoundUp},
          // Megatron-LM's MXFP8 buffers: its scale rounding, scales in cuBLAS's swizzled layout.
          {"mxfp8-megatron", DType::kBFloat16, DType::kFloat8E4M3, K::kMxMegatron},
          {"fp8-block", DType::kBFloat16, DType::kFloat8E4M3, K::kBlock},
          {"cast-bf16-fp32", DType::kBFloat16, DType::kFloat32, K::kCast},
          {"cast-fp32-bf16", DType::kFloat32, DType::kBFloat16, K::kCast},
          {"pack", DType::kBFloat16, DType::kBFloat16, K::kPack},
          {"unpack", DType::kBFloat16, DType::kBFloat16, K::kUnpack}};
}

// The views of one matrix's conversion: over `rows` rows (all, or the checked ones).
struct Views {
  BoxView src, out, scale;
};

Views views_of(const Conversion& c, const Matrix& m, bool column_block, std::int64_t rows) {
  const Matrix part{rows, m.cols};
  const Box box = box_of(part, column_block);
  const std::vector<std::int64_t> shape = {part.rows, part.cols};
  Views v;
  v.src = execution::view_of(
      box, shape, c.kind == Conversion::Kind::kPack || c.kind == Conversion::Kind::kUnpack);
  v.out = v.src;
  if (c.kind == Conversion::Kind::kPack || c.kind == Conversion::Kind::kUnpack) {
    // The wire side is dense: the box's elements one after the other.
    const Box dense{1, {0}, {box.extent[0] * box.extent[1]}};
    v.out = execution::view_of(dense, {dense.extent[0]}, true);
  }
  if (c.mx()) {  // row-major scales (swizzled ones are placed by the job, not a view)
    const Box scale_box{2, {0, 0}, {box.extent[0], box.extent[1] / 32}};
    v.scale = execution::view_of(scale_box, {part.rows, part.cols / 32}, false);
  }
  if (c.kind == Conversion::Kind::kBlock) {
    const Box scale_box{2, {0, 0}, {tiles(box.extent[0]), tiles(box.extent[1])}};
    v.scale = execution::view_of(scale_box, {tiles(part.rows), tiles(part.cols)}, false);
  }
  return v;
}

// Queues one matrix's conversion (device pointers) or runs it on the host (host pointers), over
// the matrix's first `rows` rows.
void queue_one(execution::ConversionQueue& queue, const Conversion& c, const Views& v, void* src,
               void* out, void* scale, const Matrix& m, std::int64_t rows, const Buffer& memory) {
  using K = Conversion::Kind;
  switch (c.kind) {
    case K::kMx:
    case K::kMxRoundUp:
    case K::kMxMegatron: {
      const MxScaleRounding rounding = c.kind == K::kMxRoundUp    ? MxScaleRounding::kRoundUp
                                       : c.kind == K::kMxMegatron ? MxScaleRounding::kMegatron
                                                                  : MxScaleRounding::kOcp;
      execution::SwizzledScales swizzled{};
      if (c.kind == K::kMxMegatron) swizzled.col_tiles = (m.cols / 32 + 3) / 4;
      queue.mx_quantize({{src, c.src_dtype, v.src},
                         {out, DType::kFloat8E4M3, v.out},
                         {scale, DType::kFloat8E8M0, v.scale},
                         rounding,
                         swizzled},
                        memory);
      break;
    }
    case K::kBlock:
      queue.block_quantize({{src, c.src_dtype, v.src},
                            {out, DType::kFloat8E4M3, v.out},
                            {scale, DType::kFloat32, v.scale},
                            rows},
                           memory);
      break;
    case K::kCast:
      queue.convert({{src, c.src_dtype, v.src}, {out, c.out_dtype, v.out}}, memory);
      break;
    case K::kPack: {
      const std::size_t bytes = static_cast<std::size_t>(v.src.elements()) * 2;
      queue.pack({src, bytes, memory.kind, memory.device}, v.src, 2,
                 {out, bytes, memory.kind, memory.device});
      break;
    }
    case K::kUnpack: {
      // The dense buffer is `src`; the strided view is the destination's.
      const std::size_t bytes = static_cast<std::size_t>(v.src.elements()) * 2;
      queue.unpack({src, bytes, memory.kind, memory.device},
                   {out, bytes, memory.kind, memory.device}, v.src, 2);
      break;
    }
  }
}

double median(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  return v[v.size() / 2];
}

// Seconds per call of `body`: on the GPU (between events, median of the repeats) and on the host
// (queuing it: where that exceeds the GPU's, the GPU waits for the host).
struct Timing {
  double gpu = 0, host = 0;
};

Timing time_it(cudaStream_t stream, const ConvertBenchOptions& options,
               const std::function<void()>& body) {
  for (int i = 0; i < options.warmup; ++i) body();
  cudaEvent_t start, stop;
  BENCH_CUDA(cudaEventCreate(&start));
  BENCH_CUDA(cudaEventCreate(&stop));
  std::vector<double> gpu, host;
  for (int r = 0; r < options.repeats; ++r) {
    BENCH_CUDA(cudaEventRecord(start, stream));
    const auto queued_from = std::chrono::steady_clock::now();
    for (int i = 0; i < options.iterations; ++i) body();
    host.push_back(
        std::chrono::duration<double>(std::chrono::steady_clock::now() - queued_from).count() /
        options.iterations);
    BENCH_CUDA(cudaEventRecord(stop, stream));
    BENCH_CUDA(cudaEventSynchronize(stop));
    float ms = 0;
    BENCH_CUDA(cudaEventElapsedTime(&ms, start, stop));
    gpu.push_back(ms / 1e3 / options.iterations);
  }
  cudaEventDestroy(start);
  cudaEventDestroy(stop);
  return {median(gpu), median(host)};
}

// Rows of a matrix checked against the host reference: all of a small one, else the first 128
// (one tile row; the kernels treat every row alike).
std::int64_t checked_rows(const Matrix& m) {
  return m.rows * m.cols <= (4 << 20) ? m.rows : std::min<std::int64_t>(m.rows, 128);
}

constexpr double kRoundBytes = 256.0 * (1 << 20);

struct Result {
  double seconds = 0, host_seconds = 0, copy_seconds = 0, moved = 0;
  std::uint64_t wrong = 0;
};

Result run_case(const Case& c, const Conversion& conv, bool column_block, cudaStream_t stream,
                const ConvertBenchOptions& options) {
  const bool unpack = conv.kind == Conversion::Kind::kUnpack;
  std::vector<Placed> placed;
  std::size_t src_total = 0, out_total = 0, scale_total = 0;
  const auto align = [](std::size_t v) { return (v + 255) / 256 * 256; };
  for (const Matrix& m : c.matrices) {
    placed.push_back({src_total, out_total, scale_total});
    src_total += align(conv.src_bytes(m));
    out_total += align(conv.out_bytes(m));
    scale_total += align(conv.scale_bytes(m));
  }
  double moved = 0;
  for (const Matrix& m : c.matrices) moved += conv.moved(m, column_block);
  // Copies of the buffers taken in turn, at least 256 MiB of traffic a round, so small cases
  // stream from memory as a refit's conversions do, not from the 50 MB L2 cache (the copy
  // ceiling likewise).
  const int copies = static_cast<int>(std::clamp(std::ceil(kRoundBytes / moved), 1.0, 64.0));
  DeviceBuffer src(src_total * copies), out(out_total * copies), scale(scale_total * copies);
  fill(src.data, src.bytes, conv.src_dtype, 7);
  BENCH_CUDA(cudaMemset(out.data, 0xab, out.bytes));
  BENCH_CUDA(cudaMemset(scale.data, 0xab, scale.bytes));

  execution::ConversionQueue queue;
  const Buffer memory = Buffer::cuda(src.data, src.bytes, 0);
  std::vector<Views> views;
  for (const Matrix& m : c.matrices) views.push_back(views_of(conv, m, column_block, m.rows));
  int turn = 0;
  const auto body = [&] {
    const std::size_t k = static_cast<std::size_t>(turn++ % copies);
    for (std::size_t i = 0; i < c.matrices.size(); ++i) {
      // Unpack reads the dense side: the source allocation holds it, the matrix is the output.
      queue_one(queue, conv, views[i], src.at(k * src_total + placed[i].src),
                out.at(k * out_total + placed[i].out), scale.at(k * scale_total + placed[i].scale),
                c.matrices[i], c.matrices[i].rows, memory);
      queue.flush_if_full(stream);
    }
    queue.flush(stream);
  };
  Result result;
  result.moved = moved;
  const Timing timing = time_it(stream, options, body);
  result.seconds = timing.gpu;
  result.host_seconds = timing.host;

  // The ceiling: device-to-device copies of as many bytes (half read, half written), taken in
  // turn as above; in at most 2 GiB (the copy rate is flat from 1 GiB on).
  {
    const auto half = static_cast<std::size_t>(moved / 2);
    const std::size_t copy_bytes =
        (std::min<std::size_t>(half, std::size_t{2} << 30) + 255) / 256 * 256;
    DeviceBuffer a(copy_bytes * copies), b(copy_bytes * copies);
    BENCH_CUDA(cudaMemsetAsync(a.data, 1, a.bytes, stream));
    int copy_turn = 0;
    result.copy_seconds =
        time_it(stream, options,
                [&] {
                  const std::size_t k = copy_turn++ % copies;
                  BENCH_CUDA(cudaMemcpyAsync(b.at(k * copy_bytes), a.at(k * copy_bytes), copy_bytes,
                                             cudaMemcpyDeviceToDevice, stream));
                })
            .gpu *
        (static_cast<double>(half) / static_cast<double>(copy_bytes));
  }

  // Every matrix's checked rows against the host reference, byte for byte.
  BENCH_CUDA(cudaStreamSynchronize(stream));
  execution::ConversionQueue host_queue;
  for (std::size_t i = 0; i < c.matrices.size(); ++i) {
    const Matrix& m = c.matrices[i];
    const std::int64_t rows = checked_rows(m);
    const Views v = views_of(conv, m, column_block, rows);
    const Matrix part{rows, m.cols};
    // The source rows (for unpack: the dense side's first elements, which are those rows').
    const std::size_t src_bytes =
        unpack ? static_cast<std::size_t>(v.src.elements()) * 2 : conv.src_bytes(part);
    auto host_src = download(src.at(placed[i].src), src_bytes);
    std::vector<std::byte> want_out(conv.out_bytes(part), std::byte{0xab});
    std::vector<std::byte> want_scale(conv.scale_bytes(part), std::byte{0xab});
    queue_one(host_queue, conv, v, host_src.data(), want_out.data(), want_scale.data(), m, rows,
              Buffer::host(host_src.data(), host_src.size()));
    host_queue.flush(nullptr);  // host packs and unpacks run at the flush
    const std::size_t out_checked = conv.kind == Conversion::Kind::kPack
                                        ? static_cast<std::size_t>(v.src.elements()) * 2
                                        : want_out.size();
    const auto got_out = download(out.at(placed[i].out), out_checked);
    for (std::size_t b = 0; b < out_checked; ++b) result.wrong += got_out[b] != want_out[b];
    // Scales of the checked rows (block FP8: the first tile row) are the first ones.
    const auto got_scale = download(scale.at(placed[i].scale), want_scale.size());
    for (std::size_t b = 0; b < want_scale.size(); ++b)
      result.wrong += got_scale[b] != want_scale[b];
  }
  return result;
}

}  // namespace

std::uint64_t run_convert_bench(const ConvertBenchOptions& options) {
  std::vector<Case> cases;
  for (const std::string& shape : options.shapes) cases.push_back(parse_shape(shape));
  if (!options.model.empty() && options.model != "none") {
    cases.push_back(model_case(options.model, options.layers));
  }
  std::vector<Conversion> conversions;
  for (const std::string& name : options.conversions) {
    bool found = false;
    for (const Conversion& c : all_conversions()) {
      if (c.name == name) {
        conversions.push_back(c);
        found = true;
      }
    }
    if (!found) throw_error(ErrorCode::kInvalidArgument, "--conversions: unknown '" + name + "'");
  }
  cudaDeviceProp prop{};
  BENCH_CUDA(cudaGetDeviceProperties(&prop, 0));
  cudaStream_t stream;
  BENCH_CUDA(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking));
  std::printf(
      "reshard bench-convert on %s, %s: rates count bytes read + written; 'of copy' is "
      "against a device-to-device copy of as many bytes in the same run\n",
      prop.name, utc_date().c_str());
  std::printf("%-34s %-13s %-15s %10s %10s %10s %10s %8s %6s\n", "tensors", "layout", "conversion",
              "time", "queuing", "GB/s", "copy GB/s", "of copy", "wrong");
  std::uint64_t wrong = 0;
  Progress progress("bench-convert");
  for (const Case& c : cases) {
    for (const bool column_block : options.column_block) {
      for (const Conversion& conv : conversions) {
        progress.note(c.name + " " + conv.name);
        const Result r = run_case(c, conv, column_block, stream, options);
        wrong += r.wrong;
        const double rate = r.moved / r.seconds / 1e9;
        const double copy_rate = r.moved / r.copy_seconds / 1e9;
        const char* layout = column_block ? "column-block" : "contiguous";
        std::printf("%-34s %-13s %-15s %10s %10s %10.0f %10.0f %8.2f %6llu\n", c.name.c_str(),
                    layout, conv.name.c_str(), format_seconds(r.seconds).c_str(),
                    format_seconds(r.host_seconds).c_str(), rate, copy_rate, rate / copy_rate,
                    static_cast<unsigned long long>(r.wrong));
        std::fflush(stdout);
        if (!options.json_path.empty()) {
          std::ofstream json(options.json_path, std::ios::app);
          json << "{\"bench\":\"convert\",\"date\":\"" << utc_date() << "\",\"device\":\""
               << prop.name << "\",\"commit\":\"" << options.commit << "\",\"tensors\":\"" << c.name
               << "\",\"matrices\":" << c.matrices.size() << ",\"layout\":\"" << layout
               << "\",\"conversion\":\"" << conv.name << "\",\"seconds\":" << r.seconds
               << ",\"host_seconds\":" << r.host_seconds << ",\"bytes_moved\":" << r.moved
               << ",\"copy_seconds\":" << r.copy_seconds
               << ",\"fraction_of_copy\":" << rate / copy_rate << ",\"wrong\":" << r.wrong << "}\n";
        }
      }
    }
  }
  cudaStreamDestroy(stream);
  return wrong;
}

}  // namespace reshard::bench
