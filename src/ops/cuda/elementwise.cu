// Row-wise kernels: embedding, residual add + RMSNorm, q/k norm + RoPE + KV
// store, SiLU-multiply, argmax, row gather. All are memory-bound and read each
// input once; one block per row (or per head of a token).
#include "ops/cuda/common.cuh"
#include "ops/cuda/kernels.h"

#include <algorithm>

namespace moe::ops::cuda {
namespace {

__global__ void embedding_kernel(EmbeddingParams p) {
  const int t = blockIdx.x;
  const int id = p.ids[t];
  if (id < 0 || id >= p.vocab) return;  // ids are validated on the host
  const bf16* row = p.table + static_cast<int64_t>(id) * p.hidden;
  float* out = p.out + static_cast<int64_t>(t) * p.hidden;
  for (int i = threadIdx.x; i < p.hidden; i += blockDim.x) out[i] = __bfloat162float(row[i]);
}

__global__ void add_rms_norm_kernel(AddRmsNormParams p) {
  __shared__ float scratch[32];
  const int64_t base = static_cast<int64_t>(blockIdx.x) * p.hidden;
  float* residual = p.residual + base;
  float sum_squares = 0.0f;
  for (int i = threadIdx.x; i < p.hidden; i += blockDim.x) {
    float v = residual[i];
    if (p.delta != nullptr) residual[i] = v = v + p.delta[base + i];
    sum_squares += v * v;
  }
  const float inv_rms = rsqrtf(block_sum(sum_squares, scratch) / static_cast<float>(p.hidden) + p.eps);
  for (int i = threadIdx.x; i < p.hidden; i += blockDim.x)
    p.out[base + i] = __float2bfloat16(__bfloat162float(p.weight[i]) * (residual[i] * inv_rms));
}

// The same for rows of hidden % 4 == 0 and hidden <= 4 * kNormThreads *
// kMaxNormVec (every Qwen3 MoE): float4 loads, kNormVec per thread, the row
// kept in registers between the sum of squares and the scaling, 512 threads.
// A decode step has few tokens, so each block's latency is the kernel's:
// measured on an H200 at 64 tokens x 4096, 13 us for the scalar kernel above
// (two passes over the row). kNormVec is the row's need (2 at hidden 4096),
// so no registers go to columns past it.
constexpr int kNormThreads = 512, kMaxNormVec = 4;

template <int kNormVec>
__global__ void __launch_bounds__(kNormThreads) add_rms_norm_vec_kernel(AddRmsNormParams p) {
  __shared__ float scratch[32];
  const int64_t base = static_cast<int64_t>(blockIdx.x) * p.hidden;
  auto* residual = reinterpret_cast<float4*>(p.residual + base);
  const auto* delta = p.delta != nullptr ? reinterpret_cast<const float4*>(p.delta + base) : nullptr;
  const int n = p.hidden / 4;
  // The residual and delta rows, every load issued before any is used.
  float4 v[kNormVec], add[kNormVec];
#pragma unroll
  for (int j = 0; j < kNormVec; ++j) {
    const int i = threadIdx.x + j * kNormThreads;
    add[j] = make_float4(0.0f, 0.0f, 0.0f, 0.0f);
    if (i >= n) continue;
    v[j] = residual[i];
    if (delta != nullptr && p.expert_rows == nullptr) add[j] = delta[i];
  }
  // Or the MoE's delta (moe_unpermute's sum, in its order), kInFlight
  // experts' loads issued before any is summed. (Each summed as it came, one
  // row load at a time per thread, 4096 tokens took 204 us against 162 for
  // the un-permute and the RMSNorm apart; H200, ncu.)
  if (p.expert_rows != nullptr) {
    constexpr int kInFlight = 4;
    const int32_t* row_of = p.row_of + static_cast<int64_t>(blockIdx.x) * p.k;
    const float* weights = p.expert_weights + static_cast<int64_t>(blockIdx.x) * p.k;
    for (int e0 = 0; e0 < p.k; e0 += kInFlight) {
      int32_t rows[kInFlight];
      uint2 raw[kInFlight][kNormVec];
#pragma unroll
      for (int u = 0; u < kInFlight; ++u) rows[u] = e0 + u < p.k ? row_of[e0 + u] : -1;
#pragma unroll
      for (int u = 0; u < kInFlight; ++u) {
        const auto* row = reinterpret_cast<const uint2*>(p.expert_rows + static_cast<int64_t>(max(rows[u], 0)) * p.hidden);
#pragma unroll
        for (int j = 0; j < kNormVec; ++j) {
          const int i = threadIdx.x + j * kNormThreads;
          if (rows[u] >= 0 && i < n) raw[u][j] = row[i];
        }
      }
#pragma unroll
      for (int u = 0; u < kInFlight; ++u) {
        if (rows[u] < 0) continue;
        const float w = weights[e0 + u];
#pragma unroll
        for (int j = 0; j < kNormVec; ++j) {
          const float2 lo = __bfloat1622float2(*reinterpret_cast<const __nv_bfloat162*>(&raw[u][j].x));
          const float2 hi = __bfloat1622float2(*reinterpret_cast<const __nv_bfloat162*>(&raw[u][j].y));
          add[j].x += w * lo.x, add[j].y += w * lo.y, add[j].z += w * hi.x, add[j].w += w * hi.y;
        }
      }
    }
  }
  const bool adds = delta != nullptr || p.expert_rows != nullptr;
  float sum_squares = 0.0f;
#pragma unroll
  for (int j = 0; j < kNormVec; ++j) {
    const int i = threadIdx.x + j * kNormThreads;
    if (i >= n) continue;
    float4& x = v[j];
    if (adds) {
      x.x += add[j].x, x.y += add[j].y, x.z += add[j].z, x.w += add[j].w;
      residual[i] = x;
    }
    sum_squares += x.x * x.x + x.y * x.y + x.z * x.z + x.w * x.w;
  }
  const float inv_rms = rsqrtf(block_sum(sum_squares, scratch) / static_cast<float>(p.hidden) + p.eps);
  auto* out = reinterpret_cast<uint2*>(p.out + base);
  const auto* weight = reinterpret_cast<const uint2*>(p.weight);
#pragma unroll
  for (int j = 0; j < kNormVec; ++j) {
    const int i = threadIdx.x + j * kNormThreads;
    if (i >= n) continue;
    const uint2 w = weight[i];
    const float2 w01 = __bfloat1622float2(*reinterpret_cast<const __nv_bfloat162*>(&w.x));
    const float2 w23 = __bfloat1622float2(*reinterpret_cast<const __nv_bfloat162*>(&w.y));
    const __nv_bfloat162 o01 = __floats2bfloat162_rn(w01.x * (v[j].x * inv_rms), w01.y * (v[j].y * inv_rms));
    const __nv_bfloat162 o23 = __floats2bfloat162_rn(w23.x * (v[j].z * inv_rms), w23.y * (v[j].w * inv_rms));
    out[i] = make_uint2(*reinterpret_cast<const uint32_t*>(&o01), *reinterpret_cast<const uint32_t*>(&o23));
    if (p.out_fp8 == nullptr) continue;
    // 32 float4 are a 1 x 128 group: warp w holds group i / 32 (hidden % 128
    // == 0, so a warp is all in or all out). The bf16 values, as
    // quantize_fp8_groups reads them.
    const float2 r01 = __bfloat1622float2(o01), r23 = __bfloat1622float2(o23);
    const float amax = warp_max(fmaxf(fmaxf(fabsf(r01.x), fabsf(r01.y)), fmaxf(fabsf(r23.x), fabsf(r23.y))));
    const float scale = fmaxf(amax, 1e-10f) / 448.0f, inv = 1.0f / scale;
    reinterpret_cast<uint32_t*>(p.out_fp8 + base)[i] = e4m3x4(r01.x, r01.y, r23.x, r23.y, scale, inv);
    if ((threadIdx.x & 31) == 0 && p.out_scales != nullptr) {
      const int group = i / 32, row = blockIdx.x;
      p.out_scales[p.scales_by_group ? static_cast<int64_t>(group) * p.num_tokens + row
                                     : static_cast<int64_t>(row) * (p.hidden / 128) + group] = scale;
    }
  }
}

// Block (token, group of heads), a warp per head of the group in turn: head
// < num_q_heads is a q head, then the k heads, then the v heads. The block
// first computes the token's rotation (cos, sin per frequency) into shared
// memory; a q or k warp then reduces its head's sum of squares with shuffles
// and writes the rotated row. With head_dim 128 (every Qwen3 MoE model) a
// lane holds 4 consecutive elements (8-byte loads and stores) and takes the
// rotation's partner (d +- 64) from lane +- 16; other sizes go through the
// warp's shared-memory row. Decode batches take groups of kRopeWarps heads
// (many blocks for few tokens); prefill ones all of a token's heads in one
// block (its rotation computed once, not once per group). (A block per
// (token, head) of head_dim threads, each with its own cosf and sinf and a
// block-wide reduction, took 29 us per decode layer at batch 256 and ~10x its
// bytes; groups of 8 heads 137 us for 4096 prefill tokens, ~1.2 TB/s; H200,
// 2026-12-03.)
constexpr int kRopeWarps = 8;

__global__ void __launch_bounds__(kRopeWarps * 32) qk_norm_rope_kv_kernel(QkNormRopeKvParams p, int heads_per_block) {
  extern __shared__ float rope_smem[];  // cos [half], sin [half], then a [head_dim] row per warp
  const int t = blockIdx.x, D = p.head_dim, half = D / 2, lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  const int num_heads = p.num_q_heads + 2 * p.num_kv_heads;
  const int pos = p.positions[t];
  float* cos_table = rope_smem;
  float* sin_table = rope_smem + half;
  for (int i = threadIdx.x; i < half; i += blockDim.x) {
    float sn, cs;
    sincosf(static_cast<float>(pos) * p.inv_freq[i], &sn, &cs);
    cos_table[i] = cs * p.attention_factor;
    sin_table[i] = sn * p.attention_factor;
  }
  __syncthreads();
  const int first_head = blockIdx.y * heads_per_block, end_head = min(num_heads, first_head + heads_per_block);
  // The token's row of kv head 0 in its page, in elements (head h adds h * page_size * D); read once per warp.
  int64_t kv_base = -1;
  // Head `head`'s input row, and where it goes: q_out, or its page's K or V row.
  struct Head {
    const bf16* x;
    bf16* out;
    bool is_q, is_k;
  };
  auto row_in = [&](int head) { return p.qkv + (static_cast<int64_t>(t) * num_heads + head) * D; };
  auto locate = [&](int head) {
    Head h;
    h.x = row_in(head);
    h.is_q = head < p.num_q_heads, h.is_k = !h.is_q && head < p.num_q_heads + p.num_kv_heads;
    if (h.is_q) {
      h.out = p.q_out + (static_cast<int64_t>(t) * p.num_q_heads + head) * D;
    } else {
      if (kv_base < 0) {
        const int page = p.page_table[p.token_seq[t] * p.max_pages_per_seq + pos / p.page_size];
        kv_base = (static_cast<int64_t>(page) * p.num_kv_heads * p.page_size + pos % p.page_size) * D;
      }
      const int kv_head = head - p.num_q_heads - (h.is_k ? 0 : p.num_kv_heads);
      h.out = (h.is_k ? p.k_pages : p.v_pages) + kv_base + static_cast<int64_t>(kv_head) * p.page_size * D;
    }
    return h;
  };
  if (D == 128) {
    // kInFlight heads per warp per round, their loads issued first (one at a
    // time, 4096 prefill tokens took 76 us: ~2 TB/s; H200, ncu).
    constexpr int kInFlight = 3;
    const int d0 = 4 * lane;
    for (int head0 = first_head + warp; head0 < end_head; head0 += kRopeWarps * kInFlight) {
      uint2 raw[kInFlight];
#pragma unroll
      for (int u = 0; u < kInFlight; ++u) {
        const int head = head0 + u * kRopeWarps;
        if (head < end_head) raw[u] = *reinterpret_cast<const uint2*>(row_in(head) + d0);
      }
#pragma unroll
      for (int u = 0; u < kInFlight; ++u) {
        const int head = head0 + u * kRopeWarps;
        if (head >= end_head) break;  // warp-uniform
        const Head h = locate(head);
        if (!h.is_q && !h.is_k) {  // v: stored as is
          *reinterpret_cast<uint2*>(h.out + d0) = raw[u];
          continue;
        }
        const float2 x01 = __bfloat1622float2(*reinterpret_cast<const __nv_bfloat162*>(&raw[u].x));
        const float2 x23 = __bfloat1622float2(*reinterpret_cast<const __nv_bfloat162*>(&raw[u].y));
        const float v[4] = {x01.x, x01.y, x23.x, x23.y};
        float sum_squares = v[0] * v[0] + v[1] * v[1] + v[2] * v[2] + v[3] * v[3];
        for (int offset = 16; offset > 0; offset >>= 1) sum_squares += __shfl_xor_sync(0xffffffffu, sum_squares, offset);
        const float inv_rms = rsqrtf(sum_squares / static_cast<float>(D) + p.eps);
        const uint2 w = *reinterpret_cast<const uint2*>((h.is_q ? p.q_norm : p.k_norm) + d0);
        const float2 w01 = __bfloat1622float2(*reinterpret_cast<const __nv_bfloat162*>(&w.x));
        const float2 w23 = __bfloat1622float2(*reinterpret_cast<const __nv_bfloat162*>(&w.y));
        const float normed[4] = {w01.x * (v[0] * inv_rms), w01.y * (v[1] * inv_rms), w23.x * (v[2] * inv_rms),
                                 w23.y * (v[3] * inv_rms)};
        const float4 cs = *reinterpret_cast<const float4*>(cos_table + (d0 & 63));
        const float4 sn = *reinterpret_cast<const float4*>(sin_table + (d0 & 63));
        const float cos4[4] = {cs.x, cs.y, cs.z, cs.w}, sin4[4] = {sn.x, sn.y, sn.z, sn.w};
        float rotated[4];
#pragma unroll
        for (int j = 0; j < 4; ++j) {
          const float partner = __shfl_xor_sync(0xffffffffu, normed[j], 16);  // element d0 + j -+ 64
          rotated[j] = lane < 16 ? normed[j] * cos4[j] - partner * sin4[j] : normed[j] * cos4[j] + partner * sin4[j];
        }
        const __nv_bfloat162 o01 = __floats2bfloat162_rn(rotated[0], rotated[1]);
        const __nv_bfloat162 o23 = __floats2bfloat162_rn(rotated[2], rotated[3]);
        *reinterpret_cast<uint2*>(h.out + d0) =
            make_uint2(*reinterpret_cast<const uint32_t*>(&o01), *reinterpret_cast<const uint32_t*>(&o23));
      }
    }
    return;
  }
  for (int head = first_head + warp; head < end_head; head += kRopeWarps) {
    const Head h = locate(head);
    const bf16* x = h.x;
    const bool is_q = h.is_q, is_k = h.is_k;
    const bf16* weight = is_q ? p.q_norm : p.k_norm;
    bf16* out = h.out;
    if (!is_q && !is_k) {  // v: stored as is
      for (int d = lane; d < D; d += 32) out[d] = x[d];
      continue;
    }
    float* row = rope_smem + D + warp * D;
    float sum_squares = 0.0f;
    for (int d = lane; d < D; d += 32) {
      const float v = __bfloat162float(x[d]);
      row[d] = v;
      sum_squares += v * v;
    }
    for (int offset = 16; offset > 0; offset >>= 1) sum_squares += __shfl_xor_sync(0xffffffffu, sum_squares, offset);
    const float inv_rms = rsqrtf(sum_squares / static_cast<float>(D) + p.eps);
    for (int d = lane; d < D; d += 32) row[d] = __bfloat162float(weight[d]) * (row[d] * inv_rms);
    __syncwarp();
    for (int d = lane; d < D; d += 32) {
      const int i = d < half ? d : d - half;
      const float rotated = d < half ? row[d] * cos_table[i] - row[d + half] * sin_table[i]
                                     : row[d] * cos_table[i] + row[d - half] * sin_table[i];
      out[d] = __float2bfloat16(rotated);
    }
    __syncwarp();  // the row is the warp's next head's
  }
}

__global__ void silu_mul_kernel(SiluMulParams p) {
  const int t = blockIdx.x;
  const bf16* gu = p.gate_up + static_cast<int64_t>(t) * 2 * p.inter;
  for (int i = threadIdx.x; i < p.inter; i += blockDim.x) {
    const float g = __bfloat162float(gu[i]), u = __bfloat162float(gu[p.inter + i]);
    p.act[static_cast<int64_t>(t) * p.inter + i] = __float2bfloat16(g / (1.0f + expf(-g)) * u);
  }
}

__global__ void cast_to_bf16_kernel(CastToBf16Params p) {
  for (int64_t i = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; i < p.n;
       i += static_cast<int64_t>(gridDim.x) * blockDim.x)
    p.out[i] = __float2bfloat16(p.in[i]);
}

__global__ void widen_rows_kernel(WidenRowsParams p) {
  const bf16* src = p.src + static_cast<int64_t>(p.index[blockIdx.x]) * p.cols;
  float* dst = p.dst + static_cast<int64_t>(blockIdx.x) * p.cols;
  for (int c = threadIdx.x; c < p.cols; c += blockDim.x) dst[c] = __bfloat162float(src[c]);
}

__global__ void argmax_kernel(ArgmaxParams p) {
  __shared__ float best_value[32];
  __shared__ int best_index[32];
  const float* row = p.logits + static_cast<int64_t>(blockIdx.x) * p.vocab;
  float value = -INFINITY;
  int index = 0x7fffffff;
  // float4 loads: a decode step's rows are few, so each block's read speed is the kernel's.
  if (p.vocab % 4 == 0) {
    const auto* row4 = reinterpret_cast<const float4*>(row);
    for (int i = threadIdx.x; i < p.vocab / 4; i += blockDim.x) {
      const float4 v = row4[i];  // in index order, so the first hit per thread is still its lowest
      if (v.x > value) value = v.x, index = 4 * i;
      if (v.y > value) value = v.y, index = 4 * i + 1;
      if (v.z > value) value = v.z, index = 4 * i + 2;
      if (v.w > value) value = v.w, index = 4 * i + 3;
    }
  } else {
    for (int i = threadIdx.x; i < p.vocab; i += blockDim.x)
      if (row[i] > value) value = row[i], index = i;  // strided: the first hit per thread is its lowest
  }
  for (int offset = 16; offset > 0; offset >>= 1) {
    const float v = __shfl_xor_sync(0xffffffffu, value, offset);
    const int j = __shfl_xor_sync(0xffffffffu, index, offset);
    if (v > value || (v == value && j < index)) value = v, index = j;
  }
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  if (lane == 0) best_value[warp] = value, best_index[warp] = index;
  __syncthreads();
  if (threadIdx.x == 0) {
    for (int w = 1; w < static_cast<int>(blockDim.x >> 5); ++w)
      if (best_value[w] > value || (best_value[w] == value && best_index[w] < index)) value = best_value[w], index = best_index[w];
    p.ids[blockIdx.x] = index;
  }
}

// One warp per row, 16 (or 4) bytes per lane per step, 8 steps' loads issued
// before their stores (one at a time, FP8 prefill rows of 4 KB went at ~2.5
// TB/s of writes: 4096 tokens x top-8 in 53 us; H200, ncu).
template <typename Unit>
__global__ void gather_rows_kernel(GatherRowsParams p) {
  constexpr int kSteps = 8;
  const int64_t row = (static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x) / 32;
  const int lane = threadIdx.x & 31;
  const int64_t live = p.live_rows != nullptr ? min(p.rows, static_cast<int64_t>(*p.live_rows)) : p.rows;
  if (row >= live) return;
  const int units = static_cast<int>(p.row_bytes / static_cast<int64_t>(sizeof(Unit)));
  const Unit* src = static_cast<const Unit*>(p.src) + p.index[row] * int64_t{units};
  Unit* dst = static_cast<Unit*>(p.dst) + row * units;
  int i = lane;
  for (; i + 32 * (kSteps - 1) < units; i += 32 * kSteps) {
    Unit v[kSteps];
#pragma unroll
    for (int u = 0; u < kSteps; ++u) v[u] = src[i + 32 * u];
#pragma unroll
    for (int u = 0; u < kSteps; ++u) dst[i + 32 * u] = v[u];
  }
  for (; i < units; i += 32) dst[i] = src[i];
}

__global__ void fill_random_kernel(FillRandomParams p) {
  for (int64_t i = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; i < p.n;
       i += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    uint64_t z = p.seed * 0x9E3779B97F4A7C15ull + static_cast<uint64_t>(i);
    z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
    z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
    z ^= z >> 31;
    const float u = static_cast<float>(z >> 40) * (1.0f / 16777216.0f) * 2.0f - 1.0f;
    p.out[i] = __float2bfloat16(p.center + p.scale * u);
  }
}

}  // namespace

cudaError_t fill_random(const FillRandomParams& p, cudaStream_t stream) {
  if (p.n == 0) return cudaSuccess;
  fill_random_kernel<<<1024, 256, 0, stream>>>(p);
  return cudaGetLastError();
}

cudaError_t embedding(const EmbeddingParams& p, cudaStream_t stream) {
  if (p.num_tokens == 0) return cudaSuccess;
  embedding_kernel<<<p.num_tokens, 256, 0, stream>>>(p);
  return cudaGetLastError();
}

bool add_rms_norm_fuses(int hidden) { return hidden % 128 == 0 && hidden <= 4 * kNormThreads * kMaxNormVec; }

cudaError_t add_rms_norm(const AddRmsNormParams& p, cudaStream_t stream) {
  if (p.num_tokens == 0) return cudaSuccess;
  if ((p.out_fp8 != nullptr || p.expert_rows != nullptr) && !add_rms_norm_fuses(p.hidden)) return cudaErrorInvalidValue;
  if (p.hidden % 4 == 0 && p.hidden <= 4 * kNormThreads * kMaxNormVec) {
    const int vec = (p.hidden / 4 + kNormThreads - 1) / kNormThreads;
    static_assert(kMaxNormVec == 4);
    const auto kernel = vec == 1 ? add_rms_norm_vec_kernel<1>
                                 : (vec == 2 ? add_rms_norm_vec_kernel<2> : add_rms_norm_vec_kernel<4>);
    kernel<<<p.num_tokens, kNormThreads, 0, stream>>>(p);
  } else {
    add_rms_norm_kernel<<<p.num_tokens, 256, 0, stream>>>(p);
  }
  return cudaGetLastError();
}

cudaError_t qk_norm_rope_kv(const QkNormRopeKvParams& p, cudaStream_t stream) {
  if (p.head_dim % 2 != 0 || p.head_dim > 1024 || p.head_dim < 2) return cudaErrorInvalidValue;
  if (p.num_tokens == 0) return cudaSuccess;
  // Groups of kRopeWarps heads while the grid has fewer than ~16 blocks per
  // SM; past that, fewer, larger groups (one per token from ~2,100 tokens on
  // an H200).
  const int num_heads = p.num_q_heads + 2 * p.num_kv_heads, groups = (num_heads + kRopeWarps - 1) / kRopeWarps;
  const int64_t wanted_blocks = int64_t{16} * multiprocessor_count();
  const int blocks_per_token =
      static_cast<int>(std::clamp<int64_t>((wanted_blocks + p.num_tokens - 1) / p.num_tokens, 1, groups));
  const int heads_per_block = (num_heads + blocks_per_token - 1) / blocks_per_token;
  const dim3 grid(p.num_tokens, (num_heads + heads_per_block - 1) / heads_per_block);
  // At most 9 x 1024 floats (36 KB): within the default dynamic shared memory.
  const size_t smem = static_cast<size_t>(1 + kRopeWarps) * p.head_dim * sizeof(float);
  qk_norm_rope_kv_kernel<<<grid, kRopeWarps * 32, smem, stream>>>(p, heads_per_block);
  return cudaGetLastError();
}

cudaError_t silu_mul(const SiluMulParams& p, cudaStream_t stream) {
  if (p.num_tokens == 0) return cudaSuccess;
  silu_mul_kernel<<<p.num_tokens, 256, 0, stream>>>(p);
  return cudaGetLastError();
}

cudaError_t cast_to_bf16(const CastToBf16Params& p, cudaStream_t stream) {
  if (p.n == 0) return cudaSuccess;
  const int64_t blocks = std::min<int64_t>((p.n + 255) / 256, 4096);
  cast_to_bf16_kernel<<<static_cast<int>(blocks), 256, 0, stream>>>(p);
  return cudaGetLastError();
}

cudaError_t widen_rows(const WidenRowsParams& p, cudaStream_t stream) {
  if (p.rows < 0 || p.cols < 0) return cudaErrorInvalidValue;
  if (p.rows == 0 || p.cols == 0) return cudaSuccess;
  widen_rows_kernel<<<p.rows, 256, 0, stream>>>(p);
  return cudaGetLastError();
}

cudaError_t argmax(const ArgmaxParams& p, cudaStream_t stream) {
  if (p.num_rows == 0) return cudaSuccess;
  argmax_kernel<<<p.num_rows, 1024, 0, stream>>>(p);
  return cudaGetLastError();
}

cudaError_t gather_rows(const GatherRowsParams& p, cudaStream_t stream) {
  if (p.row_bytes % 4 != 0 || p.rows < 0) return cudaErrorInvalidValue;
  if (p.rows == 0 || p.row_bytes == 0) return cudaSuccess;
  constexpr int kThreads = 256, kRowsPerBlock = kThreads / 32;
  const auto blocks = static_cast<unsigned>((p.rows + kRowsPerBlock - 1) / kRowsPerBlock);
  const bool wide = p.row_bytes % 16 == 0 && reinterpret_cast<uintptr_t>(p.src) % 16 == 0 &&
                    reinterpret_cast<uintptr_t>(p.dst) % 16 == 0;
  if (wide) {
    gather_rows_kernel<uint4><<<blocks, kThreads, 0, stream>>>(p);
  } else {
    gather_rows_kernel<uint32_t><<<blocks, kThreads, 0, stream>>>(p);
  }
  return cudaGetLastError();
}

}  // namespace moe::ops::cuda
