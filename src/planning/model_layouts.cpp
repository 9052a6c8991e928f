#include "reshard/model_layouts.hpp"

#include <algorithm>
#include <numeric>
#include <sstream>

#include "reshard/error.hpp"

namespace reshard {
namespace {

[[noreturn]] void refuse(const std::string& what) {
  throw_error(ErrorCode::kInvalidArgument, what);
}

void check_parallelism(const ModelSpec& model, const Parallelism& par) {
  const int dims[] = {par.tp, par.dp, par.pp, par.replicas, par.ep, par.etp};
  for (int dim : dims) {
    if (dim < 1) refuse("parallel sizes must be >= 1, got " + par.str());
  }
  if (par.first_pe < 0 || par.rank_offset < 0) refuse("first_pe must be >= 0, got " + par.str());
  if (par.first_pe != 0 && par.rank_offset != 0 && par.first_pe != par.rank_offset) {
    refuse("first_pe = " + std::to_string(par.first_pe) + " and rank_offset (its former name) = " +
           std::to_string(par.rank_offset) + " differ: set first_pe only");
  }
  if (par.vocab_multiple < 0) refuse("vocab_multiple must be >= 0, got " + par.str());
  if ((par.tp * par.dp) % (par.ep * par.etp) != 0) {
    refuse("ep x etp = " + std::to_string(par.ep * par.etp) +
           " must divide tp x dp = " + std::to_string(par.tp * par.dp) + " (" + par.str() + ")");
  }
  if (model.experts > 0 && model.experts % par.ep != 0) {
    refuse("ep = " + std::to_string(par.ep) + " must divide the " + std::to_string(model.experts) +
           " experts of " + model.name);
  }
  if (par.pp > std::max(1, model.layers)) {
    refuse("pp = " + std::to_string(par.pp) + " exceeds the " + std::to_string(model.layers) +
           " layers of " + model.name);
  }
}

int stage_of(const ModelParam& param, const ModelSpec& model, int pp) {
  switch (param.stage) {
    case Stage::kFirst:
      return 0;
    case Stage::kLast:
      return pp - 1;
    case Stage::kLayer:
      break;
  }
  if (param.layer < 0 || param.layer >= std::max(1, model.layers)) {
    refuse("parameter '" + param.spec.name + "' names layer " + std::to_string(param.layer) +
           " of a " + std::to_string(model.layers) + "-layer model");
  }
  return static_cast<int>(static_cast<std::int64_t>(param.layer) * pp / std::max(1, model.layers));
}

// The pieces PE `index` of `parts` holds when `param` is split along its tp_dim.
void split_shard(const ModelParam& param, int parts, int index,
                 std::vector<std::int64_t>& local_shape, std::vector<Piece>& pieces) {
  const ParamSpec& spec = param.spec;
  local_shape = spec.shape;
  pieces.clear();
  if (param.tp_dim < 0 || parts == 1) {
    pieces.push_back({Box::whole(spec.shape), {}});
    return;
  }
  const int dim = param.tp_dim;
  if (dim >= static_cast<int>(spec.shape.size())) {
    refuse("parameter '" + spec.name + "' is split on dim " + std::to_string(dim) + " but has " +
           std::to_string(spec.shape.size()) + " dimensions");
  }
  std::vector<std::int64_t> partitions = param.packed;
  if (partitions.empty()) partitions.push_back(spec.shape[dim]);
  if (std::accumulate(partitions.begin(), partitions.end(), std::int64_t{0}) != spec.shape[dim]) {
    refuse("packed partitions of '" + spec.name + "' do not add up to dim " + std::to_string(dim) +
           " = " + std::to_string(spec.shape[dim]));
  }
  // Each partition splits as torch.chunk splits it (as DTensor's Shard places it): chunks of
  // ceil(size / parts), the last ones shorter or empty, so a dim that does not divide (TP 3, a
  // vocabulary not padded to the TP size) still has every element on exactly one PE.
  std::int64_t global_at = 0;
  std::int64_t local_at = 0;
  for (std::int64_t size : partitions) {
    const std::int64_t chunk = (size + parts - 1) / parts;
    const std::int64_t begin = std::min(size, index * chunk);
    const std::int64_t slice = std::min(size, begin + chunk) - begin;
    Piece piece{Box::whole(spec.shape), {}};
    piece.global.offset[dim] = global_at + begin;
    piece.global.extent[dim] = slice;
    piece.local_at[dim] = local_at;
    if (slice > 0) pieces.push_back(piece);
    global_at += size;
    local_at += slice;
  }
  local_shape[dim] = local_at;
}

// `param` as a layout padding its vocabulary to a multiple of `multiple` holds it.
ModelParam padded(const ModelParam& param, std::int64_t multiple) {
  if (!param.vocab || multiple <= 0) return param;
  const int dim = std::max(param.tp_dim, 0);
  if (dim >= static_cast<int>(param.spec.shape.size()) || !param.packed.empty()) {
    refuse("parameter '" + param.spec.name + "': a vocabulary is padded along its tp_dim (or dim " +
           "0), which must exist and hold no packed partitions");
  }
  ModelParam out = param;
  out.spec.real_shape = param.spec.shape;
  out.spec.shape[dim] = (param.spec.shape[dim] + multiple - 1) / multiple * multiple;
  return out;
}

}  // namespace

std::uint64_t ModelSpec::total_bytes() const {
  std::uint64_t total = 0;
  for (const ModelParam& param : params) total += param.spec.bytes();
  return total;
}

std::string Parallelism::str() const {
  std::ostringstream text;
  text << "tp" << tp << " dp" << dp << " pp" << pp << " ep" << ep << " etp" << etp << " x"
       << replicas << " @" << first();
  if (vocab_multiple > 0) text << " vocab%" << vocab_multiple;
  return text.str();
}

Layout build_layout(const ModelSpec& model, const Parallelism& par) {
  check_parallelism(model, par);
  Layout layout;
  const int group = par.tp * par.dp;  // PEs of one pipeline stage of one replica
  const int experts_per_rank = model.experts > 0 ? model.experts / par.ep : 0;
  std::vector<std::int64_t> local_shape;
  std::vector<Piece> pieces;
  for (const ModelParam& model_param : model.params) {
    const ModelParam param = padded(model_param, par.vocab_multiple);
    layout.add_param(param.spec);
    const int stage = stage_of(param, model, par.pp);
    if (param.expert >= model.experts && param.expert >= 0) {
      refuse("parameter '" + param.spec.name + "' is expert " + std::to_string(param.expert) +
             " of a model with " + std::to_string(model.experts));
    }
    for (int replica = 0; replica < par.replicas; ++replica) {
      for (int i = 0; i < group; ++i) {
        const PeId rank = par.first() + i + group * (stage + par.pp * replica);
        if (param.expert < 0) {
          split_shard(param, par.tp, i % par.tp, local_shape, pieces);
        } else {
          const int ep_rank = (i / par.etp) % par.ep;
          if (param.expert / experts_per_rank != ep_rank) continue;
          split_shard(param, par.etp, i % par.etp, local_shape, pieces);
        }
        layout.add_shard(rank, param.spec.name, local_shape, pieces);
      }
    }
  }
  return layout;
}

namespace {

struct DenseDims {
  std::int64_t hidden, heads, kv_heads, head_dim, ffn, vocab;
};

void add(ModelSpec& model, std::string name, std::vector<std::int64_t> shape, int tp_dim, int layer,
         Stage stage = Stage::kLayer, std::vector<std::int64_t> packed = {}, int expert = -1) {
  ModelParam param;
  param.spec = {std::move(name), std::move(shape), DType::kBFloat16};
  param.tp_dim = tp_dim;
  param.packed = std::move(packed);
  param.stage = stage;
  param.layer = layer;
  param.expert = expert;
  model.params.push_back(std::move(param));
}

void add_embeddings(ModelSpec& model, std::int64_t vocab, std::int64_t hidden) {
  add(model, "embed_tokens.weight", {vocab, hidden}, 0, 0, Stage::kFirst);
  model.params.back().vocab = true;
  add(model, "norm.weight", {hidden}, -1, 0, Stage::kLast);
  add(model, "lm_head.weight", {vocab, hidden}, 0, 0, Stage::kLast);
  model.params.back().vocab = true;
}

void add_attention(ModelSpec& model, const std::string& at, int layer, const DenseDims& d) {
  const std::int64_t q = d.heads * d.head_dim;
  const std::int64_t kv = d.kv_heads * d.head_dim;
  add(model, at + "input_layernorm.weight", {d.hidden}, -1, layer);
  add(model, at + "self_attn.qkv_proj.weight", {q + 2 * kv, d.hidden}, 0, layer, Stage::kLayer,
      {q, kv, kv});
  add(model, at + "self_attn.o_proj.weight", {d.hidden, q}, 1, layer);
  add(model, at + "post_attention_layernorm.weight", {d.hidden}, -1, layer);
}

void add_mlp(ModelSpec& model, const std::string& at, int layer, std::int64_t hidden,
             std::int64_t ffn, int expert = -1) {
  add(model, at + "gate_up_proj.weight", {2 * ffn, hidden}, 0, layer, Stage::kLayer, {ffn, ffn},
      expert);
  add(model, at + "down_proj.weight", {hidden, ffn}, 1, layer, Stage::kLayer, {}, expert);
}

ModelSpec dense_model(std::string name, int layers, const DenseDims& d) {
  ModelSpec model{std::move(name), layers, 0, {}};
  add_embeddings(model, d.vocab, d.hidden);
  for (int l = 0; l < layers; ++l) {
    const std::string at = "layers." + std::to_string(l) + ".";
    add_attention(model, at, l, d);
    add_mlp(model, at + "mlp.", l, d.hidden, d.ffn);
  }
  return model;
}

void add_experts(ModelSpec& model, const std::string& at, int layer, std::int64_t hidden,
                 std::int64_t ffn, int experts) {
  add(model, at + "mlp.gate.weight", {experts, hidden}, -1, layer);
  for (int e = 0; e < experts; ++e) {
    add_mlp(model, at + "mlp.experts." + std::to_string(e) + ".", layer, hidden, ffn, e);
  }
}

}  // namespace

ModelSpec llama3_8b_model(int layers) {
  return dense_model("llama3-8b", layers, {4096, 32, 8, 128, 14336, 128256});
}

ModelSpec qwen3_30b_a3b_model(int layers) {
  ModelSpec model{"qwen3-30b-a3b", layers, 128, {}};
  const DenseDims d{2048, 32, 4, 128, 768, 151936};
  add_embeddings(model, d.vocab, d.hidden);
  for (int l = 0; l < layers; ++l) {
    const std::string at = "layers." + std::to_string(l) + ".";
    add_attention(model, at, l, d);
    add(model, at + "self_attn.q_norm.weight", {d.head_dim}, -1, l);
    add(model, at + "self_attn.k_norm.weight", {d.head_dim}, -1, l);
    add_experts(model, at, l, d.hidden, d.ffn, model.experts);
  }
  return model;
}

ModelSpec moe_1t_model(int layers, int experts) {
  ModelSpec model{"moe-1t", layers, experts, {}};
  const std::int64_t hidden = 7168;
  add_embeddings(model, 163840, hidden);
  for (int l = 0; l < layers; ++l) {
    const std::string at = "layers." + std::to_string(l) + ".";
    // Multi-head latent attention (64 heads): low-rank projections replicated, head-wise split.
    add(model, at + "input_layernorm.weight", {hidden}, -1, l);
    add(model, at + "self_attn.q_a_proj.weight", {1536, hidden}, -1, l);
    add(model, at + "self_attn.q_b_proj.weight", {64 * 192, 1536}, 0, l);
    add(model, at + "self_attn.kv_a_proj_with_mqa.weight", {576, hidden}, -1, l);
    add(model, at + "self_attn.kv_b_proj.weight", {64 * 256, 512}, 0, l);
    add(model, at + "self_attn.o_proj.weight", {hidden, 64 * 128}, 1, l);
    add(model, at + "post_attention_layernorm.weight", {hidden}, -1, l);
    add_mlp(model, at + "mlp.shared_experts.", l, hidden, 2048);
    add_experts(model, at, l, hidden, 2048, experts);
  }
  return model;
}

ModelSpec toy_model(int layers, int hidden, int experts) {
  const DenseDims d{hidden, 8, 4, hidden / 8, 2 * hidden, 16 * hidden};
  ModelSpec model =
      experts > 0 ? ModelSpec{"toy-moe", layers, experts, {}} : dense_model("toy", layers, d);
  if (experts == 0) return model;
  add_embeddings(model, d.vocab, d.hidden);
  for (int l = 0; l < layers; ++l) {
    const std::string at = "layers." + std::to_string(l) + ".";
    add_attention(model, at, l, d);
    add_experts(model, at, l, d.hidden, d.ffn, experts);
  }
  return model;
}

}  // namespace reshard
