// What the engine needs from a model: run one ragged batch over the KV cache
// and return the logits of the requested rows. The scheduler's page ids index
// the runner's KV cache. Tests use fake runners (tests/engine/fake_runner.h).
//
// forward() is called by the engine thread only.
#pragma once

#include <functional>
#include <memory>
#include <span>
#include <vector>

#include "core/status.h"
#include "core/tensor.h"
#include "core/thread_pool.h"
#include "engine/sampler.h"
#include "kv/kv_cache.h"
#include "model/qwen3_moe.h"

namespace moe::engine {

class ModelRunner {
 public:
  virtual ~ModelRunner() = default;
  virtual int64_t vocab_size() const = 0;
  // logits [batch.logits_rows.size(), vocab_size()] f32; an error (a device
  // failure) makes the engine fail every request and report itself unhealthy.
  virtual Expected<Tensor> forward(const model::ForwardBatch& batch) = 0;
  // The step's forward pass and its sampling (below): on the host from
  // forward() / forward_with_hidden() by default (sample_on_host); a runner
  // whose logits are on a device samples there and sends back the tokens and
  // the fetched rows only. `hidden_rows` as forward_with_hidden (empty: none).
  virtual Expected<SampledStep> forward_sample(const model::ForwardBatch& batch, const StepSampling& sampling,
                                               std::span<const int32_t> hidden_rows, Tensor& hidden);
  // Disaggregated prefill: a runner that supports it calls `hook(layer)` in
  // the next forward passes once that layer's KV for the whole batch is in its
  // cache (empty: no hook). The others ignore it and say so here.
  virtual bool supports_layer_hook() const { return false; }
  virtual void set_layer_hook(std::function<void(int layer)> hook) { (void)hook; }
  // A runner whose ranks must step together (data-parallel attention with
  // expert-parallel MoE, engine/rank_group.h) says so here; the engine then
  // calls idle_step() whenever it has no batch to run, at least every
  // millisecond, so that its peers' steps can complete. An error fails the
  // engine as a failed forward does.
  virtual bool steps_in_lockstep() const { return false; }
  virtual Status idle_step() { return Status::ok(); }
  // The engine stops stepping (shutdown): a lockstep runner tells its peers,
  // which then fail at once instead of waiting out their timeout.
  virtual void leave() {}
  // Speculative decoding (engine/speculative.h): forward() that also returns
  // the last hidden state of `hidden_rows` ([rows, hidden] f32, after the
  // final norm) in `hidden`. Runners without it say so here.
  virtual bool supports_hidden_states() const { return false; }
  virtual Expected<Tensor> forward_with_hidden(const model::ForwardBatch& batch,
                                               std::span<const int32_t> hidden_rows, Tensor& hidden);
};

// The Qwen3-MoE CPU forward over its own paged KV cache.
class Qwen3Runner final : public ModelRunner {
 public:
  // `layout` holds the model rank's k/v heads (Qwen3MoeModel::shard()).
  Qwen3Runner(const model::Qwen3MoeModel& model, ThreadPool& pool, const kv::KvCacheLayout& layout);
  int64_t vocab_size() const override { return model_.config().vocab_size; }
  Expected<Tensor> forward(const model::ForwardBatch& batch) override;
  bool supports_layer_hook() const override { return true; }
  void set_layer_hook(std::function<void(int layer)> hook) override { hook_ = std::move(hook); }
  bool supports_hidden_states() const override { return true; }
  Expected<Tensor> forward_with_hidden(const model::ForwardBatch& batch, std::span<const int32_t> hidden_rows,
                                       Tensor& hidden) override;
  const kv::KvCache& cache() const { return cache_; }

 private:
  std::function<void(int)> hook_;
  const model::Qwen3MoeModel& model_;
  ThreadPool& pool_;
  kv::KvCache cache_;
  std::vector<ops::PagedKv> layers_;
};

}  // namespace moe::engine
