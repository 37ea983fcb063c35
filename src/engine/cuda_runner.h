// The ModelRunner of the CUDA backend: Qwen3-MoE on one GPU
// (model/cuda/cuda_model.h), its KV pages in device memory. Page ids from the
// scheduler index the device KV pool, whose size the GPU's free memory sets
// (--gpu-memory-utilization) unless given.
//
// forward() is called by the engine thread only.
#pragma once

#include <memory>

#include "engine/model_runner.h"
#include "model/cuda/cuda_model.h"

namespace moe::engine {

// Ok when a CUDA device can be used; else an error a user can act on
// ("--device cuda: no usable GPU: ...").
Status cuda_device_status();

class CudaRunner final : public ModelRunner {
 public:
  // weights == nullptr: random weights generated on the GPU (--load-format dummy).
  static Expected<std::unique_ptr<CudaRunner>> create(const model::ModelConfig& config,
                                                      const model::ModelWeights* weights, uint64_t dummy_seed,
                                                      const model::CudaModelOptions& options);
  int64_t vocab_size() const override { return model_->config().vocab_size; }
  Expected<Tensor> forward(const model::ForwardBatch& batch) override { return model_->forward(batch); }
  bool samples_on_device() const override { return true; }
  Expected<std::vector<int32_t>> forward_and_sample(const model::ForwardBatch& batch,
                                                    std::span<const RowSampling> rows) override;
  int32_t num_pages() const { return model_->num_pages(); }

 private:
  explicit CudaRunner(std::unique_ptr<model::CudaQwen3MoeModel> model) : model_(std::move(model)) {}
  std::unique_ptr<model::CudaQwen3MoeModel> model_;
};

}  // namespace moe::engine
