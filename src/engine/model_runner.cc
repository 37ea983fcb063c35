#include "engine/model_runner.h"

#include "engine/speculative.h"

namespace moe::engine {

Expected<SampledStep> ModelRunner::forward_sample(const model::ForwardBatch& batch,
                                                  const StepSampling& sampling,
                                                  std::span<const int32_t> hidden_rows, Tensor& hidden) {
  MOE_ASSIGN_OR_RETURN(
      Tensor logits, hidden_rows.empty() ? forward(batch) : forward_with_hidden(batch, hidden_rows, hidden));
  return sample_on_host(logits, sampling);
}

Qwen3Runner::Qwen3Runner(const model::Qwen3MoeModel& model, ThreadPool& pool, const kv::KvCacheLayout& layout)
    : model_(model), pool_(pool), cache_(layout) {
  for (int l = 0; l < layout.num_layers; ++l) layers_.push_back(cache_.layer(l));
}

Expected<Tensor> Qwen3Runner::forward(const model::ForwardBatch& batch) {
  return model_.try_forward(pool_, batch, layers_, hook_);
}

Expected<Tensor> ModelRunner::forward_with_hidden(const model::ForwardBatch&, std::span<const int32_t>, Tensor&) {
  return unimplemented("this model runner does not return hidden states (needed by speculative decoding)");
}

Expected<Tensor> Qwen3Runner::forward_with_hidden(const model::ForwardBatch& batch, std::span<const int32_t> hidden_rows,
                                                  Tensor& hidden) {
  return model_.try_forward(pool_, batch, layers_, hook_, hidden_rows, &hidden);
}

}  // namespace moe::engine
