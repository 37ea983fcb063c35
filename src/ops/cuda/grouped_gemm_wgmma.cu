// The MoE grouped GEMM on Hopper's warpgroup MMA (wgmma), bf16 in, f32
// accumulate: the same contract as grouped_gemm (kernels.h), for the decode
// and small-prefill sizes where streaming the expert weights is the cost.
//
// Algorithm: a work item is (row tile of one expert: up to 64 permuted rows,
// 256 weight rows: 128 gate + 128 up rows for gate_up, 256 output columns for
// down). A persistent grid walks the items; per item the K dimension goes
// through shared memory 64 columns at a time, five stages deep. One producer
// warp loads each stage: the weight rows with the bulk tensor copy engine
// (two 128 x 64 boxes, 128-byte swizzle) and the activation rows with cp.async
// (gathered through sorted_token for gate_up), both completing on the stage's
// mbarrier. One consumer warpgroup multiplies with wgmma m64n256k16 from
// shared memory and runs the epilogue (SiLU-multiply into bf16 for gate_up,
// f32 rows for down) while the producer already streams the next item.
//
// Floor: every expert's weights are read once per row tile, so at decode
// sizes (<= 64 rows per expert) the kernel moves the weight bytes at HBM
// bandwidth: 128 experts x (3072 + 1536) x 4096 x 2 bytes = 4.8 GB, 1.13 ms
// at 4.27 TB/s for Qwen3-235B's gate_up + down. The MMAs (at most 64 rows) take
// a quarter of that time at the tensor-core rate.
#include <algorithm>
#include <cstdint>

#include "ops/cuda/grouped_gemm.cuh"
#include "ops/cuda/kernels.h"
#include "ops/cuda/tensor_map.h"
#include "ops/cuda/wgmma.cuh"

namespace moe::ops::cuda {
namespace {

constexpr int kM = kGroupedGemmTileRows, kWeightRows = 256, kKStep = 64, kStages = 5;
constexpr int kThreads = 256;  // warpgroup 0: the producer (warp 0); warpgroup 1: the consumer
constexpr int kABytes = kM * 128, kBBytes = kWeightRows * 128, kStageBytes = kABytes + kBBytes;
constexpr int kBarrierBase = kStages * kStageBytes;
constexpr int kOffsetsBase = kBarrierBase + 2 * kStages * 8;  // then the item offsets (copy_item_offsets)
constexpr int kSmemBytes = kOffsetsBase + 1024;                  // + alignment slack
static_assert(kM == 64, "one wgmma row block per tile");

struct WgmmaGemmParams {
  GroupedGemmParams p;
  int num_n_tiles;
};

[[maybe_unused]] __device__ __forceinline__ GemmItem item_at(const WgmmaGemmParams& args, const ItemOffsets& offsets,
                                                             int index) {
  const GroupedGemmParams& p = args.p;
  return grouped_gemm_item(offsets.expert_offsets, offsets.tile_offsets, p.num_experts, index, args.num_n_tiles,
                           p.gate_up ? kWeightRows / 2 : kWeightRows);
}

template <bool kGateUp>
__global__ void __launch_bounds__(kThreads, 1) wgmma_grouped_gemm_kernel(const __grid_constant__ CUtensorMap weights,
                                                                         WgmmaGemmParams args) {
#if MOE_SM90A_DEVICE
  const GroupedGemmParams& p = args.p;
  const int num_items = p.tile_offsets[p.num_experts] * args.num_n_tiles;
  const int num_k_steps = (p.K + kKStep - 1) / kKStep;
  extern __shared__ unsigned char smem_raw[];
  const uint32_t smem = (smem_u32(smem_raw) + 1023) & ~1023u;  // swizzle atoms are 1024-aligned
  auto a_tile = [&](int stage) { return smem + stage * kStageBytes; };
  auto b_tile = [&](int stage) { return a_tile(stage) + kABytes; };
  auto full = [&](int stage) { return smem + kBarrierBase + stage * 8; };
  auto empty = [&](int stage) { return smem + kBarrierBase + (kStages + stage) * 8; };
  const int warp_id = threadIdx.x >> 5, lane = threadIdx.x & 31;
  const ItemOffsets offsets =
      copy_item_offsets(reinterpret_cast<int32_t*>(smem_raw + (smem + kOffsetsBase - smem_u32(smem_raw))),
                        p.expert_offsets, p.tile_offsets, p.num_experts);
  if (threadIdx.x == 0) {
    for (int s = 0; s < kStages; ++s) {
      mbarrier_init(full(s), 1 + 32);  // the expect-tx arrival + the producer lanes' cp.async arrivals
      mbarrier_init(empty(s), 4);      // one per consumer warp
    }
  }
  __syncthreads();

  if (warp_id < 4) {
    if (warp_id != 0) return;
    // Producer warp. Lane l holds the source rows l and l + 32 of the item's A tile (null: past the tile).
    int step = 0;
    for (int index = blockIdx.x; index < num_items; index += gridDim.x) {
      const GemmItem item = item_at(args, offsets, index);
      const bf16* row_ptr[2];
#pragma unroll
      for (int h = 0; h < 2; ++h) {
        const int r = lane + 32 * h;
        const int64_t source = r >= item.rows ? -1 : kGateUp ? p.sorted_token[item.row0 + r] : item.row0 + r;
        row_ptr[h] = source < 0 ? nullptr : p.a + source * p.K;
      }
      const int y0 = kGateUp ? item.expert * 2 * p.N + item.n0 : item.expert * p.N + item.n0;
      const int y1 = kGateUp ? y0 + p.N : y0 + kWeightRows / 2;
      for (int ks = 0; ks < num_k_steps; ++ks, ++step) {
        const int stage = step % kStages;
        if (step >= kStages) mbarrier_wait(empty(stage), ((step / kStages) - 1) & 1);
        if (lane == 0) {
          mbarrier_arrive_expect_tx(full(stage), kBBytes);
          tma_load_2d(b_tile(stage), &weights, ks * kKStep, y0, full(stage));
          tma_load_2d(b_tile(stage) + kBBytes / 2, &weights, ks * kKStep, y1, full(stage));
        }
#pragma unroll
        for (int i = 0; i < kM * 8 / 32; ++i) {
          const int r = 4 * i + (lane >> 3), chunk = lane & 7, column = ks * kKStep + chunk * 8;
          const bf16* row = reinterpret_cast<const bf16*>(
              __shfl_sync(0xffffffffu, reinterpret_cast<uintptr_t>(row_ptr[i / 8]), r & 31));
          const bool valid = row != nullptr && column < p.K;
          cp_async_16(a_tile(stage) + sw128_offset(r, chunk), valid ? row + column : p.w, valid);
        }
        mbarrier_arrive_cp_async(full(stage));
      }
    }
    cp_async_wait_group<0>();
    return;
  }

  // Consumer warpgroup: rows 16 w + g (+ 8) of the tile, columns 8 i + 2 q (+ 1) of the 256.
  const int warp = warp_id & 3, g = lane >> 2, q = lane & 3;
  float acc[128];
  int step = 0;
  for (int index = blockIdx.x; index < num_items; index += gridDim.x) {
    const GemmItem item = item_at(args, offsets, index);
    for (int ks = 0; ks < num_k_steps; ++ks, ++step) {
      const int stage = step % kStages;
      mbarrier_wait(full(stage), (step / kStages) & 1);
      fence_proxy_async_shared();  // the A rows came through cp.async (generic proxy)
      wgmma_fence();
#pragma unroll
      for (int kk = 0; kk < kKStep / 16; ++kk)
        wgmma_m64n256k16_ss(acc, sw128_descriptor(a_tile(stage) + kk * 32, 16, 1024),
                            sw128_descriptor(b_tile(stage) + kk * 32, 16, 1024), ks > 0 || kk > 0);
      wgmma_commit_group();
      wgmma_wait_group<0>();
      if (lane == 0) mbarrier_arrive(empty(stage));
    }
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      const int r = warp * 16 + g + 8 * h;
      const bool live = r < item.rows;  // every lane calls the stores (they shuffle within quads)
      if constexpr (kGateUp) {
        store_silu_mul_row<16>(static_cast<bf16*>(p.out) + static_cast<int64_t>(item.row0 + r) * p.N, acc, item.n0,
                               p.N, h, q, live);
      } else {
        store_down_row(p.out, p.bf16_out, item.row0 + r, p.N, acc, item.n0, h, q, live);
      }
    }
  }
#endif
}

}  // namespace

cudaError_t wgmma_grouped_gemm(const GroupedGemmParams& p, cudaStream_t stream) {
  if (!hopper_kernels_available()) return cudaErrorNotSupported;
  if (p.K % 8 != 0) return cudaErrorInvalidValue;
  if (p.max_tiles == 0) return cudaSuccess;
  const uint64_t weight_rows = static_cast<uint64_t>(p.num_experts) * (p.gate_up ? 2 * p.N : p.N);
  CUtensorMap map;
  cudaError_t error = make_tensor_map_2d(&map, p.w, 2, weight_rows, p.K, static_cast<uint64_t>(p.K) * 2,
                                              kWeightRows / 2, kKStep);
  if (error != cudaSuccess) return error;
  const int columns_per_tile = p.gate_up ? kWeightRows / 2 : kWeightRows;
  const WgmmaGemmParams args{p, (p.N + columns_per_tile - 1) / columns_per_tile};
  const int num_sms = multiprocessor_count();
  const int blocks = std::min(num_sms, args.num_n_tiles * p.max_tiles);
  auto kernel = p.gate_up ? wgmma_grouped_gemm_kernel<true> : wgmma_grouped_gemm_kernel<false>;
  const int smem_bytes = kSmemBytes + offsets_smem_bytes(p.num_experts);
  error = allow_dynamic_smem(kernel, smem_bytes);
  if (error != cudaSuccess) return error;
  kernel<<<blocks, kThreads, smem_bytes, stream>>>(map, args);
  return cudaGetLastError();
}

}  // namespace moe::ops::cuda
