#include "model/qwen3_moe.h"

#include <cmath>

#include "comm/communicator.h"
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
const ParallelPlan& checked(const ModelWeights& weights, const ParallelPlan& plan) {
  for (const Status& ok : {check_parallel_plan(weights.config(), weights, plan), check_communicator(plan)})
    CHECK(ok.is_ok(), "{}", ok.to_string());
  return plan;
}
}  // namespace

Qwen3MoeModel::Qwen3MoeModel(const ModelWeights& weights, ParallelPlan plan)
    : weights_(weights),
      plan_(checked(weights, plan)),
      rank_(weights, plan_),
      rope_(make_rope_table(weights.config().rope)) {}

void Qwen3MoeModel::attention_block(ThreadPool& pool, int layer, const ForwardBatch& batch, const PagedKv& kv,
                                    TensorView x, TensorView out) const {
  const ModelConfig& c = config();
  const LayerWeights& w = rank_.layer(layer);
  const int64_t n = batch.num_tokens(), q_heads = shard().num_q_heads, kv_heads = shard().num_kv_heads;
  Tensor q(DType::kF32, {n, q_heads, c.head_dim});
  Tensor k(DType::kF32, {n, kv_heads, c.head_dim});
  Tensor v(DType::kF32, {n, kv_heads, c.head_dim});
  project(pool, x, w.q_proj, w.q_proj_quant, q.view().reshaped({n, q_heads * c.head_dim}));
  project(pool, x, w.k_proj, w.k_proj_quant, k.view().reshaped({n, kv_heads * c.head_dim}));
  project(pool, x, w.v_proj, w.v_proj_quant, v.view().reshaped({n, kv_heads * c.head_dim}));
  auto per_head = [&](const Tensor& t) { return t.view().reshaped({t.num_elements() / c.head_dim, c.head_dim}); };
  cpu::rms_norm(pool, per_head(q), w.q_norm, c.rms_norm_eps, per_head(q));
  cpu::rms_norm(pool, per_head(k), w.k_norm, c.rms_norm_eps, per_head(k));
  cpu::apply_rope(pool, q, batch.positions, rope_);
  cpu::apply_rope(pool, k, batch.positions, rope_);

  AttentionBatch attention{batch.query_start, batch.positions, batch.page_table, batch.max_pages_per_seq};
  cpu::write_kv(pool, k, v, attention, kv);
  Tensor attended(DType::kF32, {n, q_heads * c.head_dim});
  cpu::paged_attention(pool, q, attention, kv, 1.0f / std::sqrt(static_cast<float>(c.head_dim)), attended);
  project(pool, attended, w.o_proj, w.o_proj_quant, out);
}

bool Qwen3MoeModel::mlp_is_partial(int layer) const {
  if (!config().layer_is_moe(layer)) return plan_.tp_size > 1;
  return plan_.ep_size > 1 && !plan_.dp_attention;
}

Status Qwen3MoeModel::mlp_block(ThreadPool& pool, int layer, TensorView x, TensorView out) const {
  const ModelConfig& c = config();
  const LayerWeights& w = rank_.layer(layer);
  if (!w.is_moe) {
    if (w.w13_quant.empty()) {
      cpu::swiglu_mlp(pool, x, w.w13, w.w2, out);
    } else {
      cpu::swiglu_mlp(pool, x, w.w13_quant, w.w2_quant, out);
    }
    return Status::ok();
  }
  const int64_t n = x.dim(0), k = c.num_experts_per_tok;
  Tensor router_logits(DType::kF32, {n, c.num_experts});
  cpu::linear(pool, x, w.router, router_logits);
  Tensor expert_ids(DType::kI32, {n, k});
  Tensor expert_weights(DType::kF32, {n, k});
  cpu::route_topk(pool, router_logits, static_cast<int>(k), c.norm_topk_prob, expert_ids, expert_weights);
  if (plan_.dp_attention && plan_.ep_size > 1) return expert_exchange(pool, w, x, expert_ids, expert_weights, out);
  // Replicated input: this rank's experts only (all of them on a single rank).
  const ExpertRange range{shard().first_expert, shard().first_expert + shard().num_experts};
  if (w.w13_quant.empty()) {
    cpu::moe_experts(pool, x, expert_ids, expert_weights, w.w13, w.w2, out, range);
  } else {
    cpu::moe_experts(pool, x, expert_ids, expert_weights, w.w13_quant, w.w2_quant, out, range);
  }
  return Status::ok();
}

// Decode DP+EP: this rank's tokens go to their experts' ranks, the rows that
// arrive here run through the local experts, and the results come back.
Status Qwen3MoeModel::expert_exchange(ThreadPool& pool, const LayerWeights& w, TensorView x, TensorView expert_ids,
                                      TensorView expert_weights, TensorView out) const {
  auto dispatched = plan_.comm->dispatch(x, expert_ids, config().num_experts);
  if (!dispatched) return dispatched.status();
  const comm::Dispatched& d = *dispatched;
  Tensor y(DType::kF32, {d.num_recv(), config().hidden_size});
  for (int e = 0; e < shard().num_experts; ++e) {
    const int64_t begin = d.expert_offsets[e], end = d.expert_offsets[e + 1];
    if (begin == end) continue;
    const int64_t global = shard().first_expert + e;
    if (w.w13_quant.empty()) {
      cpu::swiglu_mlp(pool, d.x.view().rows(begin, end), w.w13.slice0(global), w.w2.slice0(global),
                      y.view().rows(begin, end));
    } else {
      cpu::swiglu_mlp(pool, d.x.view().rows(begin, end), w.w13_quant.slice0(global), w.w2_quant.slice0(global),
                      y.view().rows(begin, end));
    }
  }
  return plan_.comm->combine(d, y, expert_weights, out);
}

Status Qwen3MoeModel::layer_boundary(ThreadPool& pool, bool reduce, TensorView residual, TensorView delta,
                                     TensorView norm, TensorView normed) const {
  if (reduce) return plan_.comm->all_reduce_add_rms_norm(delta, residual, norm, config().rms_norm_eps, normed);
  cpu::add_rms_norm(pool, residual, delta, norm, config().rms_norm_eps, normed);
  return Status::ok();
}

Tensor Qwen3MoeModel::forward(ThreadPool& pool, const ForwardBatch& batch, std::span<const PagedKv> kv_layers,
                              const std::function<void(int layer)>& on_layer_kv, std::span<const int32_t> hidden_rows,
                              Tensor* hidden_out) const {
  CHECK(plan_.single(), "forward() on a rank of a parallel plan: use try_forward()");
  return try_forward(pool, batch, kv_layers, on_layer_kv, hidden_rows, hidden_out).value();
}

Expected<Tensor> Qwen3MoeModel::try_forward(ThreadPool& pool, const ForwardBatch& batch,
                                            std::span<const PagedKv> kv_layers,
                                            const std::function<void(int layer)>& on_layer_kv,
                                            std::span<const int32_t> hidden_rows, Tensor* hidden_out) const {
  const ModelConfig& c = config();
  const int64_t n = batch.num_tokens(), hidden = c.hidden_size;
  CHECK(static_cast<int>(kv_layers.size()) == c.num_layers, "{} KV layers for {} model layers", kv_layers.size(),
        c.num_layers);
  CHECK(batch.positions.size() == batch.token_ids.size(), "positions vs token ids");

  Tensor residual(DType::kF32, {n, hidden});
  Tensor normed(DType::kF32, {n, hidden});
  Tensor delta(DType::kF32, {n, hidden});
  cpu::embedding(pool, weights_.embed_tokens(), batch.token_ids, residual);
  cpu::rms_norm(pool, residual, rank_.layer(0).input_norm, c.rms_norm_eps, normed);
  for (int l = 0; l < c.num_layers; ++l) {
    const LayerWeights& w = rank_.layer(l);
    attention_block(pool, l, batch, kv_layers[l], normed, delta);
    if (Status s = layer_boundary(pool, plan_.tp_size > 1, residual, delta, w.post_attention_norm, normed); !s)
      return s;
    // Past the boundary's all-reduce, every TP rank has written this layer's KV.
    if (on_layer_kv) on_layer_kv(l);
    if (Status s = mlp_block(pool, l, normed, delta); !s) return s;
    const TensorView next_norm = l + 1 < c.num_layers ? rank_.layer(l + 1).input_norm : weights_.final_norm();
    if (Status s = layer_boundary(pool, mlp_is_partial(l), residual, delta, next_norm, normed); !s) return s;
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
  if (hidden_out != nullptr) {
    *hidden_out = Tensor(DType::kF32, {static_cast<int64_t>(hidden_rows.size()), hidden});
    for (size_t r = 0; r < hidden_rows.size(); ++r) {
      CHECK(hidden_rows[r] >= 0 && hidden_rows[r] < n, "hidden row {} of {}", hidden_rows[r], n);
      std::copy_n(normed.data_as<float>() + hidden_rows[r] * hidden, hidden,
                  hidden_out->data_as<float>() + static_cast<int64_t>(r) * hidden);
    }
  }
  return logits;
}

}  // namespace moe::model
