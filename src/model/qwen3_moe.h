// The Qwen3-MoE forward pass (also dense Qwen3: every layer a dense MLP),
// written as calls into ops, on the CPU reference backend.
//
// Per layer, as transformers' Qwen3MoeDecoderLayer:
//   x  = rms_norm(h, input_norm)
//   q, k, v = x Wq, x Wk, x Wv;  q, k = rms_norm per head (q_norm, k_norm); RoPE
//   h += paged_attention(q, k, v) Wo
//   x  = rms_norm(h, post_attention_norm)
//   h += moe(x) or mlp(x)
// then logits = rms_norm(h, final_norm) lm_head^T for the requested rows.
// Activations are f32; weights stay in their checkpoint dtype (quantized
// projections go through ops/quant.h quantized_linear, see docs/quantization.md).
//
// Ranks of a parallel instance (model/parallel.h) each run their ParallelPlan's
// share: their heads over their own KV pages (which hold only their k/v heads),
// their experts, and the collectives that join them; every rank of the group
// calls try_forward for every step, with an empty batch if it has no tokens.
//
// The model is immutable after construction; forward() may be called from one
// thread at a time per KV cache (it writes the batch's KV entries).
#pragma once

#include <functional>
#include <span>
#include <vector>

#include "core/status.h"
#include "core/tensor.h"
#include "core/thread_pool.h"
#include "model/parallel.h"
#include "model/weights.h"
#include "ops/attention.h"
#include "ops/rope.h"

namespace moe::model {

// One forward step over a ragged batch of sequences.
struct ForwardBatch {
  std::vector<int32_t> token_ids;    // [num_tokens], sequence-major
  std::vector<int32_t> positions;    // [num_tokens]
  std::vector<int32_t> query_start;  // [num_seqs + 1]
  std::vector<int32_t> page_table;   // [num_seqs, max_pages_per_seq], -1 where unused
  int max_pages_per_seq = 0;
  std::vector<int32_t> logits_rows;  // token rows whose logits are wanted
  int num_tokens() const { return static_cast<int>(token_ids.size()); }
};

class Qwen3MoeModel {
 public:
  // `plan` must pass check_parallel_plan.
  explicit Qwen3MoeModel(const ModelWeights& weights, ParallelPlan plan = {});

  const ModelConfig& config() const { return weights_.config(); }
  const ParallelPlan& plan() const { return plan_; }
  // The heads (and so the KV cache's k/v heads), experts and MLP columns of this rank.
  const RankShard& shard() const { return rank_.shard(); }

  // Runs the batch, writing its K/V into `kv_layers` (one PagedKv per layer),
  // and returns logits [logits_rows.size(), vocab] f32. `on_layer_kv`, when
  // set, runs after each layer's K/V is written (disaggregated prefill streams
  // it out while the next layers compute).
  // With `hidden_out` set, it also receives [hidden_rows.size(), hidden] f32:
  // the last hidden state (after the final norm: what lm_head reads) of those
  // token rows, the input of the MTP draft model (model/mtp.h).
  // Single rank only (the plan's sizes are 1): nothing can fail.
  Tensor forward(ThreadPool& pool, const ForwardBatch& batch, std::span<const ops::PagedKv> kv_layers,
                 const std::function<void(int layer)>& on_layer_kv = {}, std::span<const int32_t> hidden_rows = {},
                 Tensor* hidden_out = nullptr) const;
  // Any plan: fails when a collective does (a peer lost or late).
  Expected<Tensor> try_forward(ThreadPool& pool, const ForwardBatch& batch, std::span<const ops::PagedKv> kv_layers,
                               const std::function<void(int layer)>& on_layer_kv = {},
                               std::span<const int32_t> hidden_rows = {}, Tensor* hidden_out = nullptr) const;

 private:
  void attention_block(ThreadPool& pool, int layer, const ForwardBatch& batch, const ops::PagedKv& kv,
                       TensorView x, TensorView out) const;
  Status mlp_block(ThreadPool& pool, int layer, TensorView x, TensorView out) const;
  Status expert_exchange(ThreadPool& pool, const LayerWeights& w, TensorView x, TensorView expert_ids,
                         TensorView expert_weights, TensorView out) const;
  // residual += delta (summed over the ranks when `reduce`); normed = rms_norm(residual) * norm.
  Status layer_boundary(ThreadPool& pool, bool reduce, TensorView residual, TensorView delta, TensorView norm,
                        TensorView normed) const;
  bool mlp_is_partial(int layer) const;

  const ModelWeights& weights_;
  ParallelPlan plan_;
  RankWeights rank_;
  ops::RopeTable rope_;
};

}  // namespace moe::model
