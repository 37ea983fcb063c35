// The collectives a group of ranks uses to run one instance of the model
// (DESIGN section 3): TP and EP all-reduces, the fused all-reduce + residual +
// RMSNorm of the layer boundary, the decode DP+EP expert exchange
// (dispatch/combine), and the small byte messages of the step plan.
//
// Every rank of the group calls every collective in the same order with the
// same sizes (a rank with no tokens still calls, with zero rows); a rank that
// does not arrive within the communicator's timeout makes the others fail with
// an error naming it, never hang.
//
// Implementations: comm/cpu (POSIX shared memory, the CI path and the
// reference for the GPU kernels), comm/cuda (symmetric device memory over
// NVLink, NCCL as fallback). The CPU one works on f32 activations.
//
// Threads: one thread per rank calls a communicator (the rank's engine thread).
#pragma once

#include <cstdint>
#include <span>
#include <vector>

#include "core/status.h"
#include "core/tensor.h"

namespace moe::comm {

// The decode expert exchange's result on one rank: the (token, slot) pairs of
// every rank routed to this rank's experts, grouped by local expert.
struct Dispatched {
  Tensor x;                             // [num_recv, hidden] f32, rows grouped by local expert
  std::vector<int32_t> expert_offsets;  // [num_local_experts + 1]: rows of local expert e are
                                        // [expert_offsets[e], expert_offsets[e + 1])
  // Where each received row came from (combine sends it back there).
  std::vector<int32_t> src_rank, src_token, src_slot;  // [num_recv]
  int num_recv() const { return static_cast<int>(src_rank.size()); }
};

class Communicator {
 public:
  virtual ~Communicator() = default;
  virtual int rank() const = 0;
  virtual int world_size() const = 0;

  // In place on every rank: data = sum over ranks of data.
  virtual Status all_reduce_sum(std::span<float> data) = 0;

  // The layer boundary fused: residual += sum over ranks of delta; then
  // normed = rms_norm(residual) * norm_weight. delta [n, hidden] f32 (its
  // contents are undefined afterwards), residual and normed [n, hidden] f32,
  // norm_weight [hidden] (bf16 or f32). Same result as all_reduce_sum
  // followed by ops::cpu::add_rms_norm.
  virtual Status all_reduce_add_rms_norm(TensorView delta, TensorView residual, TensorView norm_weight, float eps,
                                         TensorView normed) = 0;

  // Decode DP+EP. Experts are owned in contiguous blocks: expert e lives on
  // rank e / (num_experts / world_size). x [num_tokens, hidden] f32 (this
  // rank's tokens), expert_ids [num_tokens, k] i32 (global ids).
  virtual Expected<Dispatched> dispatch(TensorView x, TensorView expert_ids, int num_experts) = 0;
  // y [d.num_recv(), hidden] f32: the local experts' outputs for d's rows.
  // out[t] = sum over j (ascending) of weights[t, j] * y(row of (this rank, t, j)),
  // out [num_tokens, hidden] f32 and weights [num_tokens, k] f32 of the
  // dispatch call on this rank.
  virtual Status combine(const Dispatched& d, TensorView y, TensorView weights, TensorView out) = 0;

  // Rank `root`'s bytes to every rank (the leader's step plan). On the other
  // ranks `data` is replaced.
  virtual Status broadcast_bytes(std::vector<uint8_t>& data, int root) = 0;
  virtual Status barrier() = 0;
};

}  // namespace moe::comm
