// Work items of the persistent grouped GEMM kernels (grouped_gemm_wgmma.cu,
// grouped_gemm_fp8.cu): item i is row tile i / num_n_tiles (up to
// kGroupedGemmTileRows permuted rows of one expert) and column tile
// i % num_n_tiles.
#pragma once

#include <cstdint>

#include "ops/cuda/kernels.h"

namespace moe::ops::cuda {

struct GemmItem {
  int expert, row0, rows, n0;
};

// The row tile's expert is the last e with tile_offsets[e] <= tile.
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
  item.row0 = expert_offsets[lo] + (tile - tile_offsets[lo]) * kGroupedGemmTileRows;
  item.rows = min(kGroupedGemmTileRows, expert_offsets[lo + 1] - item.row0);
  item.n0 = (index % num_n_tiles) * columns_per_tile;
  return item;
}

}  // namespace moe::ops::cuda
