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
// The model is immutable after construction; forward() may be called from one
// thread at a time per KV cache (it writes the batch's KV entries).
#pragma once

#include <functional>
#include <span>
#include <vector>

#include "core/tensor.h"
#include "core/thread_pool.h"
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
  explicit Qwen3MoeModel(const ModelWeights& weights);

  const ModelConfig& config() const { return weights_.config(); }

  // Runs the batch, writing its K/V into `kv_layers` (one PagedKv per layer),
  // and returns logits [logits_rows.size(), vocab] f32. `on_layer_kv`, when
  // set, runs after each layer's K/V is written (disaggregated prefill streams
  // it out while the next layers compute).
  Tensor forward(ThreadPool& pool, const ForwardBatch& batch, std::span<const ops::PagedKv> kv_layers,
                 const std::function<void(int layer)>& on_layer_kv = {}) const;

 private:
  void attention_block(ThreadPool& pool, int layer, const ForwardBatch& batch, const ops::PagedKv& kv,
                       TensorView x, TensorView out) const;
  void mlp_block(ThreadPool& pool, int layer, TensorView x, TensorView out) const;

  const ModelWeights& weights_;
  ops::RopeTable rope_;
};

}  // namespace moe::model
