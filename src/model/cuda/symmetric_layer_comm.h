// The CudaLayerComm of GPU ranks on one host (or one NVLink domain): comm/
// cuda's fused all-reduce + residual add + RMSNorm over a symmetric
// allocation mapped on every rank, no host synchronisation, so the decode
// steps' CUDA graphs capture it. One-shot below two_shot_min_bytes(world),
// two-shot (rows split over the ranks) above.
//
// Threads: created and used by the rank's engine (or follower) thread.
#pragma once

#include <memory>

#include "comm/bootstrap.h"
#include "comm/cuda/symmetric_memory.h"
#include "model/cuda/layer_comm.h"

namespace moe::model {

class SymmetricLayerComm final : public CudaLayerComm {
 public:
  // Collective: every rank of the instance calls it with the same max_tokens
  // and hidden, after making `device` current. Batches of up to max_tokens
  // rows go in one kernel. `bootstrap` (barrier()) must outlive this.
  static Expected<std::unique_ptr<SymmetricLayerComm>> create(comm::TcpBootstrap& bootstrap, int device,
                                                              int max_tokens, int hidden);
  int rank() const override { return memory_->rank(); }
  int world_size() const override { return memory_->world_size(); }
  bool graph_capturable() const override { return true; }
  Status barrier() override { return bootstrap_.barrier(); }
  Status all_reduce_add_rms_norm(const __nv_bfloat16* delta, float* residual, const __nv_bfloat16* weight,
                                 __nv_bfloat16* out, int num_tokens, int hidden, float eps,
                                 cudaStream_t stream) override;
  Status health() const override;
  // A rank is gone: every wait on the peers, in flight or later, gives up
  // (CudaSymmetricMemory::abort). Any thread.
  void abort() { memory_->abort(); }

 private:
  SymmetricLayerComm(std::unique_ptr<comm::cuda::CudaSymmetricMemory> memory, comm::TcpBootstrap& bootstrap,
                     int max_tokens, int hidden)
      : memory_(std::move(memory)), bootstrap_(bootstrap), max_tokens_(max_tokens), hidden_(hidden) {}
  std::unique_ptr<comm::cuda::CudaSymmetricMemory> memory_;
  comm::TcpBootstrap& bootstrap_;
  int max_tokens_, hidden_;
};

}  // namespace moe::model
