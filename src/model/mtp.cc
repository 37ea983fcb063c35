#include "model/mtp.h"

#include <algorithm>
#include <cmath>
#include <cstring>

#include <fmt/format.h>

#include "core/check.h"
#include "model/safetensors.h"
#include "model/tensor_fetcher.h"
#include "ops/embedding.h"
#include "ops/linear.h"
#include "ops/moe.h"
#include "ops/norm.h"

namespace moe::model {
namespace {

constexpr const char* kLayer = "mtp.layers.0.";

// Uniform values in [center - scale, center + scale], deterministic in (seed, stream).
Tensor random_tensor(DType dtype, Shape shape, uint64_t seed, uint64_t stream, float center, float scale) {
  Tensor t(dtype, shape);
  uint64_t state = seed * 0x9E3779B97F4A7C15ull ^ (stream << 40) ^ 0x6d7470ull;
  for (int64_t i = 0; i < t.num_elements(); ++i) {
    uint64_t z = (state += 0x9E3779B97F4A7C15ull);  // splitmix64
    z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
    z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
    z ^= z >> 31;
    const float value = center + scale * (static_cast<float>(z >> 40) * (1.0f / 16777216.0f) * 2.0f - 1.0f);
    store_from_float(dtype, t.data(), i, value);
  }
  return t;
}

}  // namespace

Expected<bool> has_mtp_tensors(const std::string& dir) {
  MOE_ASSIGN_OR_RETURN(auto checkpoint, SafetensorsCheckpoint::open(dir));
  const std::vector<std::string> names = checkpoint.tensor_names();
  return std::any_of(names.begin(), names.end(), [](const std::string& name) { return is_mtp_tensor(name); });
}

MtpWeights::MtpWeights(ModelConfig config) : config_(std::move(config)) {}
MtpWeights::MtpWeights(MtpWeights&&) noexcept = default;
MtpWeights& MtpWeights::operator=(MtpWeights&&) noexcept = default;
MtpWeights::~MtpWeights() = default;

TensorView MtpWeights::own(Tensor tensor) {
  owned_.push_back(std::move(tensor));
  return owned_.back().view();
}

Expected<MtpWeights> MtpWeights::load(const std::string& dir, const ModelConfig& config, MtpCheckpoint kind) {
  if (config.quantization.format != ops::QuantFormat::kNone)
    return unimplemented("MTP weights for a quantized target model are not supported yet");
  MOE_ASSIGN_OR_RETURN(auto checkpoint, SafetensorsCheckpoint::open(dir));
  MtpWeights w(config);
  w.checkpoint_ = std::make_unique<SafetensorsCheckpoint>(std::move(checkpoint));
  TensorFetcher fetch(*w.checkpoint_);
  const bool in_model = kind == MtpCheckpoint::kModel;  // only the mtp.* tensors are this loader's
  const int64_t hidden = config.hidden_size, head_dim = config.head_dim;
  auto name = [](const char* suffix) { return std::string(kLayer) + suffix; };
  auto load_all = [&]() -> Status {
    MOE_ASSIGN_OR_RETURN(w.embed_norm_, fetch.get("mtp.pre_fc_norm_embedding.weight", {hidden}));
    MOE_ASSIGN_OR_RETURN(w.hidden_norm_, fetch.get("mtp.pre_fc_norm_hidden.weight", {hidden}));
    MOE_ASSIGN_OR_RETURN(w.fc_, fetch.get("mtp.fc.weight", {hidden, 2 * hidden}));
    MOE_ASSIGN_OR_RETURN(w.final_norm_, fetch.get("mtp.norm.weight", {hidden}));
    LayerWeights& lw = w.layer_;
    MOE_ASSIGN_OR_RETURN(lw.input_norm, fetch.get(name("input_layernorm.weight"), {hidden}));
    MOE_ASSIGN_OR_RETURN(lw.post_attention_norm, fetch.get(name("post_attention_layernorm.weight"), {hidden}));
    MOE_ASSIGN_OR_RETURN(lw.q_proj, fetch.get(name("self_attn.q_proj.weight"), {config.q_size(), hidden}));
    MOE_ASSIGN_OR_RETURN(lw.k_proj, fetch.get(name("self_attn.k_proj.weight"), {config.kv_size(), hidden}));
    MOE_ASSIGN_OR_RETURN(lw.v_proj, fetch.get(name("self_attn.v_proj.weight"), {config.kv_size(), hidden}));
    MOE_ASSIGN_OR_RETURN(lw.o_proj, fetch.get(name("self_attn.o_proj.weight"), {hidden, config.q_size()}));
    MOE_ASSIGN_OR_RETURN(lw.q_norm, fetch.get(name("self_attn.q_norm.weight"), {head_dim}));
    MOE_ASSIGN_OR_RETURN(lw.k_norm, fetch.get(name("self_attn.k_norm.weight"), {head_dim}));
    lw.is_moe = fetch.has(name("mlp.gate.weight"));
    if (lw.is_moe) {
      if (config.num_experts < 1) return invalid_argument("an MoE MTP layer needs a target config with experts");
      const int64_t num_experts = config.num_experts, inter = config.moe_intermediate_size;
      MOE_ASSIGN_OR_RETURN(lw.router, fetch.get(name("mlp.gate.weight"), {num_experts, hidden}));
      const DType dtype = lw.router.dtype();
      Tensor w13(dtype, {num_experts, 2 * inter, hidden});
      Tensor w2(dtype, {num_experts, hidden, inter});
      for (int64_t e = 0; e < num_experts; ++e) {
        const std::string prefix = fmt::format("{}mlp.experts.{}.", kLayer, e);
        MOE_ASSIGN_OR_RETURN(auto gate, fetch.get(prefix + "gate_proj.weight", {inter, hidden}));
        MOE_ASSIGN_OR_RETURN(auto up, fetch.get(prefix + "up_proj.weight", {inter, hidden}));
        MOE_ASSIGN_OR_RETURN(auto down, fetch.get(prefix + "down_proj.weight", {hidden, inter}));
        for (const TensorView* v : {&gate, &up, &down})
          if (v->dtype() != dtype) return invalid_argument("MTP expert {}: dtype differs from the router's", e);
        char* base = static_cast<char*>(w13.view().slice0(e).data());
        std::memcpy(base, gate.data(), gate.num_bytes());
        std::memcpy(base + gate.num_bytes(), up.data(), up.num_bytes());
        std::memcpy(w2.view().slice0(e).data(), down.data(), down.num_bytes());
      }
      lw.w13 = w.own(std::move(w13));
      lw.w2 = w.own(std::move(w2));
    } else {
      const int64_t inter = config.intermediate_size;
      if (inter < 1) return invalid_argument("a dense MTP layer needs intermediate_size in the target config");
      MOE_ASSIGN_OR_RETURN(auto gate, fetch.get(name("mlp.gate_proj.weight"), {inter, hidden}));
      MOE_ASSIGN_OR_RETURN(auto up, fetch.get(name("mlp.up_proj.weight"), {inter, hidden}));
      MOE_ASSIGN_OR_RETURN(lw.w2, fetch.get(name("mlp.down_proj.weight"), {hidden, inter}));
      if (gate.dtype() != up.dtype()) return invalid_argument("MTP gate_proj and up_proj dtypes differ");
      Tensor w13(gate.dtype(), {2 * inter, hidden});
      std::memcpy(w13.data(), gate.data(), gate.num_bytes());
      std::memcpy(static_cast<char*>(w13.data()) + gate.num_bytes(), up.data(), up.num_bytes());
      lw.w13 = w.own(std::move(w13));
    }
    return in_model ? fetch.check_all_used(is_mtp_tensor) : fetch.check_all_used();
  };
  const char* what = in_model ? "MTP layer (mtp.*) of the model checkpoint" : "MTP checkpoint";
  if (Status s = load_all(); !s.is_ok()) return s.with_context(fmt::format("{} {}", what, dir));
  return w;
}

MtpWeights MtpWeights::dummy(const ModelConfig& config, uint64_t seed, bool moe) {
  CHECK(!moe || config.num_experts > 0, "an MoE MTP layer needs experts in the config");
  MtpWeights w(config);
  const DType dtype = config.dtype;
  uint64_t stream = 0;
  auto random = [&](Shape shape, float center, float scale) {
    return w.own(random_tensor(dtype, shape, seed, stream++, center, scale));
  };
  const int64_t hidden = config.hidden_size;
  const auto inv_sqrt = [](int64_t n) { return 1.0f / std::sqrt(static_cast<float>(n)); };
  w.embed_norm_ = random({hidden}, 1.0f, 0.1f);
  w.hidden_norm_ = random({hidden}, 1.0f, 0.1f);
  w.fc_ = random({hidden, 2 * hidden}, 0.0f, inv_sqrt(2 * hidden));
  w.final_norm_ = random({hidden}, 1.0f, 0.1f);
  LayerWeights& lw = w.layer_;
  lw.input_norm = random({hidden}, 1.0f, 0.1f);
  lw.post_attention_norm = random({hidden}, 1.0f, 0.1f);
  lw.q_proj = random({config.q_size(), hidden}, 0.0f, inv_sqrt(hidden));
  lw.k_proj = random({config.kv_size(), hidden}, 0.0f, inv_sqrt(hidden));
  lw.v_proj = random({config.kv_size(), hidden}, 0.0f, inv_sqrt(hidden));
  lw.o_proj = random({hidden, config.q_size()}, 0.0f, inv_sqrt(config.q_size()));
  lw.q_norm = random({config.head_dim}, 1.0f, 0.1f);
  lw.k_norm = random({config.head_dim}, 1.0f, 0.1f);
  lw.is_moe = moe;
  if (moe) {
    const int64_t e = config.num_experts, inter = config.moe_intermediate_size;
    lw.router = random({e, hidden}, 0.0f, inv_sqrt(hidden));
    lw.w13 = random({e, 2 * inter, hidden}, 0.0f, inv_sqrt(hidden));
    lw.w2 = random({e, hidden, inter}, 0.0f, inv_sqrt(inter));
  } else {
    const int64_t inter = config.intermediate_size;
    lw.w13 = random({2 * inter, hidden}, 0.0f, inv_sqrt(hidden));
    lw.w2 = random({hidden, inter}, 0.0f, inv_sqrt(inter));
  }
  return w;
}

MtpModel::MtpModel(const MtpWeights& weights, const ModelWeights& target)
    : weights_(weights), target_(target), rope_(ops::make_rope_table(weights.config().rope)) {
  CHECK(weights.config().hidden_size == target.config().hidden_size, "MTP and target hidden sizes differ");
}

void MtpModel::attention_block(ThreadPool& pool, const MtpBatch& batch, const ops::PagedKv& kv, TensorView x,
                               TensorView out) const {
  const ModelConfig& c = config();
  const LayerWeights& w = weights_.layer();
  const int64_t n = batch.num_tokens();
  Tensor q(DType::kF32, {n, c.num_q_heads, c.head_dim});
  Tensor k(DType::kF32, {n, c.num_kv_heads, c.head_dim});
  Tensor v(DType::kF32, {n, c.num_kv_heads, c.head_dim});
  ops::cpu::linear(pool, x, w.q_proj, q.view().reshaped({n, c.q_size()}));
  ops::cpu::linear(pool, x, w.k_proj, k.view().reshaped({n, c.kv_size()}));
  ops::cpu::linear(pool, x, w.v_proj, v.view().reshaped({n, c.kv_size()}));
  auto per_head = [&](const Tensor& t) { return t.view().reshaped({t.num_elements() / c.head_dim, c.head_dim}); };
  ops::cpu::rms_norm(pool, per_head(q), w.q_norm, c.rms_norm_eps, per_head(q));
  ops::cpu::rms_norm(pool, per_head(k), w.k_norm, c.rms_norm_eps, per_head(k));
  ops::cpu::apply_rope(pool, q, batch.positions, rope_);
  ops::cpu::apply_rope(pool, k, batch.positions, rope_);
  ops::AttentionBatch attention{batch.query_start, batch.positions, batch.page_table, batch.max_pages_per_seq};
  ops::cpu::write_kv(pool, k, v, attention, kv);
  Tensor attended(DType::kF32, {n, c.q_size()});
  ops::cpu::paged_attention(pool, q, attention, kv, 1.0f / std::sqrt(static_cast<float>(c.head_dim)), attended);
  ops::cpu::linear(pool, attended, w.o_proj, out);
}

void MtpModel::mlp_block(ThreadPool& pool, TensorView x, TensorView out) const {
  const ModelConfig& c = config();
  const LayerWeights& w = weights_.layer();
  if (!w.is_moe) {
    ops::cpu::swiglu_mlp(pool, x, w.w13, w.w2, out);
    return;
  }
  const int64_t n = x.dim(0), k = c.num_experts_per_tok;
  Tensor router_logits(DType::kF32, {n, c.num_experts});
  ops::cpu::linear(pool, x, w.router, router_logits);
  Tensor expert_ids(DType::kI32, {n, k});
  Tensor expert_weights(DType::kF32, {n, k});
  ops::cpu::route_topk(pool, router_logits, static_cast<int>(k), c.norm_topk_prob, expert_ids, expert_weights);
  ops::cpu::moe_experts(pool, x, expert_ids, expert_weights, w.w13, w.w2, out);
}

MtpOutput MtpModel::forward(ThreadPool& pool, const MtpBatch& batch, TensorView hidden, const ops::PagedKv& kv) const {
  const ModelConfig& c = config();
  const int64_t n = batch.num_tokens(), h = c.hidden_size;
  CHECK(hidden.dtype() == DType::kF32 && hidden.dim(0) == n && hidden.dim(1) == h, "MTP hidden [{}, {}] f32", n, h);
  CHECK(batch.positions.size() == batch.token_ids.size(), "MTP positions vs token ids");
  // [e ; g] in one [n, 2h] tensor: the two normed halves side by side.
  Tensor embedded(DType::kF32, {n, h});
  ops::cpu::embedding(pool, target_.embed_tokens(), batch.token_ids, embedded);
  Tensor e_norm(DType::kF32, {n, h}), g_norm(DType::kF32, {n, h});
  ops::cpu::rms_norm(pool, embedded, weights_.embed_norm(), c.rms_norm_eps, e_norm);
  ops::cpu::rms_norm(pool, hidden, weights_.hidden_norm(), c.rms_norm_eps, g_norm);
  Tensor joined(DType::kF32, {n, 2 * h});
  for (int64_t r = 0; r < n; ++r) {
    float* row = joined.data_as<float>() + r * 2 * h;
    std::copy_n(e_norm.data_as<float>() + r * h, h, row);
    std::copy_n(g_norm.data_as<float>() + r * h, h, row + h);
  }
  Tensor residual(DType::kF32, {n, h}), normed(DType::kF32, {n, h}), delta(DType::kF32, {n, h});
  ops::cpu::linear(pool, joined, weights_.fc(), residual);
  // The decoder block, as a target layer: pre-norm attention, then pre-norm MLP.
  const LayerWeights& w = weights_.layer();
  ops::cpu::rms_norm(pool, residual, w.input_norm, c.rms_norm_eps, normed);
  attention_block(pool, batch, kv, normed, delta);
  ops::cpu::add_rms_norm(pool, residual, delta, w.post_attention_norm, c.rms_norm_eps, normed);
  mlp_block(pool, normed, delta);
  ops::cpu::add_rms_norm(pool, residual, delta, weights_.final_norm(), c.rms_norm_eps, normed);

  const auto num_rows = static_cast<int64_t>(batch.output_rows.size());
  MtpOutput out{Tensor(DType::kF32, {num_rows, h}), Tensor(DType::kF32, {num_rows, c.vocab_size})};
  for (int64_t r = 0; r < num_rows; ++r) {
    const int32_t row = batch.output_rows[static_cast<size_t>(r)];
    CHECK(row >= 0 && row < n, "MTP output row {} of {}", row, n);
    std::copy_n(normed.data_as<float>() + row * h, h, out.hidden.data_as<float>() + r * h);
  }
  ops::cpu::linear(pool, out.hidden, target_.lm_head(), out.logits);
  return out;
}

}  // namespace moe::model
