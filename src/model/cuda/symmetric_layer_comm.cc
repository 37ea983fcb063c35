#include "model/cuda/symmetric_layer_comm.h"

#include "comm/cuda/kernels.h"
#include "core/cuda/device_buffer.h"

namespace moe::model {

Expected<std::unique_ptr<SymmetricLayerComm>> SymmetricLayerComm::create(comm::TcpBootstrap& bootstrap, int device,
                                                                          int max_tokens, int hidden) {
  if (hidden % 8 != 0 || hidden > 12288)
    return unimplemented("the fused all-reduce + RMSNorm needs hidden % 8 == 0 and hidden <= 12288, got {}", hidden);
  comm::cuda::SymmetricMemoryOptions options;
  options.device = device;
  // Two halves (alternate launches), each holding the two-shot's 8 bytes per
  // element of a full batch (the one-shot needs 2); rounded up so that each
  // half, cut at 256 bytes, still holds it.
  options.data_bytes = 2 * ((static_cast<size_t>(max_tokens) * hidden * 8 + 255) / 256 * 256 + 256);
  MOE_ASSIGN_OR_RETURN(auto memory, comm::cuda::CudaSymmetricMemory::create(options, bootstrap));
  return std::unique_ptr<SymmetricLayerComm>(new SymmetricLayerComm(std::move(memory), bootstrap, max_tokens, hidden));
}

Status SymmetricLayerComm::all_reduce_add_rms_norm(const __nv_bfloat16* delta, float* residual,
                                                   const __nv_bfloat16* weight, __nv_bfloat16* out, int num_tokens,
                                                   int hidden, float eps, cudaStream_t stream) {
  if (num_tokens > max_tokens_ || hidden != hidden_)
    return invalid_argument("a layer boundary of {} x {}; this communicator takes up to {} x {}", num_tokens, hidden,
                            max_tokens_, hidden_);
  const size_t bytes = static_cast<size_t>(num_tokens) * hidden * sizeof(__nv_bfloat16);
  const comm::cuda::FusedAllReduceNormParams p{memory_->view(), delta,      residual, weight, out, num_tokens, hidden,
                                               eps,             bytes >= comm::cuda::two_shot_min_bytes(world_size())};
  return cuda_status(comm::cuda::fused_all_reduce_add_rms_norm(p, stream), "fused_all_reduce_add_rms_norm");
}

Status SymmetricLayerComm::health() const {
  if (memory_->aborted())
    return unavailable("GPU rank {} of {}: a rank of this instance is gone, the step's collectives were abandoned",
                       rank(), world_size());
  return Status::ok();
}

}  // namespace moe::model
