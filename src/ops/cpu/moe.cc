#include "ops/moe.h"

#include <algorithm>
#include <cmath>
#include <functional>
#include <numeric>
#include <vector>

#include "ops/linear.h"

namespace moe::ops::cpu {

void route_topk(ThreadPool& pool, TensorView router_logits, int k, bool renormalize, TensorView expert_ids,
                TensorView weights) {
  const int64_t num_tokens = router_logits.dim(0), num_experts = router_logits.dim(1);
  CHECK(k >= 1 && k <= num_experts, "top-{} of {} experts", k, num_experts);
  CHECK(expert_ids.dtype() == DType::kI32 && expert_ids.dim(0) == num_tokens && expert_ids.dim(1) == k &&
            weights.dtype() == DType::kF32 && weights.shape() == expert_ids.shape(),
        "route_topk: ids {} weights {}", expert_ids.shape().to_string(), weights.shape().to_string());
  pool.parallel_for(0, num_tokens, 16, [&](int64_t begin, int64_t end) {
    std::vector<float> probs(static_cast<size_t>(num_experts));
    std::vector<int32_t> order(static_cast<size_t>(num_experts));
    for (int64_t t = begin; t < end; ++t) {
      const float* logits = router_logits.data_as<float>() + t * num_experts;
      const float max_logit = *std::max_element(logits, logits + num_experts);
      float sum = 0.0f;
      for (int64_t e = 0; e < num_experts; ++e) sum += (probs[e] = std::exp(logits[e] - max_logit));
      for (int64_t e = 0; e < num_experts; ++e) probs[e] /= sum;
      std::iota(order.begin(), order.end(), 0);
      std::partial_sort(order.begin(), order.begin() + k, order.end(), [&](int32_t a, int32_t b) {
        return probs[a] > probs[b] || (probs[a] == probs[b] && a < b);
      });
      float chosen_sum = 0.0f;
      for (int j = 0; j < k; ++j) chosen_sum += probs[order[j]];
      for (int j = 0; j < k; ++j) {
        expert_ids.data_as<int32_t>()[t * k + j] = order[j];
        weights.data_as<float>()[t * k + j] = renormalize ? probs[order[j]] / chosen_sum : probs[order[j]];
      }
    }
  });
}

namespace {

using Projection = std::function<void(TensorView in, TensorView out)>;

// silu(gate) * up over the fused [num_tokens, 2 * inter] projection.
void swiglu_impl(TensorView x, int64_t inter, const Projection& project13, const Projection& project2,
                 TensorView out) {
  const int64_t num_tokens = x.dim(0);
  Tensor gate_up(DType::kF32, {num_tokens, 2 * inter});
  project13(x, gate_up);
  Tensor activated(DType::kF32, {num_tokens, inter});
  for (int64_t t = 0; t < num_tokens; ++t) {
    const float* gu = gate_up.data_as<float>() + t * 2 * inter;
    float* a = activated.data_as<float>() + t * inter;
    for (int64_t i = 0; i < inter; ++i) {
      const float g = gu[i];
      a[i] = g / (1.0f + std::exp(-g)) * gu[inter + i];
    }
  }
  project2(activated, out);
}

}  // namespace

void swiglu_mlp(ThreadPool& pool, TensorView x, TensorView w13, TensorView w2, TensorView out) {
  const int64_t hidden = x.dim(1), inter = w2.dim(1);
  CHECK(w13.rank() == 2 && w13.dim(0) == 2 * inter && w13.dim(1) == hidden && w2.dim(0) == hidden,
        "swiglu_mlp: w13 {} w2 {} for hidden {}", w13.shape().to_string(), w2.shape().to_string(), hidden);
  swiglu_impl(
      x, inter, [&](TensorView in, TensorView o) { linear(pool, in, w13, o); },
      [&](TensorView in, TensorView o) { linear(pool, in, w2, o); }, out);
}

void swiglu_mlp(ThreadPool& pool, TensorView x, const QuantizedTensor& w13, const QuantizedTensor& w2,
                TensorView out) {
  const int64_t hidden = x.dim(1), inter = w2.cols();
  CHECK(w13.rank() == 2 && w2.rank() == 2 && w13.rows() == 2 * inter && w13.cols() == hidden && w2.rows() == hidden,
        "swiglu_mlp: quantized w13 {} w2 {} for hidden {}", w13.values.shape().to_string(),
        w2.values.shape().to_string(), hidden);
  swiglu_impl(
      x, inter, [&](TensorView in, TensorView o) { quantized_linear(pool, in, w13, o); },
      [&](TensorView in, TensorView o) { quantized_linear(pool, in, w2, o); }, out);
}

namespace {

using ExpertMlp = std::function<void(int64_t expert, TensorView in, TensorView out)>;

void moe_experts_impl(ThreadPool& pool, TensorView x, TensorView expert_ids, TensorView weights, int64_t num_experts,
                      ExpertRange range, const ExpertMlp& run_expert, TensorView out) {
  const int64_t num_tokens = x.dim(0), hidden = x.dim(1), k = expert_ids.dim(1);
  CHECK(out.shape() == x.shape() && out.dtype() == DType::kF32, "moe_experts: out {}", out.shape().to_string());
  if (range.end < 0) range.end = num_experts;
  CHECK(0 <= range.begin && range.begin <= range.end && range.end <= num_experts, "experts [{}, {}) of {}",
        range.begin, range.end, num_experts);
  // Permute: the (token, slot) pairs of each expert, in token order.
  std::vector<std::vector<int64_t>> routed(static_cast<size_t>(num_experts));
  for (int64_t t = 0; t < num_tokens; ++t)
    for (int64_t j = 0; j < k; ++j) {
      const int32_t e = expert_ids.data_as<int32_t>()[t * k + j];
      CHECK(e >= 0 && e < num_experts, "expert id {} of {}", e, num_experts);
      routed[e].push_back(t * k + j);
    }
  // Per-slot outputs, summed in slot order afterwards so the result does not
  // depend on the order experts run in.
  Tensor slot_out(DType::kF32, {num_tokens * k, hidden});  // zero: slots of experts out of range
  for (int64_t e = range.begin; e < range.end; ++e) {
    const auto& slots = routed[e];
    if (slots.empty()) continue;
    const auto n = static_cast<int64_t>(slots.size());
    Tensor gathered(DType::kF32, {n, hidden});
    for (int64_t i = 0; i < n; ++i)
      std::copy_n(x.data_as<float>() + (slots[i] / k) * hidden, hidden, gathered.data_as<float>() + i * hidden);
    Tensor expert_out(DType::kF32, {n, hidden});
    run_expert(e, gathered, expert_out);
    for (int64_t i = 0; i < n; ++i)
      std::copy_n(expert_out.data_as<float>() + i * hidden, hidden, slot_out.data_as<float>() + slots[i] * hidden);
  }
  // Weighted un-permute.
  pool.parallel_for(0, num_tokens, 16, [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t) {
      float* o = out.data_as<float>() + t * hidden;
      std::fill(o, o + hidden, 0.0f);
      for (int64_t j = 0; j < k; ++j) {
        const float w = weights.data_as<float>()[t * k + j];
        const float* y = slot_out.data_as<float>() + (t * k + j) * hidden;
        for (int64_t d = 0; d < hidden; ++d) o[d] += w * y[d];
      }
    }
  });
}

}  // namespace

void moe_experts(ThreadPool& pool, TensorView x, TensorView expert_ids, TensorView weights, TensorView w13,
                 TensorView w2, TensorView out, ExpertRange range) {
  const int64_t hidden = x.dim(1), num_experts = w13.dim(0);
  CHECK(w13.rank() == 3 && w2.rank() == 3 && w2.dim(0) == num_experts && w2.dim(1) == hidden,
        "moe_experts: w13 {} w2 {}", w13.shape().to_string(), w2.shape().to_string());
  moe_experts_impl(
      pool, x, expert_ids, weights, num_experts, range,
      [&](int64_t e, TensorView in, TensorView o) { swiglu_mlp(pool, in, w13.slice0(e), w2.slice0(e), o); }, out);
}

void moe_experts(ThreadPool& pool, TensorView x, TensorView expert_ids, TensorView weights,
                 const QuantizedTensor& w13, const QuantizedTensor& w2, TensorView out, ExpertRange range) {
  const int64_t hidden = x.dim(1), num_experts = w13.values.dim(0);
  CHECK(w13.rank() == 3 && w2.rank() == 3 && w2.values.dim(0) == num_experts && w2.rows() == hidden,
        "moe_experts: quantized w13 {} w2 {}", w13.values.shape().to_string(), w2.values.shape().to_string());
  moe_experts_impl(
      pool, x, expert_ids, weights, num_experts, range,
      [&](int64_t e, TensorView in, TensorView o) { swiglu_mlp(pool, in, w13.slice0(e), w2.slice0(e), o); }, out);
}

}  // namespace moe::ops::cpu
