// The collective a tensor- or expert-parallel CUDA model runs at a layer
// boundary (model/parallel.h says which boundaries reduce): the residual
// stream, identical on every rank, takes the sum over ranks of each rank's
// partial output, and the next norm follows,
//   residual += sum over ranks of delta;  out = bf16(rms_norm(residual) * weight),
// on the model's stream. Every rank calls it in the same order with the same
// sizes (a rank with no tokens too), and every rank must end with the same
// residual (the sum in rank order).
//
// Implementations: comm/cuda's fused all-reduce + RMSNorm over symmetric
// memory (one process per GPU, CUDA-graph capturable), and the tests'
// in-process ranks (tests/gpu/parallel_cuda_test.cc).
//
// Threads: the thread that drives the rank's model.
#pragma once

#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include "core/status.h"

namespace moe::model {

class CudaLayerComm {
 public:
  virtual ~CudaLayerComm() = default;
  virtual int rank() const = 0;
  virtual int world_size() const = 0;
  // Whether the calls may be captured in a CUDA graph (no host synchronisation).
  virtual bool graph_capturable() const = 0;
  // Every rank meets on the host, with no time limit on the GPU: called
  // before the first collective after a long host phase (the weights'
  // upload), since a collective's wait on the GPU gives up after ~10 s.
  virtual Status barrier() = 0;
  // delta [num_tokens, hidden] bf16 (this rank's partial sum), residual
  // [num_tokens, hidden] f32, weight [hidden], out [num_tokens, hidden].
  virtual Status all_reduce_add_rms_norm(const __nv_bfloat16* delta, float* residual, const __nv_bfloat16* weight,
                                         __nv_bfloat16* out, int num_tokens, int hidden, float eps,
                                         cudaStream_t stream) = 0;
  // After a step's kernels have finished: not ok when its collectives were
  // abandoned (a rank is gone), so the step's results are garbage.
  virtual Status health() const { return Status::ok(); }
};

}  // namespace moe::model
