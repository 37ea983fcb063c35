// Paged causal GQA attention, one block per (token, kv head).
//
// Algorithm: the block's 4 warps stride over the visible positions 0..pos;
// for each position a warp loads the K row (lanes split head_dim), computes
// the scores of all q heads of the group with warp reductions, and keeps an
// online softmax (running max, sum, weighted V) per head. The warps' partial
// states are merged through shared memory at the end.
//
// Roofline: decode reads each K/V byte of a sequence once per kv-head group,
// so it is bound by KV bandwidth; prefill re-reads the prefix for every new
// token (O(T^2 D) bytes) and uses no tensor cores: correct for any batch, far
// from the floor for long prompts. The flash-style prefill kernel and the
// split-KV decode kernel replace it for speed.
#include <cfloat>

#include "ops/cuda/common.cuh"
#include "ops/cuda/kernels.h"

namespace moe::ops::cuda {
namespace {

constexpr int kWarps = 4;
constexpr int kMaxPerLane = 4;   // head_dim <= 128
constexpr int kMaxGroup = 16;    // q heads per kv head

__global__ void __launch_bounds__(kWarps * 32) paged_attention_kernel(PagedAttentionParams p) {
  const int t = blockIdx.x, kv_head = blockIdx.y;
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  const int D = p.head_dim, group = p.num_q_heads / p.num_kv_heads;
  const int pos = p.positions[t], seq = p.token_seq[t];
  const int32_t* pages = p.page_table + static_cast<int64_t>(seq) * p.max_pages_per_seq;

  float q[kMaxGroup][kMaxPerLane], acc[kMaxGroup][kMaxPerLane], m[kMaxGroup], l[kMaxGroup];
#pragma unroll
  for (int g = 0; g < kMaxGroup; ++g) {
    m[g] = -FLT_MAX, l[g] = 0.0f;
#pragma unroll
    for (int i = 0; i < kMaxPerLane; ++i) {
      const int d = lane + 32 * i;
      const bool valid = g < group && d < D;
      q[g][i] = valid ? __bfloat162float(p.q[(static_cast<int64_t>(t) * p.num_q_heads + kv_head * group + g) * D + d]) * p.scale
                      : 0.0f;
      acc[g][i] = 0.0f;
    }
  }
  for (int j = warp; j <= pos; j += kWarps) {
    const int64_t row = ((static_cast<int64_t>(pages[j / p.page_size]) * p.num_kv_heads + kv_head) * p.page_size +
                         j % p.page_size) * D;
    float k[kMaxPerLane], v[kMaxPerLane];
#pragma unroll
    for (int i = 0; i < kMaxPerLane; ++i) {
      const int d = lane + 32 * i;
      k[i] = d < D ? __bfloat162float(p.k_pages[row + d]) : 0.0f;
      v[i] = d < D ? __bfloat162float(p.v_pages[row + d]) : 0.0f;
    }
#pragma unroll
    for (int g = 0; g < kMaxGroup; ++g) {
      if (g >= group) continue;  // not break: the loop must stay unrolled (registers, not local memory)
      float partial = 0.0f;
#pragma unroll
      for (int i = 0; i < kMaxPerLane; ++i) partial += q[g][i] * k[i];
      const float score = warp_sum(partial);
      const float new_max = fmaxf(m[g], score);
      const float correction = __expf(m[g] - new_max), weight = __expf(score - new_max);
      l[g] = l[g] * correction + weight;
#pragma unroll
      for (int i = 0; i < kMaxPerLane; ++i) acc[g][i] = acc[g][i] * correction + weight * v[i];
      m[g] = new_max;
    }
  }
  // Merge the warps' partial softmax states.
  __shared__ float s_m[kWarps][kMaxGroup], s_l[kWarps][kMaxGroup];
  __shared__ float s_acc[kWarps][kMaxGroup][kMaxPerLane * 32];
#pragma unroll
  for (int g = 0; g < kMaxGroup; ++g) {
    if (g >= group) continue;
    if (lane == 0) s_m[warp][g] = m[g], s_l[warp][g] = l[g];
#pragma unroll
    for (int i = 0; i < kMaxPerLane; ++i) s_acc[warp][g][lane + 32 * i] = acc[g][i];
  }
  __syncthreads();
  for (int idx = threadIdx.x; idx < group * D; idx += blockDim.x) {
    const int g = idx / D, d = idx % D;
    float max_all = -FLT_MAX;
    for (int w = 0; w < kWarps; ++w) max_all = fmaxf(max_all, s_m[w][g]);
    float numerator = 0.0f, denominator = 0.0f;
    for (int w = 0; w < kWarps; ++w) {
      const float c = s_l[w][g] > 0.0f ? __expf(s_m[w][g] - max_all) : 0.0f;
      numerator += s_acc[w][g][d] * c;
      denominator += s_l[w][g] * c;
    }
    p.out[(static_cast<int64_t>(t) * p.num_q_heads + kv_head * group + g) * D + d] = __float2bfloat16(numerator / denominator);
  }
}

}  // namespace

cudaError_t paged_attention(const PagedAttentionParams& p, cudaStream_t stream) {
  if (p.head_dim > kMaxPerLane * 32 || p.num_kv_heads < 1 || p.num_q_heads % p.num_kv_heads != 0 ||
      p.num_q_heads / p.num_kv_heads > kMaxGroup || p.out_fp8 != nullptr)
    return cudaErrorInvalidValue;
  if (p.num_tokens == 0) return cudaSuccess;
  paged_attention_kernel<<<dim3(p.num_tokens, p.num_kv_heads), kWarps * 32, 0, stream>>>(p);
  return cudaGetLastError();
}

}  // namespace moe::ops::cuda
