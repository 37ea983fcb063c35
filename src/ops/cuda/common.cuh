// Device helpers shared by the kernels of this folder.
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp8.h>
#include <cstdint>

namespace moe::ops::cuda {

__device__ __forceinline__ float warp_sum(float v) {
#pragma unroll
  for (int offset = 16; offset > 0; offset >>= 1) v += __shfl_xor_sync(0xffffffffu, v, offset);
  return v;
}

__device__ __forceinline__ float warp_max(float v) {
#pragma unroll
  for (int offset = 16; offset > 0; offset >>= 1) v = fmaxf(v, __shfl_xor_sync(0xffffffffu, v, offset));
  return v;
}

// Sum over a block of up to 1024 threads; every thread gets the result.
// `scratch` holds 32 floats of shared memory.
__device__ __forceinline__ float block_sum(float v, float* scratch) {
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, num_warps = (blockDim.x + 31) >> 5;
  v = warp_sum(v);
  __syncthreads();
  if (lane == 0) scratch[warp] = v;
  __syncthreads();
  float total = 0.0f;
  for (int w = 0; w < num_warps; ++w) total += scratch[w];
  return total;
}

// x / scale rounded as the IEEE division, from inv = 1 / scale (itself one
// IEEE division per row): q = x * inv, corrected once with the residual the
// FMA computes exactly (Markstein's theorem). With a division per element
// the fused gate_up epilogue (grouped_gemm.cuh) made the two expert GEMMs
// 2-9% slower from 1 to 64 rows per expert (H200, 2026-12-03). Where x is so small that
// the residual is subnormal the last bit can differ, far below E4M3's
// smallest step: over 2e8 random pairs of the quantizers' range the E4M3
// bytes were the same.
__device__ __forceinline__ float divide_by_scale(float x, float scale, float inv) {
  const float q = __fmul_rn(x, inv);
  const float residual = __fmaf_rn(-q, scale, x);
  return residual == 0.0f ? q : __fmaf_rn(residual, inv, q);  // q keeps the sign of a zero x
}

// Four values of a 1 x 128 quantization group as E4M3 (the first in the low
// byte), divided by scale (inv = 1 / scale) as divide_by_scale does.
__device__ __forceinline__ uint32_t e4m3x4(float a, float b, float c, float d, float scale, float inv) {
  const uint32_t lo = __nv_cvt_float2_to_fp8x2(
      make_float2(divide_by_scale(a, scale, inv), divide_by_scale(b, scale, inv)), __NV_SATFINITE, __NV_E4M3);
  const uint32_t hi = __nv_cvt_float2_to_fp8x2(
      make_float2(divide_by_scale(c, scale, inv), divide_by_scale(d, scale, inv)), __NV_SATFINITE, __NV_E4M3);
  return lo | hi << 16;
}

// A lane quad's exchange: v[k] of quad lane q becomes v[q] of lane k (two
// xor-shuffle steps; every lane of the warp takes part).
__device__ __forceinline__ void quad_transpose(uint32_t (&v)[4], int q) {
#pragma unroll
  for (int bit = 1; bit <= 2; bit <<= 1)
#pragma unroll
    for (int c = 0; c < 4; ++c) {
      if (c & bit) continue;
      const uint32_t got = __shfl_xor_sync(0xffffffffu, (q & bit) ? v[c] : v[c | bit], bit);
      if (q & bit) {
        v[c] = got;
      } else {
        v[c | bit] = got;
      }
    }
}

// A 1 x 128 quantization group of one row held by a lane quad in the wgmma
// accumulator layout: lane q's v[2 i + c] is column 8 i + 2 q + c (i < 16,
// c < 2), the values already rounded to bf16 and zero past the row's end.
// Quantized as quantize_fp8_groups quantizes bf16 rows (scale max(amax,
// 1e-10) / 448, element e4m3(v / scale), so the bytes are the same); after
// two quad transposes lane m stores columns 32 m .. 32 m + 31 of `group`
// with 16-byte stores (those below `columns`, a multiple of 16) and lane 0
// the scale. Every lane of the warp calls it (the shuffles take the whole
// warp's mask); only `live` rows convert and store (at 1 row per expert, 63
// of a GEMM item's 64 are not).
__device__ __forceinline__ void store_fp8_group_quad(uint8_t* group, float* scale_out, const float (&v)[32],
                                                     int columns, int q, bool live) {
  float amax = 0.0f;
#pragma unroll
  for (int i = 0; i < 32; ++i) amax = fmaxf(amax, fabsf(v[i]));
  amax = fmaxf(amax, __shfl_xor_sync(0xffffffffu, amax, 1));
  amax = fmaxf(amax, __shfl_xor_sync(0xffffffffu, amax, 2));
  const float scale = fmaxf(amax, 1e-10f) / 448.0f, inv = 1.0f / scale;
  auto e4m3_pair = [&](int i) -> uint32_t {  // columns 8 i + 2 q (low byte), + 1
    const float2 pair = make_float2(divide_by_scale(v[2 * i], scale, inv), divide_by_scale(v[2 * i + 1], scale, inv));
    return __nv_cvt_float2_to_fp8x2(pair, __NV_SATFINITE, __NV_E4M3);
  };
  // lo[m], hi[m]: chunks 4 m, 4 m + 1 and 4 m + 2, 4 m + 3 (two bytes each);
  // after the transposes lane m holds every lane's pairs of its 4 chunks.
  uint32_t lo[4] = {}, hi[4] = {};
  if (live) {
#pragma unroll
    for (int m = 0; m < 4; ++m) {
      lo[m] = e4m3_pair(4 * m) | e4m3_pair(4 * m + 1) << 16;
      hi[m] = e4m3_pair(4 * m + 2) | e4m3_pair(4 * m + 3) << 16;
    }
  }
  quad_transpose(lo, q);
  quad_transpose(hi, q);
  // Byte 8 k + 2 q' + c of lane m's 32 is chunk 4 m + k's pair from lane q'.
  if (!live || columns <= 0) return;
  const int n = 32 * q;
  if (n + 16 <= columns)
    *reinterpret_cast<uint4*>(group + n) =
        make_uint4(__byte_perm(lo[0], lo[1], 0x5410), __byte_perm(lo[2], lo[3], 0x5410),
                   __byte_perm(lo[0], lo[1], 0x7632), __byte_perm(lo[2], lo[3], 0x7632));
  if (n + 32 <= columns)
    *reinterpret_cast<uint4*>(group + n + 16) =
        make_uint4(__byte_perm(hi[0], hi[1], 0x5410), __byte_perm(hi[2], hi[3], 0x5410),
                   __byte_perm(hi[0], hi[1], 0x7632), __byte_perm(hi[2], hi[3], 0x7632));
  if (q == 0) *scale_out = scale;
}

}  // namespace moe::ops::cuda
