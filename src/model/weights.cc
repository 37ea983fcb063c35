#include "model/weights.h"

#include <cmath>
#include <cstring>
#include <set>

#include <fmt/format.h>

#include "core/logging.h"
#include "model/safetensors.h"

namespace moe::model {
namespace {

std::string layer_name(int layer, const char* suffix) { return fmt::format("model.layers.{}.{}", layer, suffix); }

// Looks a tensor up, checks its shape and dtype, and records it as used.
class TensorFetcher {
 public:
  explicit TensorFetcher(const SafetensorsCheckpoint& checkpoint) : checkpoint_(checkpoint) {}

  Expected<TensorView> get(const std::string& name, Shape expected) {
    auto view = checkpoint_.view(name);
    if (!view) return view.status();
    if (!(view->shape() == expected))
      return invalid_argument("tensor '{}' has shape {}, the config implies {}", name, view->shape().to_string(),
                              expected.to_string());
    const DType dtype = view->dtype();
    if (dtype != DType::kBF16 && dtype != DType::kF32 && dtype != DType::kF16)
      return unimplemented("tensor '{}' has dtype {}; bf16, f16 and f32 weights are supported", name,
                           dtype_name(dtype));
    used_.insert(name);
    return view;
  }

  // Every tensor of the checkpoint must have been used.
  Status check_all_used() const {
    std::vector<std::string> unused;
    for (const auto& name : checkpoint_.tensor_names())
      if (!used_.count(name)) unused.push_back(name);
    if (unused.empty()) return Status::ok();
    const size_t shown = std::min<size_t>(unused.size(), 5);
    return invalid_argument("{} tensor(s) in the checkpoint are not used by the {} model: {}{}", unused.size(),
                            "config's", fmt::join(unused.begin(), unused.begin() + static_cast<long>(shown), ", "),
                            unused.size() > shown ? ", ..." : "");
  }

 private:
  const SafetensorsCheckpoint& checkpoint_;
  std::set<std::string> used_;
};

// Copies `src` (any float dtype) into `dst` (same dtype and element count).
void copy_into(TensorView src, char* dst) { std::memcpy(dst, src.data(), src.num_bytes()); }

// Fills a tensor with uniform values in [center - scale, center + scale],
// deterministic in (seed, stream) whatever the thread count.
void fill_uniform(Tensor& t, uint64_t seed, uint64_t stream, float center, float scale, ThreadPool& pool) {
  const int64_t n = t.num_elements();
  constexpr int64_t kBlock = 1 << 16;
  pool.parallel_for(0, (n + kBlock - 1) / kBlock, 1, [&](int64_t begin, int64_t end) {
    for (int64_t block = begin; block < end; ++block) {
      uint64_t state = seed * 0x9E3779B97F4A7C15ull ^ (stream << 32) ^ static_cast<uint64_t>(block);
      for (int64_t i = block * kBlock; i < std::min(n, (block + 1) * kBlock); ++i) {
        // splitmix64
        uint64_t z = (state += 0x9E3779B97F4A7C15ull);
        z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
        z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
        z ^= z >> 31;
        const float value = center + scale * (static_cast<float>(z >> 40) * (1.0f / 16777216.0f) * 2.0f - 1.0f);
        if (t.dtype() == DType::kBF16) {
          t.data_as<uint16_t>()[i] = float_to_bf16(value);
        } else {
          store_from_float(t.dtype(), t.data(), i, value);
        }
      }
    }
  });
}

}  // namespace

ModelWeights::ModelWeights(ModelConfig config) : config_(std::move(config)) {}
ModelWeights::ModelWeights(ModelWeights&&) noexcept = default;
ModelWeights& ModelWeights::operator=(ModelWeights&&) noexcept = default;
ModelWeights::~ModelWeights() = default;

TensorView ModelWeights::own(Tensor tensor) {
  owned_.push_back(std::move(tensor));
  return owned_.back().view();
}

size_t ModelWeights::num_bytes() const {
  size_t total = embed_tokens_.num_bytes() + final_norm_.num_bytes();
  if (lm_head_.data() != embed_tokens_.data()) total += lm_head_.num_bytes();
  for (const auto& l : layers_)
    for (const TensorView* v : {&l.input_norm, &l.post_attention_norm, &l.q_proj, &l.k_proj, &l.v_proj, &l.o_proj,
                                &l.q_norm, &l.k_norm, &l.router, &l.w13, &l.w2})
      total += v->num_bytes();
  return total;
}

Expected<ModelWeights> ModelWeights::load(const std::string& model_dir, const ModelConfig& config, ThreadPool& pool) {
  (void)pool;
  if (!config.quantization.method.empty())
    return unimplemented("{}: quantized checkpoints ('{}') are not supported yet", model_dir, config.quantization.method);
  MOE_ASSIGN_OR_RETURN(auto checkpoint, SafetensorsCheckpoint::open(model_dir));
  ModelWeights w(config);
  w.checkpoint_ = std::make_unique<SafetensorsCheckpoint>(std::move(checkpoint));
  TensorFetcher fetch(*w.checkpoint_);
  const int64_t hidden = config.hidden_size, vocab = config.vocab_size;
  const int64_t q_size = config.q_size(), kv_size = config.kv_size(), head_dim = config.head_dim;

  MOE_ASSIGN_OR_RETURN(w.embed_tokens_, fetch.get("model.embed_tokens.weight", {vocab, hidden}));
  MOE_ASSIGN_OR_RETURN(w.final_norm_, fetch.get("model.norm.weight", {hidden}));
  if (config.tie_word_embeddings) {
    w.lm_head_ = w.embed_tokens_;
  } else {
    MOE_ASSIGN_OR_RETURN(w.lm_head_, fetch.get("lm_head.weight", {vocab, hidden}));
  }
  for (int l = 0; l < config.num_layers; ++l) {
    LayerWeights lw;
    MOE_ASSIGN_OR_RETURN(lw.input_norm, fetch.get(layer_name(l, "input_layernorm.weight"), {hidden}));
    MOE_ASSIGN_OR_RETURN(lw.post_attention_norm, fetch.get(layer_name(l, "post_attention_layernorm.weight"), {hidden}));
    MOE_ASSIGN_OR_RETURN(lw.q_proj, fetch.get(layer_name(l, "self_attn.q_proj.weight"), {q_size, hidden}));
    MOE_ASSIGN_OR_RETURN(lw.k_proj, fetch.get(layer_name(l, "self_attn.k_proj.weight"), {kv_size, hidden}));
    MOE_ASSIGN_OR_RETURN(lw.v_proj, fetch.get(layer_name(l, "self_attn.v_proj.weight"), {kv_size, hidden}));
    MOE_ASSIGN_OR_RETURN(lw.o_proj, fetch.get(layer_name(l, "self_attn.o_proj.weight"), {hidden, q_size}));
    MOE_ASSIGN_OR_RETURN(lw.q_norm, fetch.get(layer_name(l, "self_attn.q_norm.weight"), {head_dim}));
    MOE_ASSIGN_OR_RETURN(lw.k_norm, fetch.get(layer_name(l, "self_attn.k_norm.weight"), {head_dim}));
    lw.is_moe = config.layer_is_moe(l);
    const int64_t inter = lw.is_moe ? config.moe_intermediate_size : config.intermediate_size;
    if (lw.is_moe) {
      const int64_t num_experts = config.num_experts;
      MOE_ASSIGN_OR_RETURN(lw.router, fetch.get(layer_name(l, "mlp.gate.weight"), {num_experts, hidden}));
      DType dtype = lw.router.dtype();
      Tensor w13(dtype, {num_experts, 2 * inter, hidden});
      Tensor w2(dtype, {num_experts, hidden, inter});
      const size_t half_bytes = dtype_bytes(dtype, inter * hidden);
      for (int64_t e = 0; e < num_experts; ++e) {
        const std::string prefix = fmt::format("model.layers.{}.mlp.experts.{}.", l, e);
        MOE_ASSIGN_OR_RETURN(auto gate, fetch.get(prefix + "gate_proj.weight", {inter, hidden}));
        MOE_ASSIGN_OR_RETURN(auto up, fetch.get(prefix + "up_proj.weight", {inter, hidden}));
        MOE_ASSIGN_OR_RETURN(auto down, fetch.get(prefix + "down_proj.weight", {hidden, inter}));
        for (const TensorView* v : {&gate, &up, &down})
          if (v->dtype() != dtype)
            return invalid_argument("layer {} expert {}: dtype {} differs from the router's {}", l, e,
                                    dtype_name(v->dtype()), dtype_name(dtype));
        char* base = static_cast<char*>(w13.view().slice0(e).data());
        copy_into(gate, base);
        copy_into(up, base + half_bytes);
        copy_into(down, static_cast<char*>(w2.view().slice0(e).data()));
      }
      lw.w13 = w.own(std::move(w13));
      lw.w2 = w.own(std::move(w2));
    } else {
      MOE_ASSIGN_OR_RETURN(auto gate, fetch.get(layer_name(l, "mlp.gate_proj.weight"), {inter, hidden}));
      MOE_ASSIGN_OR_RETURN(auto up, fetch.get(layer_name(l, "mlp.up_proj.weight"), {inter, hidden}));
      MOE_ASSIGN_OR_RETURN(lw.w2, fetch.get(layer_name(l, "mlp.down_proj.weight"), {hidden, inter}));
      if (gate.dtype() != up.dtype())
        return invalid_argument("layer {}: gate_proj and up_proj dtypes differ", l);
      Tensor w13(gate.dtype(), {2 * inter, hidden});
      copy_into(gate, static_cast<char*>(w13.data()));
      copy_into(up, static_cast<char*>(w13.data()) + gate.num_bytes());
      lw.w13 = w.own(std::move(w13));
    }
    w.layers_.push_back(lw);
  }
  if (auto status = fetch.check_all_used(); !status.is_ok()) return status.with_context(model_dir);
  return w;
}

ModelWeights ModelWeights::dummy(const ModelConfig& config, uint64_t seed, ThreadPool& pool) {
  ModelWeights w(config);
  const DType dtype = config.dtype;
  uint64_t stream = 0;
  auto random = [&](Shape shape, float center, float scale) {
    Tensor t(dtype, shape);
    fill_uniform(t, seed, stream++, center, scale, pool);
    return w.own(std::move(t));
  };
  const int64_t hidden = config.hidden_size, vocab = config.vocab_size;
  const float hidden_scale = 1.0f / std::sqrt(static_cast<float>(hidden));
  w.embed_tokens_ = random({vocab, hidden}, 0.0f, 1.0f);
  w.final_norm_ = random({hidden}, 1.0f, 0.1f);
  w.lm_head_ = config.tie_word_embeddings ? w.embed_tokens_ : random({vocab, hidden}, 0.0f, hidden_scale);
  for (int l = 0; l < config.num_layers; ++l) {
    LayerWeights lw;
    lw.input_norm = random({hidden}, 1.0f, 0.1f);
    lw.post_attention_norm = random({hidden}, 1.0f, 0.1f);
    lw.q_proj = random({config.q_size(), hidden}, 0.0f, hidden_scale);
    lw.k_proj = random({config.kv_size(), hidden}, 0.0f, hidden_scale);
    lw.v_proj = random({config.kv_size(), hidden}, 0.0f, hidden_scale);
    lw.o_proj = random({hidden, config.q_size()}, 0.0f, 1.0f / std::sqrt(static_cast<float>(config.q_size())));
    lw.q_norm = random({config.head_dim}, 1.0f, 0.1f);
    lw.k_norm = random({config.head_dim}, 1.0f, 0.1f);
    lw.is_moe = config.layer_is_moe(l);
    if (lw.is_moe) {
      const int64_t inter = config.moe_intermediate_size, experts = config.num_experts;
      lw.router = random({experts, hidden}, 0.0f, hidden_scale);
      lw.w13 = random({experts, 2 * inter, hidden}, 0.0f, hidden_scale);
      lw.w2 = random({experts, hidden, inter}, 0.0f, 1.0f / std::sqrt(static_cast<float>(inter)));
    } else {
      const int64_t inter = config.intermediate_size;
      lw.w13 = random({2 * inter, hidden}, 0.0f, hidden_scale);
      lw.w2 = random({hidden, inter}, 0.0f, 1.0f / std::sqrt(static_cast<float>(inter)));
    }
    w.layers_.push_back(lw);
  }
  return w;
}

}  // namespace moe::model
