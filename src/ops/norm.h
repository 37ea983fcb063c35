// RMSNorm as Qwen3 defines it: y = x / sqrt(mean(x^2) + eps) * weight, in f32.
//
//   rms_norm:       x [num_rows, dim] f32, weight [dim] bf16|f32, out [num_rows, dim] f32
//                   (out may alias x). Also serves the per-head q/k norm: view
//                   q [tokens, heads, head_dim] as [tokens*heads, head_dim].
//   add_rms_norm:   residual += delta, then out = rms_norm(residual); the
//                   residual-stream update of a decoder layer in one pass.
#pragma once

#include "core/tensor.h"
#include "core/thread_pool.h"

namespace moe::ops::cpu {

void rms_norm(ThreadPool& pool, TensorView x, TensorView weight, float eps, TensorView out);
void add_rms_norm(ThreadPool& pool, TensorView residual, TensorView delta, TensorView weight,
                  float eps, TensorView out);

}  // namespace moe::ops::cpu
