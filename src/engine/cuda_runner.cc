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

}  // namespace moe::engine
