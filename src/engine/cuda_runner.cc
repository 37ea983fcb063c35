#include "engine/cuda_runner.h"

#include <cuda_runtime.h>

namespace moe::engine {

Status cuda_device_status() {
  int count = 0;
  const cudaError_t error = cudaGetDeviceCount(&count);
  if (error != cudaSuccess) return unavailable("--device cuda: no usable GPU: {}", cudaGetErrorString(error));
  if (count == 0) return unavailable("--device cuda: no usable GPU: no CUDA device is visible");
  return Status::ok();
}

Expected<std::unique_ptr<CudaRunner>> CudaRunner::create(const model::ModelConfig& config,
                                                         const model::ModelWeights* weights, uint64_t dummy_seed,
                                                         const model::CudaModelOptions& options) {
  auto made = weights != nullptr ? model::CudaQwen3MoeModel::create(*weights, options)
                                 : model::CudaQwen3MoeModel::create_dummy(config, dummy_seed, options);
  if (!made) return made.status();
  return std::unique_ptr<CudaRunner>(new CudaRunner(std::move(made).value()));
}

Expected<std::vector<int32_t>> CudaRunner::forward_and_sample(const model::ForwardBatch& batch,
                                                              std::span<const RowSampling> rows) {
  std::vector<ops::cuda::SampleRow> device_rows;
  device_rows.reserve(rows.size());
  for (const RowSampling& r : rows)
    device_rows.push_back({r.params.temperature, r.params.top_k, r.params.top_p, r.params.min_p, r.seed, r.step});
  return model_->forward_sample(batch, device_rows);
}

}  // namespace moe::engine
