// Linear projection: out = x @ w^T, as torch.nn.Linear without bias.
//
//   x   [num_tokens, in_features]            f32
//   w   [out_features, in_features]          bf16 or f32 (HF layout)
//   out [num_tokens, out_features]           f32, fp32 accumulation
//
// Used for q/k/v/o projections, the router gate, MLP/expert projections and
// the lm_head. The CPU version parallelises over output features.
#pragma once

#include <functional>

#include "core/tensor.h"
#include "core/thread_pool.h"

namespace moe::ops::cpu {

void linear(ThreadPool& pool, TensorView x, TensorView w, TensorView out);

// The blocked loop of every CPU projection: out [num_tokens, out_features] =
// x [num_tokens, in_features] @ w^T, where load_rows(first, count, dst) writes
// weight rows [first, first + count) as f32 into dst [count, in_features].
// Each task converts a block of rows once and reuses it for all tokens.
using LoadWeightRows = std::function<void(int64_t first, int64_t count, float* dst)>;
void linear_rows(ThreadPool& pool, const float* x, int64_t num_tokens, int64_t in_features, int64_t out_features,
                 const LoadWeightRows& load_rows, float* out);

// Dot product of two f32 vectors with several independent accumulators (so the
// compiler vectorises it); the summation order is fixed for a given n.
float dot(const float* a, const float* b, int64_t n);

// Converts n elements of a bf16 or f32 buffer to f32.
void to_f32(DType dtype, const void* src, float* dst, int64_t n);

}  // namespace moe::ops::cpu
