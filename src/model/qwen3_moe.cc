#include "model/qwen3_moe.h"

#include <cmath>

#include "ops/embedding.h"
#include "ops/linear.h"
#include "ops/moe.h"
#include "ops/norm.h"
#include "ops/quant.h"

namespace moe::model {

using namespace moe::ops;

namespace {
// out = x w^T with the projection's quantized form when it has one.
void project(ThreadPool& pool, TensorView x, TensorView w, const QuantizedTensor& w_quant, TensorView out) {
  if (w_quant.empty()) {
    cpu::linear(pool, x, w, out);
  } else {
    cpu::quantized_linear(pool, x, w_quant, out);
  }
}
}  // namespace

Qwen3MoeModel::Qwen3MoeModel(const ModelWeights& weights)
    : weights_(weights), rope_(make_rope_table(weights.config().rope)) {}

void Qwen3MoeModel::attention_block(ThreadPool& pool, int layer, const ForwardBatch& batch, const PagedKv& kv,
                                    TensorView x, TensorView out) const {
  const ModelConfig& c = config();
  const LayerWeights& w = weights_.layer(layer);
  const int64_t n = batch.num_tokens();
  Tensor q(DType::kF32, {n, c.num_q_heads, c.head_dim});
  Tensor k(DType::kF32, {n, c.num_kv_heads, c.head_dim});
  Tensor v(DType::kF32, {n, c.num_kv_heads, c.head_dim});
  project(pool, x, w.q_proj, w.q_proj_quant, q.view().reshaped({n, c.q_size()}));
  project(pool, x, w.k_proj, w.k_proj_quant, k.view().reshaped({n, c.kv_size()}));
  project(pool, x, w.v_proj, w.v_proj_quant, v.view().reshaped({n, c.kv_size()}));
  auto per_head = [&](const Tensor& t) { return t.view().reshaped({t.num_elements() / c.head_dim, c.head_dim}); };
  cpu::rms_norm(pool, per_head(q), w.q_norm, c.rms_norm_eps, per_head(q));
  cpu::rms_norm(pool, per_head(k), w.k_norm, c.rms_norm_eps, per_head(k));
  cpu::apply_rope(pool, q, batch.positions, rope_);
  cpu::apply_rope(pool, k, batch.positions, rope_);

  AttentionBatch attention{batch.query_start, batch.positions, batch.page_table, batch.max_pages_per_seq};
  cpu::write_kv(pool, k, v, attention, kv);
  Tensor attended(DType::kF32, {n, c.q_size()});
  cpu::paged_attention(pool, q, attention, kv, 1.0f / std::sqrt(static_cast<float>(c.head_dim)), attended);
  project(pool, attended, w.o_proj, w.o_proj_quant, out);
}

void Qwen3MoeModel::mlp_block(ThreadPool& pool, int layer, TensorView x, TensorView out) const {
  const ModelConfig& c = config();
  const LayerWeights& w = weights_.layer(layer);
  if (!w.is_moe) {
    if (w.w13_quant.empty()) {
      cpu::swiglu_mlp(pool, x, w.w13, w.w2, out);
    } else {
      cpu::swiglu_mlp(pool, x, w.w13_quant, w.w2_quant, out);
    }
    return;
  }
  const int64_t n = x.dim(0), k = c.num_experts_per_tok;
  Tensor router_logits(DType::kF32, {n, c.num_experts});
  cpu::linear(pool, x, w.router, router_logits);
  Tensor expert_ids(DType::kI32, {n, k});
  Tensor expert_weights(DType::kF32, {n, k});
  cpu::route_topk(pool, router_logits, static_cast<int>(k), c.norm_topk_prob, expert_ids, expert_weights);
  if (w.w13_quant.empty()) {
    cpu::moe_experts(pool, x, expert_ids, expert_weights, w.w13, w.w2, out);
  } else {
    cpu::moe_experts(pool, x, expert_ids, expert_weights, w.w13_quant, w.w2_quant, out);
  }
}

Tensor Qwen3MoeModel::forward(ThreadPool& pool, const ForwardBatch& batch, std::span<const PagedKv> kv_layers,
                              const std::function<void(int layer)>& on_layer_kv) const {
  const ModelConfig& c = config();
  const int64_t n = batch.num_tokens(), hidden = c.hidden_size;
  CHECK(static_cast<int>(kv_layers.size()) == c.num_layers, "{} KV layers for {} model layers", kv_layers.size(),
        c.num_layers);
  CHECK(batch.positions.size() == batch.token_ids.size(), "positions vs token ids");

  Tensor residual(DType::kF32, {n, hidden});
  Tensor normed(DType::kF32, {n, hidden});
  Tensor delta(DType::kF32, {n, hidden});
  cpu::embedding(pool, weights_.embed_tokens(), batch.token_ids, residual);
  cpu::rms_norm(pool, residual, weights_.layer(0).input_norm, c.rms_norm_eps, normed);
  for (int l = 0; l < c.num_layers; ++l) {
    const LayerWeights& w = weights_.layer(l);
    attention_block(pool, l, batch, kv_layers[l], normed, delta);
    if (on_layer_kv) on_layer_kv(l);
    cpu::add_rms_norm(pool, residual, delta, w.post_attention_norm, c.rms_norm_eps, normed);
    mlp_block(pool, l, normed, delta);
    const TensorView next_norm = l + 1 < c.num_layers ? weights_.layer(l + 1).input_norm : weights_.final_norm();
    cpu::add_rms_norm(pool, residual, delta, next_norm, c.rms_norm_eps, normed);
  }
  // `normed` now holds the final norm of every row; project the requested ones.
  const auto num_rows = static_cast<int64_t>(batch.logits_rows.size());
  Tensor rows(DType::kF32, {num_rows, hidden});
  for (int64_t r = 0; r < num_rows; ++r) {
    const int32_t row = batch.logits_rows[r];
    CHECK(row >= 0 && row < n, "logits row {} of {}", row, n);
    std::copy_n(normed.data_as<float>() + row * hidden, hidden, rows.data_as<float>() + r * hidden);
  }
  Tensor logits(DType::kF32, {num_rows, c.vocab_size});
  cpu::linear(pool, rows, weights_.lm_head(), logits);
  return logits;
}

}  // namespace moe::model
