// One logit's penalties and bias as a sparse entry, applied the same way by
// the CPU sampler (engine/sampler.h adjust_logits) and the GPU kernel
// (ops/cuda/kernels.h adjust_logits): a row's entries name each token that
// min_tokens, logit_bias, the repetition penalty or the frequency / presence
// penalties touch, once, with the combined effect in vLLM's order:
//   x += bias           (min_tokens' ban: bias = -inf)
//   x = x > 0 ? x / repetition : x * repetition   (repetition 1: unchanged)
//   x -= subtract       (count x frequency + presence, output tokens only)
#pragma once

#include <cstdint>

#ifdef __CUDACC__
#define MOE_HOST_DEVICE __host__ __device__
#else
#define MOE_HOST_DEVICE
#endif

namespace moe::ops {

struct LogitAdjustment {
  int32_t row;    // logits row
  int32_t token;  // column
  float bias;
  float repetition;
  float subtract;
};

MOE_HOST_DEVICE inline float adjusted_logit(float x, const LogitAdjustment& a) {
  x += a.bias;
  if (a.repetition != 1.0f) x = x > 0.0f ? x / a.repetition : x * a.repetition;
  return x - a.subtract;
}

}  // namespace moe::ops
