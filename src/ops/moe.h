// Mixture-of-experts pieces, as Qwen3-MoE defines them.
//
// route_topk: router probabilities = softmax(router_logits) over experts (f32);
//   the k largest (ties: lower expert index first) are chosen; with
//   `renormalize` (norm_topk_prob) their weights are divided by their sum.
//     router_logits [num_tokens, num_experts] f32
//     expert_ids    [num_tokens, k] i32 (descending weight), weights [num_tokens, k] f32
//
// swiglu_mlp: out = (silu(x @ gate^T) * (x @ up^T)) @ down^T, with gate and up
//   fused in one tensor, gate rows first:
//     x [num_tokens, hidden] f32, w13 [2 * inter, hidden], w2 [hidden, inter] (bf16|f32),
//     out [num_tokens, hidden] f32.
//   The dense MLP and each expert are this op.
//
// moe_experts: out[t] = sum_j weights[t, j] * swiglu_mlp(x[t]; expert expert_ids[t, j]),
//   with expert weights packed as w13 [num_experts, 2 * inter, hidden] and
//   w2 [num_experts, hidden, inter]. Tokens are grouped by expert first so each
//   expert runs one batched projection (the permute / grouped GEMM / weighted
//   un-permute structure the GPU kernels follow).
//   With an ExpertRange (expert parallelism on replicated input), only the
//   experts in [begin, end) run; the slots routed elsewhere add nothing, so
//   summing `out` over the ranks that own the ranges gives the full result.
#pragma once

#include "core/tensor.h"
#include "core/thread_pool.h"
#include "ops/quant.h"

namespace moe::ops {
// Experts [begin, end) of a layer; end < 0: through the last one.
struct ExpertRange {
  int64_t begin = 0, end = -1;
};
}  // namespace moe::ops

namespace moe::ops::cpu {

void route_topk(ThreadPool& pool, TensorView router_logits, int k, bool renormalize, TensorView expert_ids,
                TensorView weights);

void swiglu_mlp(ThreadPool& pool, TensorView x, TensorView w13, TensorView w2, TensorView out);

void moe_experts(ThreadPool& pool, TensorView x, TensorView expert_ids, TensorView weights, TensorView w13,
                 TensorView w2, TensorView out, ExpertRange range = {});

// The same with quantized weights (ops/quant.h): w13 [(num_experts,) 2 * inter, hidden]
// and w2 [(num_experts,) hidden, inter] in one format; each projection is a
// quantized_linear (activations quantized as that format's GPU kernel does).
void swiglu_mlp(ThreadPool& pool, TensorView x, const QuantizedTensor& w13, const QuantizedTensor& w2,
                TensorView out);
void moe_experts(ThreadPool& pool, TensorView x, TensorView expert_ids, TensorView weights,
                 const QuantizedTensor& w13, const QuantizedTensor& w2, TensorView out, ExpertRange range = {});

}  // namespace moe::ops::cpu
