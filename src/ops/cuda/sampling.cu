// Token sampling on the GPU: one block per logits row, the same filters and
// order as engine/sampler.h (temperature, top-k, top-p, min-p) and the same
// counter-based uniform draw for (seed, step).
//
// Algorithm: thresholds instead of sorting. Logits map to order-preserving
// 32-bit keys; the k-th largest key (top-k) and the key where the kept
// probability mass reaches top_p are found by radix select (4 passes of 8
// bits over the row, histograms in shared memory, weighted by probability for
// top-p); min-p is a direct bound on the logit. The draw is an inverse CDF
// over the kept tokens in vocabulary order (a block-wide prefix sum), so a
// seeded row is reproducible on the GPU; it picks from the same distribution
// as the CPU sampler, which walks the kept tokens in probability order, so
// the two may return different tokens for the same seed. Tokens tied with the
// top-k or top-p boundary are all kept (the CPU keeps the lower ids).
// Greedy rows (temperature 0) take the argmax, lowest id on ties, as the CPU.
//
// Speculative verification (a row with a draft) rides on the same pass: the
// prefix sum leaves the draft out, so its total is the kept mass without it;
// the draft's own weight w gives the acceptance test u * (total + w) < w, and
// a rejected row draws from the sums as they are (p without the draft, which
// is rejection sampling's residual for a one-hot draft distribution).
//
// Penalties and logit_bias arrive as sparse entries (adjust_logits, one
// thread each) and structured outputs' token masks as bitmasks (mask_logits),
// applied in place before this kernel.
#include <cfloat>

#include "ops/cuda/common.cuh"
#include "ops/cuda/kernels.h"

namespace moe::ops::cuda {
namespace {

constexpr int kThreads = 1024;

__device__ __forceinline__ uint32_t order_key(float f) {
  const uint32_t bits = __float_as_uint(f);
  return (bits & 0x80000000u) ? ~bits : bits | 0x80000000u;
}

__device__ __forceinline__ uint64_t splitmix(uint64_t z) {
  z += 0x9E3779B97F4A7C15ull;
  z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
  z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
  return z ^ (z >> 31);
}

// The uniform double in [0, 1) of engine/sampler.h uniform_draw, as a float.
__device__ __forceinline__ float uniform(uint64_t seed, uint64_t step) {
  const uint64_t bits = splitmix(splitmix(seed) ^ step);
  return static_cast<float>(static_cast<double>(bits >> 11) * (1.0 / 9007199254740992.0));
}

// f(i, row[i]) for the i this thread owns in a block-strided pass over the
// row: 16-byte loads, several in flight (a pass over a row is latency-bound
// otherwise: one block per row, ~150 dependent loads per thread). Rows of a
// vocabulary divisible by 4 are 16-byte aligned (cudaMalloc'd logits).
template <typename F>
__device__ __forceinline__ void for_each_logit(const float* row, int vocab, F&& f) {
  const int quads = vocab % 4 == 0 ? vocab / 4 : 0;
  const float4* row4 = reinterpret_cast<const float4*>(row);
#pragma unroll 4
  for (int q = threadIdx.x; q < quads; q += blockDim.x) {
    const float4 v = __ldg(row4 + q);
    f(4 * q, v.x), f(4 * q + 1, v.y), f(4 * q + 2, v.z), f(4 * q + 3, v.w);
  }
  for (int i = 4 * quads + threadIdx.x; i < vocab; i += blockDim.x) f(i, row[i]);
}

// Radix select: the largest key K such that weight{key >= K} >= target, over
// keys >= floor_key. Weighted by count (kByMass false) or by exp((l - max) / T).
// Each warp counts into its own histogram (warp_hist [kThreads / 32][256]),
// summed into `hist` after the pass: the first pass's digit is the sign and
// top exponent bits, which a row's logits nearly all share, and one shared
// histogram serialised all 1024 threads on those few bins (measured on an
// H200, 2026-12-02: 11 us a row for top-k + top-p, 1.4 ms for 128 rows).
template <bool kByMass>
__device__ uint32_t radix_select(const float* row, int vocab, uint32_t floor_key, float target,
                                 float max_logit, float inv_temperature, float* hist, float (*warp_hist)[256],
                                 uint32_t* shared_prefix, float* shared_remaining) {
  uint32_t prefix = 0, mask = 0;
  if (threadIdx.x == 0) *shared_remaining = target;
  float* own = warp_hist[threadIdx.x >> 5];
  for (int shift = 24; shift >= 0; shift -= 8) {
    for (int d = threadIdx.x; d < (kThreads / 32) * 256; d += blockDim.x) warp_hist[d >> 8][d & 255] = 0.0f;
    __syncthreads();
    for_each_logit(row, vocab, [&](int, float logit) {
      const uint32_t key = order_key(logit);
      if (key < floor_key || (key & mask) != prefix) return;
      atomicAdd(&own[(key >> shift) & 255], kByMass ? __expf((logit - max_logit) * inv_temperature) : 1.0f);
    });
    __syncthreads();
    for (int d = threadIdx.x; d < 256; d += blockDim.x) {
      float sum = 0.0f;
      for (int w = 0; w < kThreads / 32; ++w) sum += warp_hist[w][d];
      hist[d] = sum;
    }
    __syncthreads();
    if (threadIdx.x == 0) {
      float remaining = *shared_remaining, cumulative = 0.0f;
      int digit = 0;
      for (int d = 255; d >= 0; --d) {
        if (cumulative + hist[d] >= remaining) {
          digit = d;
          break;
        }
        cumulative += hist[d];
      }
      *shared_remaining = remaining - cumulative;
      *shared_prefix = prefix | (static_cast<uint32_t>(digit) << shift);
    }
    __syncthreads();
    prefix = *shared_prefix;
    mask |= 255u << shift;
  }
  return prefix;
}

__global__ void __launch_bounds__(kThreads) sample_kernel(SampleParams p) {
  __shared__ float hist[256];
  __shared__ float warp_hist[kThreads / 32][256];
  __shared__ float scratch[32];
  __shared__ uint32_t shared_prefix;
  __shared__ float shared_remaining;
  __shared__ float scan[kThreads];
  const int r = blockIdx.x;
  const float* row = p.logits + static_cast<int64_t>(r) * p.vocab;
  const SampleRow s = p.rows[r];
  // Max and argmax (lowest id on ties).
  float best = -FLT_MAX;
  int best_index = 0x7fffffff;
  for_each_logit(row, p.vocab, [&](int i, float logit) {
    if (logit > best) best = logit, best_index = i;
  });
  for (int offset = 16; offset > 0; offset >>= 1) {
    const float v = __shfl_xor_sync(0xffffffffu, best, offset);
    const int j = __shfl_xor_sync(0xffffffffu, best_index, offset);
    if (v > best || (v == best && j < best_index)) best = v, best_index = j;
  }
  __shared__ float warp_best[32];
  __shared__ int warp_index[32];
  if ((threadIdx.x & 31) == 0) warp_best[threadIdx.x >> 5] = best, warp_index[threadIdx.x >> 5] = best_index;
  __syncthreads();
  if (threadIdx.x == 0) {
    for (int w = 1; w < kThreads / 32; ++w)
      if (warp_best[w] > best || (warp_best[w] == best && warp_index[w] < best_index)) best = warp_best[w], best_index = warp_index[w];
    warp_best[0] = best, warp_index[0] = best_index;
  }
  __syncthreads();
  const float max_logit = warp_best[0];
  const bool verifies = s.draft >= 0 && s.draft < p.vocab;
  if (s.temperature == 0.0f) {
    if (threadIdx.x == 0) {
      p.tokens[r] = warp_index[0];
      if (p.accepted != nullptr) p.accepted[r] = verifies && warp_index[0] == s.draft;
    }
    return;
  }
  const float inv_t = 1.0f / s.temperature;
  // In the CPU sampler's order: top-k, then top-p over what top-k kept, then min-p.
  uint32_t floor_key = 0;
  if (s.top_k > 0 && s.top_k < p.vocab)
    floor_key = radix_select<false>(row, p.vocab, 0, static_cast<float>(s.top_k), max_logit, inv_t, hist,
                                    warp_hist, &shared_prefix, &shared_remaining);
  if (s.top_p < 1.0f) {
    float mass = 0.0f;
    for_each_logit(row, p.vocab, [&](int, float logit) {
      if (order_key(logit) >= floor_key) mass += __expf((logit - max_logit) * inv_t);
    });
    mass = block_sum(mass, scratch);
    floor_key = max(floor_key, radix_select<true>(row, p.vocab, floor_key, s.top_p * mass, max_logit, inv_t,
                                                  hist, warp_hist, &shared_prefix, &shared_remaining));
  }
  // min-p: p / p_max >= min_p, i.e. logit >= max + T ln(min_p).
  if (s.min_p > 0.0f) floor_key = max(floor_key, order_key(max_logit + s.temperature * logf(s.min_p)));
  // Inverse CDF in vocabulary order: each thread owns a contiguous slice. A
  // draft row leaves its draft out of the sums: `total` is the kept mass
  // without it, which the resample draws from.
  const int excluded = verifies ? s.draft : -1;
  auto weight = [&](int i) {
    return i != excluded && order_key(row[i]) >= floor_key ? __expf((row[i] - max_logit) * inv_t) : 0.0f;
  };
  const int per_thread = (p.vocab + kThreads - 1) / kThreads;
  const int begin = threadIdx.x * per_thread, end = min(p.vocab, begin + per_thread);
  float local = 0.0f;
#pragma unroll 8
  for (int i = begin; i < end; ++i) local += weight(i);
  scan[threadIdx.x] = local;
  __syncthreads();
  for (int offset = 1; offset < kThreads; offset <<= 1) {  // inclusive Hillis-Steele scan
    const float add = threadIdx.x >= offset ? scan[threadIdx.x - offset] : 0.0f;
    __syncthreads();
    scan[threadIdx.x] += add;
    __syncthreads();
  }
  const float total = scan[kThreads - 1];
  if (verifies) {
    // Accept with the draft's probability w / (total + w) (every thread decides alike).
    const float w = order_key(row[s.draft]) >= floor_key ? __expf((row[s.draft] - max_logit) * inv_t) : 0.0f;
    const bool accept = uniform(s.accept_seed, s.step) * (total + w) < w;
    if (threadIdx.x == 0) {
      if (p.accepted != nullptr) p.accepted[r] = accept;
      if (accept) p.tokens[r] = s.draft;
    }
    if (accept) return;
  } else if (threadIdx.x == 0 && p.accepted != nullptr) {
    p.accepted[r] = 0;
  }
  const float target = uniform(s.seed, s.step) * total;
  const float before = threadIdx.x == 0 ? 0.0f : scan[threadIdx.x - 1];
  if (target >= before && (target < scan[threadIdx.x] || threadIdx.x == kThreads - 1)) {
    float cumulative = before;
    int chosen = -1, last_kept = -1;
    for (int i = begin; i < end; ++i) {
      const float w = weight(i);
      if (w <= 0.0f) continue;
      last_kept = i;
      cumulative += w;
      if (target < cumulative) {
        chosen = i;
        break;
      }
    }
    if (chosen < 0) chosen = last_kept;                   // rounding at the very end
    for (int i = p.vocab - 1; chosen < 0 && i >= 0; --i)  // ... past this slice's last kept token
      if (weight(i) > 0.0f) chosen = i;
    p.tokens[r] = chosen >= 0 ? chosen : warp_index[0];
  }
}

__global__ void adjust_logits_kernel(AdjustLogitsParams p) {
  const int e = blockIdx.x * blockDim.x + threadIdx.x;
  if (e >= p.num_entries) return;
  const LogitAdjustment a = p.entries[e];
  float& x = p.logits[static_cast<int64_t>(a.row) * p.vocab + a.token];
  x = adjusted_logit(x, a);
}

__global__ void mask_logits_kernel(MaskLogitsParams p) {
  const int t = blockIdx.x * blockDim.x + threadIdx.x;
  if (t >= p.vocab) return;
  const int64_t words_per_row = (p.vocab + 31) / 32;
  const uint32_t word = p.words[blockIdx.y * words_per_row + t / 32];
  if (((word >> (t % 32)) & 1u) == 0) p.logits[static_cast<int64_t>(p.rows[blockIdx.y]) * p.vocab + t] = -INFINITY;
}

}  // namespace

cudaError_t sample(const SampleParams& p, cudaStream_t stream) {
  if (p.num_rows == 0) return cudaSuccess;
  sample_kernel<<<p.num_rows, kThreads, 0, stream>>>(p);
  return cudaGetLastError();
}

cudaError_t adjust_logits(const AdjustLogitsParams& p, cudaStream_t stream) {
  if (p.num_entries == 0) return cudaSuccess;
  adjust_logits_kernel<<<(p.num_entries + 255) / 256, 256, 0, stream>>>(p);
  return cudaGetLastError();
}

cudaError_t mask_logits(const MaskLogitsParams& p, cudaStream_t stream) {
  if (p.num_masks == 0) return cudaSuccess;
  if (p.num_masks > 65535 || p.vocab <= 0) return cudaErrorInvalidValue;
  constexpr int kBlock = 256;
  mask_logits_kernel<<<dim3((p.vocab + kBlock - 1) / kBlock, p.num_masks), kBlock, 0, stream>>>(p);
  return cudaGetLastError();
}

}  // namespace moe::ops::cuda
