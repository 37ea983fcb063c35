#include "engine/model_runner.h"

namespace moe::engine {

Qwen3Runner::Qwen3Runner(const model::Qwen3MoeModel& model, ThreadPool& pool, const kv::KvCacheLayout& layout)
    : model_(model), pool_(pool), cache_(layout) {
  for (int l = 0; l < layout.num_layers; ++l) layers_.push_back(cache_.layer(l));
}

Expected<Tensor> Qwen3Runner::forward(const model::ForwardBatch& batch) { return model_.forward(pool_, batch, layers_); }

}  // namespace moe::engine
