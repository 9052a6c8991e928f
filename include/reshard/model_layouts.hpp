// Layout builders for the common cases: Megatron-style training (TP, PP, EP, DP replicas, packed
// partitions) and vLLM/SGLang-style inference (TP, EP, replicas), on shared or disjoint PEs.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "reshard/layout.hpp"

namespace reshard {

// Where a parameter lives along the pipeline.
enum class Stage : std::uint8_t {
  kLayer,  // the stage that owns `layer`
  kFirst,  // the first stage (embeddings)
  kLast,   // the last stage (final norm, output head)
};

struct ModelParam {
  ParamSpec spec;
  int tp_dim = -1;  // dimension split by tensor parallelism; -1 = replicated on every TP PE
  // Packed partitions along tp_dim (fused QKV: {q, k, v} rows; gate/up: {ffn, ffn}). Each is split
  // across the TP PEs separately and a PE holds its slices one after the other. Empty = one.
  std::vector<std::int64_t> packed;
  Stage stage = Stage::kLayer;
  int layer = 0;
  int expert = -1;  // >= 0: an expert weight, owned by one expert-parallel PE
  // Its tp_dim (dim 0 where it has none) indexes the vocabulary (embeddings, output head): a
  // Parallelism with vocab_multiple pads it (ParamSpec::real_shape keeps the model's size).
  bool vocab = false;
};

struct ModelSpec {
  std::string name;
  int layers = 0;
  int experts = 0;  // routed experts per MoE layer, 0 for a dense model
  std::vector<ModelParam> params;

  std::uint64_t total_bytes() const;
};

// How one side shards the model. PEs are numbered tensor-parallel fastest, then dp, then
// pipeline stage, then replica, starting at first_pe (Megatron's "tp-dp-pp" rank order; for
// inference, dp = 1 and replicas = engine instances). Within one stage, the tp * dp PEs are
// re-split for expert weights as etp (fastest) x ep x expert-dp.
struct Parallelism {
  int tp = 1;
  int dp = 1;
  int pp = 1;
  int replicas = 1;
  int ep = 1;
  int etp = 1;
  PeId first_pe = 0;
  // Vocabulary rows (ModelParam::vocab) padded up to a multiple of this, as the framework pads
  // them: Megatron-LM to make_vocab_size_divisible_by x tp (128 x tp by default), vLLM to 64.
  // Plans move the real rows only, so each side may pad its own way. 0: no padding.
  std::int64_t vocab_multiple = 0;
  // Former name of first_pe, kept for one release: used where first_pe is 0.
  PeId rank_offset = 0;

  int world() const { return tp * dp * pp * replicas; }
  PeId first() const { return first_pe != 0 ? first_pe : rank_offset; }  // of the PEs it uses
  std::string str() const;  // "tp4 dp2 pp1 ep1 etp1 x1 @0"
};

// Builds the layout of `model` under `parallel`. A tensor-parallel dim (each packed partition of
// it) splits as torch.chunk splits it, where it does not divide too: chunks of ceil(size / tp),
// the last PEs' shorter or empty (a vocabulary of 32,000 over TP 3: 10,667, 10,667, 10,666
// rows), as DTensor's Shard(dim) places it.
Layout build_layout(const ModelSpec& model, const Parallelism& parallel);

// Model shapes used by the benchmarks and tests (bf16, real dimensions; weights only).
ModelSpec llama3_8b_model(int layers = 32);
ModelSpec qwen3_30b_a3b_model(int layers = 48);
// A Kimi-K2 / DeepSeek-V3 sized MoE: 61 layers, 384 experts of 7168 x 2048, about 1 trillion
// parameters.
ModelSpec moe_1t_model(int layers = 61, int experts = 384);

// A model for tests: `layers` layers of fused QKV, output, gate/up, down and norms, with
// `experts` experts per layer when nonzero; every dimension divides 8.
ModelSpec toy_model(int layers, int hidden, int experts = 0);

}  // namespace reshard
