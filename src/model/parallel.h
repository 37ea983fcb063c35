// How one rank of an instance holds and runs the model (DESIGN section 3).
//
// - Tensor parallel attention (tp_size > 1, prefill instances): the q heads
//   are split evenly; the k/v heads too, or, when tp_size exceeds the number
//   of k/v heads, each k/v head is replicated on tp_size / num_kv_heads
//   consecutive ranks (the heads its ranks' q heads read). Each rank projects
//   its heads, attends over its own KV pages (local heads only) and applies
//   its columns of o_proj; the partial outputs are all-reduced. Dense MLP
//   layers split their intermediate dimension the same way.
// - Expert parallel MoE on replicated input (ep_size > 1, no dp_attention):
//   every rank sees every token, runs only its experts (contiguous blocks of
//   num_experts / ep_size) and the partial sums are all-reduced.
// - DP attention + EP MoE (dp_attention, decode instances): each rank runs
//   attention for its own requests with the full attention weights and its own
//   KV cache; the MoE exchanges tokens with the experts' owners
//   (Communicator::dispatch / combine). Dense MLP layers run locally.
// Embedding, norms, router and lm_head are replicated.
//
// The all-reduces add in rank order on every rank, so all ranks hold the same
// residual stream and the same logits.
#pragma once

#include <vector>

#include "core/status.h"
#include "core/tensor.h"
#include "model/config.h"
#include "model/weights.h"

namespace moe::comm {
class Communicator;
}

namespace moe::model {

struct ParallelPlan {
  int tp_size = 1, tp_rank = 0;
  int ep_size = 1, ep_rank = 0;
  bool dp_attention = false;
  // The ranks of the instance (its world is max(tp_size, ep_size)); null
  // when every size is 1. Not owned.
  comm::Communicator* comm = nullptr;

  bool single() const { return tp_size == 1 && ep_size == 1; }
};

// Whether `plan` can run `config` with `weights` (divisibility of heads,
// experts and MLP width; formats the sharding supports). The error says what
// to change.
Status check_parallel_plan(const ModelConfig& config, const ModelWeights& weights, const ParallelPlan& plan);
// The part of check_parallel_plan that needs only the config (ranks, sizes,
// divisibility), for weights that do not exist yet (dummy weights on a GPU).
Status check_parallel_layout(const ModelConfig& config, const ParallelPlan& plan);
// Whether plan.comm is there when needed and its rank and size match the plan.
Status check_communicator(const ParallelPlan& plan);

// The heads, experts and MLP columns one rank owns.
struct RankShard {
  int first_q_head = 0, num_q_heads = 0;
  int first_kv_head = 0, num_kv_heads = 0;
  int first_expert = 0, num_experts = 0;
  int64_t first_mlp_column = 0, num_mlp_columns = 0;  // dense MLP intermediate
};
RankShard rank_shard(const ModelConfig& config, const ParallelPlan& plan);

// A rank's view of every layer's weights: row ranges of the full tensors
// where they are contiguous, owned copies where they are not (o_proj's
// columns, the dense MLP's gate/up rows and down columns). Experts stay
// whole: the MoE runs an ExpertRange of them. Read-only once built.
class RankWeights {
 public:
  RankWeights(const ModelWeights& full, const ParallelPlan& plan);
  RankWeights(RankWeights&&) = default;
  const LayerWeights& layer(int i) const { return layers_.at(static_cast<size_t>(i)); }
  const RankShard& shard() const { return shard_; }

 private:
  RankShard shard_;
  std::vector<LayerWeights> layers_;
  std::vector<Tensor> owned_;
};

}  // namespace moe::model
