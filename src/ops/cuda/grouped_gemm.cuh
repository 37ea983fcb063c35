// Work items of the persistent grouped GEMM kernels (grouped_gemm_wgmma.cu,
// grouped_gemm_fp8.cu, grouped_gemm_prefill.cu): item i is row tile
// i / num_n_tiles (up to kTileRows permuted rows of one expert, the tile_rows
// moe_permute counted tile_offsets with) and column tile i % num_n_tiles.
#pragma once

#include <cstdint>
#include <cuda_bf16.h>

#include "ops/cuda/kernels.h"

namespace moe::ops::cuda {

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
// are dropped.
//
// gate_up: kChunks chunks of gate columns, then kChunks of the matching up
// columns; out_row[n] = bf16(silu(gate) * up).
template <int kChunks, int kSize>
__device__ __forceinline__ void store_silu_mul_row(bf16* out_row, const float (&acc)[kSize], int n_base, int N, int h,
                                                   int q) {
  static_assert(kSize == 8 * kChunks, "gate and up chunks fill the accumulator");
#pragma unroll
  for (int i = 0; i < kChunks; ++i) {
    const int n = n_base + 8 * i + 2 * q;
    float v[2];
#pragma unroll
    for (int j = 0; j < 2; ++j) {
      const float gate = acc[4 * i + 2 * h + j], up = acc[4 * (i + kChunks) + 2 * h + j];
      // Fast division (2 ulp, far below bf16's rounding): the IEEE one calls a
      // slow-path subroutine that took a fifth of the FP8 prefill kernel's
      // consumer time (profiled on an H200).
      v[j] = __fdividef(gate, 1.0f + __expf(-gate)) * up;
    }
    if (n + 1 < N) {
      *reinterpret_cast<__nv_bfloat162*>(out_row + n) = __floats2bfloat162_rn(v[0], v[1]);
    } else if (n < N) {
      out_row[n] = __float2bfloat16(v[0]);
    }
  }
}

// down: out_row[n] = acc (f32), kSize / 4 chunks of 8 columns.
template <int kSize>
__device__ __forceinline__ void store_f32_row(float* out_row, const float (&acc)[kSize], int n_base, int N, int h,
                                              int q) {
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

// As store_f32_row, adding into out_row (atomically: split-K items of one tile
// add their shares into an output zeroed beforehand).
template <int kSize>
__device__ __forceinline__ void add_f32_row(float* out_row, const float (&acc)[kSize], int n_base, int N, int h,
                                            int q) {
#pragma unroll
  for (int i = 0; i < kSize / 4; ++i) {
    const int n = n_base + 8 * i + 2 * q;
    if (n < N) atomicAdd(out_row + n, acc[4 * i + 2 * h]);
    if (n + 1 < N) atomicAdd(out_row + n + 1, acc[4 * i + 2 * h + 1]);
  }
}

}  // namespace moe::ops::cuda
