#include "model/weights.h"

#include <cmath>
#include <cstring>

#include <fmt/format.h>

#include "core/logging.h"
#include "model/safetensors.h"
#include "model/tensor_fetcher.h"

namespace moe::model {
namespace {

std::string layer_name(int layer, const char* suffix) { return fmt::format("model.layers.{}.{}", layer, suffix); }

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

ops::QuantizedTensor ModelWeights::own(OwnedQuantized quantized) {
  owned_quantized_.push_back(std::move(quantized));
  return owned_quantized_.back().view();
}

size_t ModelWeights::num_bytes() const {
  size_t total = embed_tokens_.num_bytes() + final_norm_.num_bytes();
  if (lm_head_.data() != embed_tokens_.data()) total += lm_head_.num_bytes();
  for (const auto& l : layers_)
    for (const TensorView* v : {&l.input_norm, &l.post_attention_norm, &l.q_proj, &l.k_proj, &l.v_proj, &l.o_proj,
                                &l.q_norm, &l.k_norm, &l.router, &l.w13, &l.w2})
      total += v->num_bytes();
  for (const auto& l : layers_)
    for (const ops::QuantizedTensor* q :
         {&l.q_proj_quant, &l.k_proj_quant, &l.v_proj_quant, &l.o_proj_quant, &l.w13_quant, &l.w2_quant})
      total += q->num_bytes();
  return total;
}

Status ModelWeights::load_projection(TensorFetcher& fetch, const std::string& name, Shape shape, TensorView& plain,
                                     ops::QuantizedTensor& quant) {
  const ops::QuantFormat format = config_.quantization.format;
  if (format == ops::QuantFormat::kNone || !fetch.has(quant_tensor_names(format, name).scales)) {
    const TensorInfo* info = fetch.find(name);
    if (format != ops::QuantFormat::kNone && info != nullptr &&
        info->dtype == stored_values_spec(format, shape[0], shape[1]).dtype)
      return not_found("tensor '{}' is quantized ({}) but its scale tensor '{}' is missing", name,
                       safetensors_dtype_name(info->dtype), quant_tensor_names(format, name).scales);
    MOE_ASSIGN_OR_RETURN(plain, fetch.get(name, shape));
    return Status::ok();
  }
  MOE_ASSIGN_OR_RETURN(auto src, read_quantized(fetch, format, name, shape[0], shape[1]));
  OwnedQuantized owned = allocate_quantized(format, 0, shape[0], shape[1]);
  MOE_RETURN_IF_ERROR(copy_quantized_rows(src, owned, -1, 0, name));
  quant = own(std::move(owned));
  return Status::ok();
}

// Gate, up and down of every expert (or of the dense MLP) in the checkpoint's
// format, packed into w13 (gate rows, then up rows) and w2.
Status ModelWeights::load_quantized_mlp(TensorFetcher& fetch, int l, LayerWeights& lw) {
  const ops::QuantFormat format = config_.quantization.format;
  const int64_t hidden = config_.hidden_size;
  const int64_t inter = lw.is_moe ? config_.moe_intermediate_size : config_.intermediate_size;
  const int64_t num_groups = lw.is_moe ? config_.num_experts : 0;
  OwnedQuantized w13 = allocate_quantized(format, num_groups, 2 * inter, hidden, inter);
  OwnedQuantized w2 = allocate_quantized(format, num_groups, hidden, inter);
  for (int64_t e = 0; e < std::max<int64_t>(num_groups, 1); ++e) {
    const std::string prefix =
        lw.is_moe ? fmt::format("model.layers.{}.mlp.experts.{}.", l, e) : fmt::format("model.layers.{}.mlp.", l);
    const int64_t group = lw.is_moe ? e : -1;
    MOE_ASSIGN_OR_RETURN(auto gate, read_quantized(fetch, format, prefix + "gate_proj.weight", inter, hidden));
    MOE_ASSIGN_OR_RETURN(auto up, read_quantized(fetch, format, prefix + "up_proj.weight", inter, hidden));
    MOE_ASSIGN_OR_RETURN(auto down, read_quantized(fetch, format, prefix + "down_proj.weight", hidden, inter));
    MOE_RETURN_IF_ERROR(copy_quantized_rows(gate, w13, group, 0, prefix + "gate_proj"));
    MOE_RETURN_IF_ERROR(copy_quantized_rows(up, w13, group, inter, prefix + "gate_proj and up_proj"));
    MOE_RETURN_IF_ERROR(copy_quantized_rows(down, w2, group, 0, prefix + "down_proj"));
  }
  lw.w13_quant = own(std::move(w13));
  lw.w2_quant = own(std::move(w2));
  return Status::ok();
}

Status ModelWeights::load_layer(TensorFetcher& fetch, int l) {
  const ModelConfig& config = config_;
  const int64_t hidden = config.hidden_size, q_size = config.q_size(), kv_size = config.kv_size();
  const int64_t head_dim = config.head_dim;
  LayerWeights lw;
  MOE_ASSIGN_OR_RETURN(lw.input_norm, fetch.get(layer_name(l, "input_layernorm.weight"), {hidden}));
  MOE_ASSIGN_OR_RETURN(lw.post_attention_norm, fetch.get(layer_name(l, "post_attention_layernorm.weight"), {hidden}));
  MOE_RETURN_IF_ERROR(
      load_projection(fetch, layer_name(l, "self_attn.q_proj.weight"), {q_size, hidden}, lw.q_proj, lw.q_proj_quant));
  MOE_RETURN_IF_ERROR(
      load_projection(fetch, layer_name(l, "self_attn.k_proj.weight"), {kv_size, hidden}, lw.k_proj, lw.k_proj_quant));
  MOE_RETURN_IF_ERROR(
      load_projection(fetch, layer_name(l, "self_attn.v_proj.weight"), {kv_size, hidden}, lw.v_proj, lw.v_proj_quant));
  MOE_RETURN_IF_ERROR(
      load_projection(fetch, layer_name(l, "self_attn.o_proj.weight"), {hidden, q_size}, lw.o_proj, lw.o_proj_quant));
  MOE_ASSIGN_OR_RETURN(lw.q_norm, fetch.get(layer_name(l, "self_attn.q_norm.weight"), {head_dim}));
  MOE_ASSIGN_OR_RETURN(lw.k_norm, fetch.get(layer_name(l, "self_attn.k_norm.weight"), {head_dim}));
  lw.is_moe = config.layer_is_moe(l);
  const int64_t inter = lw.is_moe ? config.moe_intermediate_size : config.intermediate_size;
  const ops::QuantFormat format = config.quantization.format;
  // A quantized checkpoint has every MLP projection quantized (attention ones may stay bf16).
  const bool quantized_mlp = format != ops::QuantFormat::kNone;
  if (lw.is_moe) {
    const int64_t num_experts = config.num_experts;
    MOE_ASSIGN_OR_RETURN(lw.router, fetch.get(layer_name(l, "mlp.gate.weight"), {num_experts, hidden}));
    if (quantized_mlp) {
      MOE_RETURN_IF_ERROR(load_quantized_mlp(fetch, l, lw));
    } else {
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
      lw.w13 = own(std::move(w13));
      lw.w2 = own(std::move(w2));
    }
  } else if (quantized_mlp) {
    MOE_RETURN_IF_ERROR(load_quantized_mlp(fetch, l, lw));
  } else {
    MOE_ASSIGN_OR_RETURN(auto gate, fetch.get(layer_name(l, "mlp.gate_proj.weight"), {inter, hidden}));
    MOE_ASSIGN_OR_RETURN(auto up, fetch.get(layer_name(l, "mlp.up_proj.weight"), {inter, hidden}));
    MOE_ASSIGN_OR_RETURN(lw.w2, fetch.get(layer_name(l, "mlp.down_proj.weight"), {hidden, inter}));
    if (gate.dtype() != up.dtype()) return invalid_argument("layer {}: gate_proj and up_proj dtypes differ", l);
    Tensor w13(gate.dtype(), {2 * inter, hidden});
    copy_into(gate, static_cast<char*>(w13.data()));
    copy_into(up, static_cast<char*>(w13.data()) + gate.num_bytes());
    lw.w13 = own(std::move(w13));
  }
  layers_.push_back(lw);
  return Status::ok();
}

Expected<ModelWeights> ModelWeights::load(const std::string& model_dir, const ModelConfig& config, ThreadPool& pool) {
  (void)pool;
  MOE_ASSIGN_OR_RETURN(auto checkpoint, SafetensorsCheckpoint::open(model_dir));
  ModelWeights w(config);
  w.quant_format_ = config.quantization.format;
  w.checkpoint_ = std::make_unique<SafetensorsCheckpoint>(std::move(checkpoint));
  TensorFetcher fetch(*w.checkpoint_);
  const int64_t hidden = config.hidden_size, vocab = config.vocab_size;
  MOE_ASSIGN_OR_RETURN(w.embed_tokens_, fetch.get("model.embed_tokens.weight", {vocab, hidden}));
  MOE_ASSIGN_OR_RETURN(w.final_norm_, fetch.get("model.norm.weight", {hidden}));
  if (config.tie_word_embeddings) {
    w.lm_head_ = w.embed_tokens_;
  } else {
    MOE_ASSIGN_OR_RETURN(w.lm_head_, fetch.get("lm_head.weight", {vocab, hidden}));
  }
  for (int l = 0; l < config.num_layers; ++l)
    if (auto status = w.load_layer(fetch, l); !status.is_ok()) return status.with_context(model_dir);
  const auto target_tensor = [](std::string_view name) { return !is_mtp_tensor(name); };
  if (auto status = fetch.check_all_used(target_tensor); !status.is_ok()) return status.with_context(model_dir);
  return w;
}

ModelWeights ModelWeights::dummy(const ModelConfig& config, uint64_t seed, ThreadPool& pool,
                                 ops::QuantFormat quantization) {
  ModelWeights w(config);
  w.quant_format_ = quantization;
  const DType dtype = config.dtype;
  uint64_t stream = 0;
  auto random = [&](Shape shape, float center, float scale) {
    Tensor t(dtype, shape);
    fill_uniform(t, seed, stream++, center, scale, pool);
    return w.own(std::move(t));
  };
  // A projection [(groups,) rows, cols]: plain, or quantized when a format is given.
  auto projection = [&](int64_t groups, int64_t rows, int64_t cols, int64_t row_period, float scale,
                        TensorView& plain, ops::QuantizedTensor& quant) {
    if (quantization == ops::QuantFormat::kNone) {
      plain = groups > 0 ? random({groups, rows, cols}, 0.0f, scale) : random({rows, cols}, 0.0f, scale);
      return;
    }
    CHECK(ops::check_quantizable(quantization, rows, cols).is_ok(), "dummy [{}, {}] in {}", rows, cols,
          ops::quant_format_name(quantization));
    OwnedQuantized q = allocate_quantized(quantization, groups, rows, cols, row_period);
    fill_random_quantized(q, scale, seed, stream++, pool);
    quant = w.own(std::move(q));
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
    projection(0, config.q_size(), hidden, 0, hidden_scale, lw.q_proj, lw.q_proj_quant);
    projection(0, config.kv_size(), hidden, 0, hidden_scale, lw.k_proj, lw.k_proj_quant);
    projection(0, config.kv_size(), hidden, 0, hidden_scale, lw.v_proj, lw.v_proj_quant);
    projection(0, hidden, config.q_size(), 0, 1.0f / std::sqrt(static_cast<float>(config.q_size())), lw.o_proj,
               lw.o_proj_quant);
    lw.q_norm = random({config.head_dim}, 1.0f, 0.1f);
    lw.k_norm = random({config.head_dim}, 1.0f, 0.1f);
    lw.is_moe = config.layer_is_moe(l);
    const int64_t inter = lw.is_moe ? config.moe_intermediate_size : config.intermediate_size;
    const int64_t groups = lw.is_moe ? config.num_experts : 0;
    if (lw.is_moe) lw.router = random({config.num_experts, hidden}, 0.0f, hidden_scale);
    projection(groups, 2 * inter, hidden, inter, hidden_scale, lw.w13, lw.w13_quant);
    projection(groups, hidden, inter, 0, 1.0f / std::sqrt(static_cast<float>(inter)), lw.w2, lw.w2_quant);
    w.layers_.push_back(lw);
  }
  return w;
}

}  // namespace moe::model
