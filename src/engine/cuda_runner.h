// The ModelRunner of the CUDA backend: Qwen3-MoE on one GPU
// (model/cuda/cuda_model.h), its KV pages in device memory. Page ids from the
// scheduler index the device KV pool, whose size the GPU's free memory sets
// (--gpu-memory-utilization) unless given. The pool is also a kv::KvCache
// over device memory (cache()), which the disaggregated roles register with
// the TransferEngine (CUDA IPC); it has one page more than num_pages(): the
// scratch page of CUDA-graph padding, which the scheduler never hands out.
//
// forward() is called by the engine thread only; the model makes its device
// current there.
#pragma once

#include <memory>
#include <optional>
#include <span>
#include <vector>

#include "engine/model_runner.h"
#include "engine/rank_group.h"
#include "engine/speculative.h"
#include "kv/kv_cache.h"
#include "model/cuda/cuda_model.h"

namespace moe::engine {

// Ok when CUDA device `device` can be used; else an error a user can act on
// ("--device cuda: no usable GPU: ...", "--gpu 3: only 2 GPUs are visible").
Status cuda_device_status(int device = 0);
// Makes `device` current on the calling thread (before anything is allocated
// there, so no context is created on another GPU).
Status use_cuda_device(int device);

class CudaRunner final : public ModelRunner {
 public:
  // weights == nullptr: random weights generated on the GPU (--load-format dummy).
  static Expected<std::unique_ptr<CudaRunner>> create(const model::ModelConfig& config,
                                                      const model::ModelWeights* weights, uint64_t dummy_seed,
                                                      const model::CudaModelOptions& options);
  ~CudaRunner() override;
  int64_t vocab_size() const override { return model_->config().vocab_size; }
  Expected<Tensor> forward(const model::ForwardBatch& batch) override;
  // Samples on the GPU (ops/cuda sample, adjust_logits); only the tokens and
  // the fetched rows come back.
  Expected<SampledStep> forward_sample(const model::ForwardBatch& batch, const StepSampling& sampling,
                                       std::span<const int32_t> hidden_rows, Tensor& hidden) override;
  bool supports_layer_hook() const override { return true; }
  void set_layer_hook(std::function<void(int layer)> hook) override { model_->set_layer_hook(std::move(hook)); }
  // Speculative decoding: the target's hidden states come back to the host,
  // for the MTP layer: on the GPU (mtp_runner(), when the model was created
  // with one) or on the CPU (docs/speculative.md).
  bool supports_hidden_states() const override { return true; }
  Expected<Tensor> forward_with_hidden(const model::ForwardBatch& batch, std::span<const int32_t> hidden_rows,
                                       Tensor& hidden) override;
  int32_t num_pages() const { return model_->num_pages(); }
  // The device KV pool as a cache over device memory (never touched by the CPU).
  const kv::KvCache& cache() const { return *cache_; }
  // The MTP layer on the GPU (model options.mtp), for an MtpDrafter; it must
  // not outlive this runner. nullptr when the model has none.
  std::unique_ptr<MtpRunner> mtp_runner();
  // Rank 0 of GPU ranks (--tp/--ep): every forward pass first sends its step
  // plan to the followers (engine/rank_group.h; sockets owned from here on,
  // told to stop on destruction), which run it on their shares of the model
  // (run_cuda_follower); their collectives meet this rank's inside the layers.
  void lead(std::vector<int> follower_fds) { follower_fds_ = std::move(follower_fds); }
  // A data-parallel GPU rank (decode instances, --dp; the model made with an
  // expert exchange): its own engine and requests, stepping together with its
  // peers (engine/rank_group.h LockstepVote): every step opens with a vote,
  // and an idle rank whose peers have work runs its experts for them
  // (CudaQwen3MoeModel::exchange_idle).
  void step_in_lockstep(std::function<Expected<float>(float)> sum_over_ranks) {
    lockstep_.emplace(std::move(sum_over_ranks));
  }
  bool steps_in_lockstep() const override { return lockstep_.has_value(); }
  Status idle_step() override;
  void leave() override;
  const model::CudaQwen3MoeModel& model() const { return *model_; }

 private:
  explicit CudaRunner(std::unique_ptr<model::CudaQwen3MoeModel> model);
  // Before each forward: the followers' plan (--tp/--ep) or the vote (--dp).
  Status begin_step(const model::ForwardBatch& batch, std::span<const int32_t> hidden_rows);
  // After it: a failed step of a lockstep rank fails its later votes.
  template <typename T>
  T end_step(T result) {
    if (lockstep_ && !result) lockstep_->fail();
    return result;
  }
  std::unique_ptr<model::CudaQwen3MoeModel> model_;
  std::optional<kv::KvCache> cache_;
  std::vector<int> follower_fds_;
  bool followers_failed_ = false;  // a follower is gone: every later step fails too
  std::optional<LockstepVote> lockstep_;
};

// A follower GPU rank: runs the leader's step plans on `model` (its share)
// until the leader says stop or goes away (a clean return) or a step fails.
Status run_cuda_follower(model::CudaQwen3MoeModel& model, int plan_fd);

// The kv::KvCacheLayout of a CUDA model's pool (model/cuda/kv_pool.h).
kv::KvCacheLayout kv_cache_layout(const model::CudaKvPoolLayout& pool);

// A GPU rank's KV pool seen by its prefill leader, which sends every rank's
// pages (docs/parallel.md): each rank describes its pool with
// describe_kv_pool() (a CUDA IPC handle, its GPU and layout: a few hundred
// bytes that travel over the ranks' bootstrap), and the leader maps the
// others' with SharedKvPool::open(). One host only.
Expected<std::vector<uint8_t>> describe_kv_pool(const model::CudaQwen3MoeModel& model);
class SharedKvPool {
 public:
  static Expected<std::unique_ptr<SharedKvPool>> open(std::span<const uint8_t> description);
  ~SharedKvPool();  // unmaps the pool
  SharedKvPool(const SharedKvPool&) = delete;
  SharedKvPool& operator=(const SharedKvPool&) = delete;
  // The pool as a cache over the other process's device memory (never touched by the CPU).
  const kv::KvCache& cache() const { return *cache_; }

 private:
  SharedKvPool() = default;
  void* base_ = nullptr;
  std::optional<kv::KvCache> cache_;
};

}  // namespace moe::engine
