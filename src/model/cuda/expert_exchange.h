// The expert exchange of a data-parallel attention rank (decode instances,
// model/parallel.h dp_attention): each rank attends over its own requests,
// then every MoE layer sends each (token, slot) row to the rank owning its
// expert (dispatch), runs its own experts over what it received, and sends
// the outputs back to be summed per token (combine). Experts are owned in
// contiguous blocks: expert e lives on rank e / experts_per_rank.
//
// Every rank calls dispatch and combine once per MoE layer in the same order
// (a rank with no tokens too, with zero rows), on the model's stream.
//
// Implementations: SymmetricExpertExchange (comm/cuda's dispatch/combine over
// NVLink peer memory, CUDA-graph capturable) and the tests' in-process ranks
// (tests/gpu/parallel_cuda_test.cc).
//
// Threads: the thread that drives the rank's model.
#pragma once

#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <cstdint>

#include "core/status.h"

namespace moe::model {

// What a rank received, laid out for the grouped GEMM's contiguous groups
// (ops/cuda/kernels.h GroupedGemmParams, tiles of ops::cuda::kGroupedGemmTileRows):
// local expert e's rows are GEMM rows [expert_offsets[e], expert_offsets[e + 1]),
// GEMM row i being row gather[i] of `rows`. All device pointers, valid until
// the next dispatch; the counts never come to the host.
struct ReceivedRows {
  const void* rows;               // [.., hidden] bf16, or E4M3 with an FP8 payload
  const float* row_scales;        // FP8 payload: [.., ceil(hidden / 128)], the rows' scales; else null
  const int32_t* gather;          // [max_rows]
  const int32_t* expert_offsets;  // [experts_per_rank + 1]
  const int32_t* tile_offsets;    // [experts_per_rank + 1]
  int max_rows = 0;               // bound on the rows received (sizes the GEMMs' buffers)
  int max_tiles = 0;              // bound on tile_offsets[experts_per_rank] (the GEMMs' grids)
};

class CudaExpertExchange {
 public:
  virtual ~CudaExpertExchange() = default;
  virtual int rank() const = 0;
  virtual int world_size() const = 0;
  virtual bool graph_capturable() const = 0;
  // The rows travel as E4M3 with f32 scales per 1 x 128 (the fp8-block
  // activations the FP8 expert GEMMs read) instead of bf16.
  virtual bool fp8_payload() const = 0;
  // Every rank meets on the host (before the first exchange after a long host phase).
  virtual Status barrier() = 0;
  // x [num_tokens, hidden] bf16 (FP8 payload: E4M3, with x_scales
  // [num_tokens, ceil(hidden / 128)]), expert_ids [num_tokens, k] global ids
  // (distinct within a token).
  virtual Expected<ReceivedRows> dispatch(const void* x, const float* x_scales, const int32_t* expert_ids,
                                          int num_tokens, cudaStream_t stream) = 0;
  // y [received rows, hidden] f32: the local experts' outputs in the GEMM
  // rows' order of the last dispatch. out [num_tokens, hidden] f32, this
  // rank's tokens: out[t] = sum over slots j ascending of weights[t, j] *
  // bf16(y of (t, j)); weights [num_tokens, k] as routed.
  virtual Status combine(const float* y, const float* weights, float* out, int num_tokens,
                         cudaStream_t stream) = 0;
  // After a step's kernels have finished: not ok when its exchanges were
  // abandoned (a rank is gone), so the step's results are garbage.
  virtual Status health() const { return Status::ok(); }
};

}  // namespace moe::model
