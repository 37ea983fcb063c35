// The CudaExpertExchange of GPU ranks on one host (or one NVLink domain):
// comm/cuda's dispatch and combine kernels over a symmetric allocation laid
// out as comm::cuda::ExpertLayout, and received_groups between them, so the
// decode step's CUDA graph holds the whole exchange.
//
// Threads: created and used by the rank's engine thread.
#pragma once

#include <memory>

#include "comm/bootstrap.h"
#include "comm/cuda/symmetric_memory.h"
#include "core/cuda/device_buffer.h"
#include "model/cuda/expert_exchange.h"

namespace moe::model {

class SymmetricExpertExchange final : public CudaExpertExchange {
 public:
  // Collective: every rank calls it with the same sizes after making `device`
  // current. max_tokens: the most tokens a rank's step sends (the model's
  // max_num_tokens); fp8: an FP8 payload (FP8 experts). `bootstrap`
  // (barrier()) must outlive this.
  static Expected<std::unique_ptr<SymmetricExpertExchange>> create(comm::TcpBootstrap& bootstrap, int device,
                                                                   int num_experts, int k, int max_tokens,
                                                                   int hidden, bool fp8);
  int rank() const override { return memory_->rank(); }
  int world_size() const override { return memory_->world_size(); }
  bool graph_capturable() const override { return true; }
  bool fp8_payload() const override { return layout_.fp8; }
  Status barrier() override { return bootstrap_.barrier(); }
  Expected<ReceivedRows> dispatch(const void* x, const float* x_scales, const int32_t* expert_ids,
                                  int num_tokens, cudaStream_t stream) override;
  Status combine(const float* y, const float* weights, float* out, int num_tokens,
                 cudaStream_t stream) override;
  Status health() const override;
  // A rank is gone: every wait on the peers, in flight or later, gives up. Any thread.
  void abort() { memory_->abort(); }
  size_t allocation_bytes() const { return memory_->allocation_bytes(); }

 private:
  SymmetricExpertExchange(std::unique_ptr<comm::cuda::CudaSymmetricMemory> memory,
                          comm::TcpBootstrap& bootstrap, const comm::cuda::ExpertLayout& layout,
                          DeviceTensor groups)
      : memory_(std::move(memory)), bootstrap_(bootstrap), layout_(layout), groups_(std::move(groups)) {}
  int32_t* expert_offsets() const { return groups_.data_as<int32_t>(); }
  int32_t* tile_offsets() const { return expert_offsets() + layout_.experts_per_rank + 1; }
  int32_t* gather() const { return tile_offsets() + layout_.experts_per_rank + 1; }

  std::unique_ptr<comm::cuda::CudaSymmetricMemory> memory_;
  comm::TcpBootstrap& bootstrap_;
  comm::cuda::ExpertLayout layout_;
  DeviceTensor groups_;  // i32: expert offsets, tile offsets, gather index
};

}  // namespace moe::model
