#include "engine/model_runner.h"

namespace moe::engine {

Expected<std::vector<int32_t>> ModelRunner::forward_and_sample(const model::ForwardBatch&, std::span<const RowSampling>) {
  return unimplemented("this model runner does not sample on its device");
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

Expected<std::vector<int32_t>> ModelRunner::forward_greedy_with_hidden(const model::ForwardBatch& batch,
                                                                       std::span<const int32_t> hidden_rows,
                                                                       Tensor& hidden) {
  MOE_ASSIGN_OR_RETURN(Tensor logits, forward_with_hidden(batch, hidden_rows, hidden));
  const int64_t rows = logits.view().dim(0), vocab = logits.view().dim(1);
  std::vector<int32_t> ids(static_cast<size_t>(rows));
  for (int64_t r = 0; r < rows; ++r)
    ids[r] = argmax(std::span<const float>(logits.data_as<float>() + r * vocab, static_cast<size_t>(vocab)));
  return ids;
}

Expected<Tensor> Qwen3Runner::forward_with_hidden(const model::ForwardBatch& batch, std::span<const int32_t> hidden_rows,
                                                  Tensor& hidden) {
  return model_.try_forward(pool_, batch, layers_, hook_, hidden_rows, &hidden);
}

}  // namespace moe::engine
