// Work items of the persistent grouped GEMM kernels (grouped_gemm_wgmma.cu,
// grouped_gemm_fp8.cu, grouped_gemm_prefill.cu): item i is row tile
// i / num_n_tiles (up to kTileRows permuted rows of one expert, the tile_rows
// moe_permute counted tile_offsets with) and column tile i % num_n_tiles.
#pragma once

#include <cstdint>
#include <cuda_bf16.h>
#include <cuda_fp8.h>

#include "ops/cuda/common.cuh"
#include "ops/cuda/kernels.h"

namespace moe::ops::cuda {

// Lets `kernel` launch with up to `bytes` of dynamic shared memory. The
// kernels' sizes depend on the expert count, and each launch used to set the
// attribute to its own size: two host threads launching one kernel with
// different counts (EP ranks as threads of one process, or an MoE GEMM and a
// dense projection as one group) could set a smaller size between the other's
// set and launch, which then failed with cudaErrorLaunchOutOfResources
// (parallel_cuda_test, twice on an H200). So the attribute is always the
// device's opt-in maximum, the same whoever sets it.
template <typename Kernel>
cudaError_t allow_dynamic_smem(Kernel* kernel, int bytes) {
  static const int device_max = [] {
    int device = 0, n = 0;
    cudaGetDevice(&device);
    cudaDeviceGetAttribute(&n, cudaDevAttrMaxSharedMemoryPerBlockOptin, device);
    return n;
  }();
  cudaFuncAttributes attributes{};
  cudaError_t error = cudaFuncGetAttributes(&attributes, kernel);
  if (error != cudaSuccess) return error;
  const int limit = device_max - static_cast<int>(attributes.sharedSizeBytes);
  if (bytes > limit) return cudaErrorInvalidValue;
  return cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, limit);
}

struct GemmItem {
  int expert, row0, rows, n0;
};

// The row tile's expert is the last e with tile_offsets[e] <= tile.
template <int kTileRows = kGroupedGemmTileRows>
__device__ __forceinline__ GemmItem grouped_gemm_item(const int32_t* expert_offsets, const int32_t* tile_offsets,
                                                      int num_experts, int index, int num_n_tiles,
                                                      int columns_per_tile) {
  const int tile = index / num_n_tiles;
  int lo = 0, hi = num_experts - 1;
  while (lo < hi) {
    const int mid = (lo + hi + 1) / 2;
    if (tile_offsets[mid] <= tile) lo = mid; else hi = mid - 1;
  }
  GemmItem item;
  item.expert = lo;
  item.row0 = expert_offsets[lo] + (tile - tile_offsets[lo]) * kTileRows;
  item.rows = min(kTileRows, expert_offsets[lo + 1] - item.row0);
  item.n0 = (index % num_n_tiles) * columns_per_tile;
  return item;
}

// The offsets the item lookups search, copied to shared memory once per CTA
// (by all its threads, before its first barrier): from global memory the
// binary search's loads missed L1 under the kernels' scale copies and took
// 30% of the FP8 prefill down GEMM's consumer time (profiled on an H200).
// `dst` holds offsets_smem_bytes(num_experts).
struct ItemOffsets {
  const int32_t* expert_offsets;
  const int32_t* tile_offsets;
};
inline constexpr int offsets_smem_bytes(int num_experts) { return 2 * (num_experts + 1) * 4; }
__device__ __forceinline__ ItemOffsets copy_item_offsets(int32_t* dst, const int32_t* expert_offsets,
                                                         const int32_t* tile_offsets, int num_experts) {
  for (int e = threadIdx.x; e <= num_experts; e += blockDim.x) {
    dst[e] = expert_offsets[e];
    dst[num_experts + 1 + e] = tile_offsets[e];
  }
  return {dst, dst + num_experts + 1};
}

// Epilogues for one accumulator row half h (0: row g, 1: row g + 8) of a
// consumer thread with lane quad position q, in the wgmma accumulator layout
// (acc[4 i + 2 h + j] is column 8 i + 2 q + j). Columns n_base + ... past N
// are dropped, and so is the row where `live` is false (past the item's
// rows). Every lane of the warp calls them, live or not: the bf16 stores
// shuffle within quads with the whole warp's mask. (With a mask of the
// quad's lanes, because lanes past the rows skipped the call, ptxas checked
// convergence before every shuffle with MATCH.ANY and REDUX: 40-60% of the
// FP8 prefill down GEMM's epilogue, and the epilogue 22% of its consumers'
// time; H200 profile, 2026-12-02.) The quad helpers they share with the
// attention kernels (quad_transpose, store_fp8_group_quad) are in common.cuh.

// Stores the bf16 pairs of chunks 4j .. 4j + 3 (pair[k]: columns 8 (4j + k)
// + 2q, + 1 of this thread). With N a multiple of 8, the quad first
// transposes them (two xor-shuffle steps), so thread q writes chunk 4j + q's
// 8 columns with one 16-byte store and a quad's row fills two 32-byte sectors
// per store; pairs of 4 bytes left half-written sectors, and down GEMMs of
// bf16 rows so ran up to 8% slower than with f32 rows (measured on an H200,
// FP8 prefill at 375 rows per expert).
__device__ __forceinline__ void store_bf16_chunks(bf16* out_row, uint32_t (&pair)[4], int j, int n_base,
                                                  int N, int q, bool live) {
  if (N % 8 == 0) {
    quad_transpose(pair, q);
    // pair[k] now holds columns 2k, 2k + 1 of chunk 4j + q.
    const int n = n_base + 8 * (4 * j + q);
    if (!live) return;
    if (n + 8 <= N) {
      *reinterpret_cast<uint4*>(out_row + n) = make_uint4(pair[0], pair[1], pair[2], pair[3]);
    } else {
#pragma unroll
      for (int k = 0; k < 4; ++k)
        if (n + 2 * k < N) *reinterpret_cast<uint32_t*>(out_row + n + 2 * k) = pair[k];
    }
    return;
  }
  if (!live) return;
#pragma unroll
  for (int k = 0; k < 4; ++k) {
    const int n = n_base + 8 * (4 * j + k) + 2 * q;
    const __nv_bfloat162 v = *reinterpret_cast<const __nv_bfloat162*>(&pair[k]);
    if (n + 1 < N) {
      *reinterpret_cast<__nv_bfloat162*>(out_row + n) = v;
    } else if (n < N) {
      out_row[n] = v.x;
    }
  }
}

__device__ __forceinline__ uint32_t bf16_pair(float lo, float hi) {
  const __nv_bfloat162 v = __floats2bfloat162_rn(lo, hi);
  return *reinterpret_cast<const uint32_t*>(&v);
}

// silu(gate) * up. e^-gate as __expf computes it (ex2.approx of -gate x
// log2 e) but flushing results below 2^-126 to zero, which 1 + e rounds away
// anyway: the same bits, without __expf's three instructions that keep such
// results. Fast division (2 ulp, far below bf16's rounding): the IEEE one
// calls a slow-path subroutine that took a fifth of the FP8 prefill kernel's
// consumer time (profiled on an H200).
__device__ __forceinline__ float swiglu(float gate, float up) {
  float e;
  asm("ex2.approx.ftz.f32 %0, %1;" : "=f"(e) : "f"(gate * -1.4426950408889634f));
  return __fdividef(gate, 1.0f + e) * up;
}

// Two swiglu values rounded to bf16 in one conversion: the values the E4M3
// gate_up epilogues quantize (those quantize_fp8_groups would quantize from
// the bf16 rows).
__device__ __forceinline__ float2 swiglu_bf16x2(float gate0, float up0, float gate1, float up1) {
  return __bfloat1622float2(__floats2bfloat162_rn(swiglu(gate0, up0), swiglu(gate1, up1)));
}

// gate_up: kChunks chunks of gate columns, then kChunks of the matching up
// columns; out_row[n] = bf16(silu(gate) * up).
template <int kChunks, int kSize>
__device__ __forceinline__ void store_silu_mul_row(bf16* out_row, const float (&acc)[kSize], int n_base, int N, int h,
                                                   int q, bool live) {
  static_assert(kSize == 8 * kChunks, "gate and up chunks fill the accumulator");
  static_assert(kChunks % 4 == 0, "chunks go out four at a time");
#pragma unroll
  for (int j = 0; j < kChunks / 4; ++j) {
    uint32_t pair[4];
#pragma unroll
    for (int k = 0; k < 4; ++k) {
      const int i = 4 * j + k;
      float v[2];
#pragma unroll
      for (int c = 0; c < 2; ++c) {
        v[c] = swiglu(acc[4 * i + 2 * h + c], acc[4 * (i + kChunks) + 2 * h + c]);
      }
      pair[k] = bf16_pair(v[0], v[1]);
    }
    store_bf16_chunks(out_row, pair, j, n_base, N, q, live);
  }
}

// gate_up's epilogue straight into the down GEMM's input: 128 output columns
// of the thread's rows (n_base a multiple of 128: one quantization group) as
// store_silu_mul_row<16> computes them, rounded to bf16, then quantized by
// store_fp8_group_quad (the bytes quantize_fp8_groups makes of the bf16
// rows); columns >= N count as zero (N % 16 == 0).
__device__ __forceinline__ void store_silu_mul_fp8_row(uint8_t* out_row, float* scale_out, const float (&acc)[128],
                                                       int n_base, int N, int h, int q, bool live) {
  float v[32];
#pragma unroll
  for (int i = 0; i < 16; ++i) {
    const int a = 4 * i + 2 * h, b = 4 * (i + 16) + 2 * h, n = n_base + 8 * i + 2 * q;
    const float2 x = swiglu_bf16x2(acc[a], acc[b], acc[a + 1], acc[b + 1]);
    v[2 * i] = n < N ? x.x : 0.0f;
    v[2 * i + 1] = n + 1 < N ? x.y : 0.0f;
  }
  store_fp8_group_quad(out_row + n_base, scale_out, v, N - n_base, q, live);
}

// down: out_row[n] = acc (f32), kSize / 4 chunks of 8 columns.
template <int kSize>
__device__ __forceinline__ void store_f32_row(float* out_row, const float (&acc)[kSize], int n_base, int N, int h,
                                              int q, bool live) {
  if (!live) return;
#pragma unroll
  for (int i = 0; i < kSize / 4; ++i) {
    const int n = n_base + 8 * i + 2 * q;
    if (n + 1 < N) {
      *reinterpret_cast<float2*>(out_row + n) = make_float2(acc[4 * i + 2 * h], acc[4 * i + 2 * h + 1]);
    } else if (n < N) {
      out_row[n] = acc[4 * i + 2 * h];
    }
  }
}

// down with bf16_out: out_row[n] = bf16(acc), as store_f32_row.
template <int kSize>
__device__ __forceinline__ void store_bf16_row(bf16* out_row, const float (&acc)[kSize], int n_base, int N,
                                               int h, int q, bool live) {
  static_assert(kSize % 16 == 0, "chunks go out four at a time");
#pragma unroll
  for (int j = 0; j < kSize / 16; ++j) {
    uint32_t pair[4];
#pragma unroll
    for (int k = 0; k < 4; ++k)
      pair[k] = bf16_pair(acc[4 * (4 * j + k) + 2 * h], acc[4 * (4 * j + k) + 2 * h + 1]);
    store_bf16_chunks(out_row, pair, j, n_base, N, q, live);
  }
}

// down: output row `row` (of N columns) in f32 or, with bf16_out, bf16.
template <int kSize>
__device__ __forceinline__ void store_down_row(void* out, bool bf16_out, int64_t row, int N,
                                               const float (&acc)[kSize], int n_base, int h, int q, bool live) {
  if (bf16_out) {
    store_bf16_row(static_cast<bf16*>(out) + row * N, acc, n_base, N, h, q, live);
  } else {
    store_f32_row(static_cast<float*>(out) + row * N, acc, n_base, N, h, q, live);
  }
}

// As store_f32_row, adding into out_row (atomically: split-K items of one tile
// add their shares into an output zeroed beforehand). With N a multiple of 4
// the quad transposes its chunks as store_bf16_chunks does and adds 16 bytes
// per atomic, a quarter of the atomic operations: the FP8 attention
// projections at batch 64 (~2M adds each) went from 22-24 to 20 us (H200,
// ncu, 2026-12-01).
template <int kSize>
__device__ __forceinline__ void add_f32_row(float* out_row, const float (&acc)[kSize], int n_base, int N, int h,
                                            int q, bool live) {
#if __CUDA_ARCH__ >= 900
  static_assert(kSize % 16 == 0, "chunks go out four at a time");
  if (N % 4 == 0) {
#pragma unroll
    for (int j = 0; j < kSize / 16; ++j) {
      uint32_t lo[4], hi[4];  // columns 8 (4j + k) + 2q, + 1
#pragma unroll
      for (int k = 0; k < 4; ++k) {
        lo[k] = __float_as_uint(acc[4 * (4 * j + k) + 2 * h]);
        hi[k] = __float_as_uint(acc[4 * (4 * j + k) + 2 * h + 1]);
      }
      quad_transpose(lo, q);
      quad_transpose(hi, q);
      // lo[k], hi[k]: columns 2k, 2k + 1 of chunk 4j + q.
      const int n = n_base + 8 * (4 * j + q);
      if (!live) continue;
      if (n + 8 <= N) {
        atomicAdd(reinterpret_cast<float4*>(out_row + n),
                  make_float4(__uint_as_float(lo[0]), __uint_as_float(hi[0]), __uint_as_float(lo[1]),
                              __uint_as_float(hi[1])));
        atomicAdd(reinterpret_cast<float4*>(out_row + n + 4),
                  make_float4(__uint_as_float(lo[2]), __uint_as_float(hi[2]), __uint_as_float(lo[3]),
                              __uint_as_float(hi[3])));
      } else {
#pragma unroll
        for (int k = 0; k < 4; ++k) {
          if (n + 2 * k < N) atomicAdd(out_row + n + 2 * k, __uint_as_float(lo[k]));
          if (n + 2 * k + 1 < N) atomicAdd(out_row + n + 2 * k + 1, __uint_as_float(hi[k]));
        }
      }
    }
    return;
  }
#endif
  if (!live) return;
#pragma unroll
  for (int i = 0; i < kSize / 4; ++i) {
    const int n = n_base + 8 * i + 2 * q;
    if (n < N) atomicAdd(out_row + n, acc[4 * i + 2 * h]);
    if (n + 1 < N) atomicAdd(out_row + n + 1, acc[4 * i + 2 * h + 1]);
  }
}

}  // namespace moe::ops::cuda
