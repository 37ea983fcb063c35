#include "model/cuda/symmetric_expert_exchange.h"

#include "comm/cuda/kernels.h"
#include "ops/cuda/kernels.h"

namespace moe::model {

Expected<std::unique_ptr<SymmetricExpertExchange>> SymmetricExpertExchange::create(
    comm::TcpBootstrap& bootstrap, int device, int num_experts, int k, int max_tokens, int hidden, bool fp8) {
  const int world = bootstrap.world_size();
  if (world > comm::cuda::kMaxRanks)
    return unimplemented("the expert exchange runs up to {} ranks, got {}", comm::cuda::kMaxRanks, world);
  if (num_experts % world != 0 || k < 1 || k > num_experts)
    return invalid_argument("{} experts (top-{}) do not split over {} ranks", num_experts, k, world);
  if (hidden % 16 != 0) return unimplemented("the expert exchange needs hidden % 16 == 0, got {}", hidden);
  const comm::cuda::ExpertLayout layout{world, num_experts / world, max_tokens, k, hidden, fp8};
  comm::cuda::SymmetricMemoryOptions options;
  options.device = device;
  options.data_bytes = layout.total_bytes() - comm::cuda::kSignalBytes;
  MOE_ASSIGN_OR_RETURN(auto memory, comm::cuda::CudaSymmetricMemory::create(options, bootstrap));
  const int64_t words = 2 * (int64_t{layout.experts_per_rank} + 1) + comm::cuda::max_received_rows(layout);
  MOE_ASSIGN_OR_RETURN(auto groups, DeviceTensor::allocate(DType::kI32, {words}));
  return std::unique_ptr<SymmetricExpertExchange>(
      new SymmetricExpertExchange(std::move(memory), bootstrap, layout, std::move(groups)));
}

Expected<ReceivedRows> SymmetricExpertExchange::dispatch(const void* x, const float* x_scales,
                                                         const int32_t* expert_ids, int num_tokens,
                                                         cudaStream_t stream) {
  if (num_tokens > layout_.max_tokens)
    return invalid_argument("an expert exchange of {} tokens; this one takes up to {}", num_tokens,
                            layout_.max_tokens);
  const comm::cuda::SymmetricView& view = memory_->view();
  MOE_RETURN_IF_ERROR(cuda_status(
      comm::cuda::dispatch({view, layout_, x, expert_ids, num_tokens, x_scales}, stream), "expert dispatch"));
  constexpr int kTile = ops::cuda::kGroupedGemmTileRows;
  MOE_RETURN_IF_ERROR(cuda_status(
      comm::cuda::received_groups({view, layout_, expert_offsets(), tile_offsets(), gather(), kTile}, stream),
      "received_groups"));
  const auto max_rows = static_cast<int>(comm::cuda::max_received_rows(layout_));
  return ReceivedRows{comm::cuda::received_rows(view, layout_),
                      comm::cuda::received_scales(view, layout_),
                      gather(),
                      expert_offsets(),
                      tile_offsets(),
                      max_rows,
                      (max_rows + kTile - 1) / kTile + layout_.experts_per_rank};
}

Status SymmetricExpertExchange::combine(const float* y, const float* weights, float* out, int num_tokens,
                                        cudaStream_t stream) {
  comm::cuda::CombineParams p{memory_->view(), layout_, nullptr, weights, out, num_tokens};
  p.y_rows = y;
  return cuda_status(comm::cuda::combine(p, stream), "expert combine");
}

Status SymmetricExpertExchange::health() const {
  if (memory_->aborted())
    return unavailable(
        "GPU rank {} of {}: a rank of this instance is gone, the step's expert exchanges were abandoned",
        rank(), world_size());
  return Status::ok();
}

}  // namespace moe::model
