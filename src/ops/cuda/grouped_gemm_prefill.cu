// The MoE grouped GEMMs at prefill sizes -- hundreds of permuted rows per
// expert, where the tensor cores rather than the weight bytes set the time --
// in bf16 and in FP8 block scaling, on Hopper's warpgroup MMA. Same contracts
// as wgmma_grouped_gemm and fp8_grouped_gemm (kernels.h), except that a row
// tile holds kPrefillGemmTileRows = 128 rows: moe_permute must count
// tile_offsets with that tile_rows.
//
// Algorithm: a persistent grid walks items of (128 permuted rows of one
// expert) x (weight rows: 256 in bf16, 128 in FP8; gate_up takes half gate and
// half matching up rows, so SiLU-multiply runs on the accumulators). Three
// warpgroups share a ring of shared-memory stages, each holding 128 bytes of
// every row along K:
//   - the producer (warpgroup 0, registers handed down to 56) loads the
//     weight rows with the bulk tensor copy engine (two boxes, 128-byte
//     swizzle) and the 128 activation rows with cp.async, gathered through
//     sorted_token for gate_up (warp w copies rows 32 w.., 8 lanes per
//     128-byte row segment so the reads coalesce), plus the FP8 scales;
//   - two consumers (warpgroups 1, 2, registers raised to 224) each multiply
//     64 of the rows by all the stage's weight rows with wgmma from shared
//     memory. bf16: one m64n256 accumulator; a stage is freed once the MMAs of
//     the next one are issued (wait_group 1), so the tensor cores never wait
//     on the consumer. FP8: per 128-wide K block (one scale block) the MMAs go
//     into a partial m64n128 accumulator that is added to the running one
//     times (activation scale x weight scale), as in fp8_grouped_gemm; the two
//     consumers' promotions run under each other's MMAs.
// Consecutive items are the column tiles of one row tile, and the row tiles of
// an expert follow each other, so the grid's concurrent items share their
// activation rows and expert weights in L2.
//
// Floor (Qwen3-235B, 128 experts, hidden 4096, moe_intermediate 1536, 375 rows
// per expert = 6000 tokens x top-8): 2 x 48000 x 4096 x 4608 = 1.81 TFLOP per
// layer, 2.3 ms at the ~790 TFLOP/s dense bf16 rate and 1.15 ms at FP8's
// twice that; the weights (4.8 GB bf16, 2.4 GB FP8) stream in 1.1 / 0.6 ms,
// so both are compute-bound when L2 serves an expert's weights to all of its
// row tiles.
#include <algorithm>
#include <cstdint>

#include "ops/cuda/grouped_gemm.cuh"
#include "ops/cuda/kernels.h"
#include "ops/cuda/tensor_map.h"
#include "ops/cuda/wgmma.cuh"

namespace moe::ops::cuda {
namespace {

constexpr int kM = kPrefillGemmTileRows;  // two consumer warpgroups of 64 rows
static_assert(kM == 128, "two wgmma row blocks per tile");
constexpr int kThreads = 384;
[[maybe_unused]] constexpr int kProducerThreads = 128;

template <bool kFp8>
struct Tile {
  static constexpr int kWeightRows = kFp8 ? 128 : 256;  // per item
  static constexpr int kKStep = kFp8 ? 128 : 64;        // elements per stage: 128 bytes of each row
  static constexpr int kBoxRows = kWeightRows / 2;      // the weight rows arrive as two boxes
  static constexpr int kStages = kFp8 ? 6 : 4;
  static constexpr int kABytes = kM * 128, kBBytes = kWeightRows * 128;
  static constexpr int kScaleBytes = kFp8 ? 1024 : 0;   // 128 activation + 2 weight scales, padded
  static constexpr int kStageBytes = kABytes + kBBytes + kScaleBytes;
  static constexpr int kBarrierBase = kStages * kStageBytes;
  static constexpr int kSmemBytes = kBarrierBase + 2 * kStages * 8 + 1024;  // + alignment slack
  static_assert(kStageBytes % 1024 == 0, "stages keep the swizzle atoms 1024-aligned");
};

struct PrefillArgs {
  const void* a;                // bf16 or E4M3 rows of K elements
  const float* a_scales;        // FP8: [.., scale_cols]
  const int32_t* sorted_token;  // gate_up only
  const float* w_scales;        // FP8: [num_experts, blocks per expert, scale_cols]
  const int32_t* expert_offsets;
  const int32_t* tile_offsets;
  void* out;
  int N, K, num_experts, num_n_tiles;
  int scale_cols;       // ceil(K / 128)
  int gate_block_rows;  // gate_up: ceil(N / 128), where the up half's scale block rows start
};

template <bool kFp8, bool kGateUp>
__global__ void __launch_bounds__(kThreads, 1)
    prefill_grouped_gemm_kernel(const __grid_constant__ CUtensorMap weights, PrefillArgs p) {
#if MOE_SM90A_DEVICE
  using T = Tile<kFp8>;
  constexpr int kElementBytes = kFp8 ? 1 : 2;
  constexpr int kColumnsPerTile = kGateUp ? T::kWeightRows / 2 : T::kWeightRows;
  const int num_items = p.tile_offsets[p.num_experts] * p.num_n_tiles;
  const int num_k_steps = (p.K + T::kKStep - 1) / T::kKStep;
  extern __shared__ unsigned char smem_raw[];
  const uint32_t smem = (smem_u32(smem_raw) + 1023) & ~1023u;  // swizzle atoms are 1024-aligned
  auto a_tile = [&](int stage) { return smem + stage * T::kStageBytes; };
  auto b_tile = [&](int stage) { return a_tile(stage) + T::kABytes; };
  auto scale_tile = [&](int stage) { return b_tile(stage) + T::kBBytes; };  // FP8: [128] activation, [2] weight
  auto full = [&](int stage) { return smem + T::kBarrierBase + stage * 8; };
  auto empty = [&](int stage) { return smem + T::kBarrierBase + (T::kStages + stage) * 8; };
  const int warp_id = threadIdx.x >> 5, lane = threadIdx.x & 31;
  if (threadIdx.x == 0) {
    for (int s = 0; s < T::kStages; ++s) {
      mbarrier_init(full(s), 1 + kProducerThreads);  // the expect-tx arrival + every producer thread's cp.async
      mbarrier_init(empty(s), 8);                    // one per consumer warp
    }
  }
  __syncthreads();

  if (warp_id < 4) {
    setmaxnreg_dec<56>();
    // Producer: thread t owns row t of the A tile (its source row, its activation scale).
    const auto* a_bytes = static_cast<const unsigned char*>(p.a);
    const int64_t row_bytes = static_cast<int64_t>(p.K) * kElementBytes;
    int step = 0;
    for (int index = blockIdx.x; index < num_items; index += gridDim.x) {
      const GemmItem item = grouped_gemm_item<kM>(p.expert_offsets, p.tile_offsets, p.num_experts, index,
                                                  p.num_n_tiles, kColumnsPerTile);
      const int own = threadIdx.x;
      const int64_t source = own >= item.rows ? -1 : kGateUp ? p.sorted_token[item.row0 + own] : item.row0 + own;
      const int y0 = item.expert * (kGateUp ? 2 * p.N : p.N) + item.n0;
      const int y1 = kGateUp ? y0 + p.N : y0 + T::kBoxRows;
      int64_t w_scale_row = 0;  // FP8: thread 0 copies the first block's scale, thread 1 the second's
      if constexpr (kFp8) {
        const int blocks_per_expert = kGateUp ? 2 * p.gate_block_rows : (p.N + 127) / 128;
        w_scale_row = static_cast<int64_t>(item.expert) * blocks_per_expert + item.n0 / 128 +
                      (kGateUp && own == 1 ? p.gate_block_rows : 0);
      }
      for (int ks = 0; ks < num_k_steps; ++ks, ++step) {
        const int stage = step % T::kStages;
        if (step >= T::kStages) mbarrier_wait(empty(stage), ((step / T::kStages) - 1) & 1);
        if (own == 0) {
          mbarrier_arrive_expect_tx(full(stage), T::kBBytes);
          tma_load_2d(b_tile(stage), &weights, ks * T::kKStep, y0, full(stage));
          tma_load_2d(b_tile(stage) + T::kBBytes / 2, &weights, ks * T::kKStep, y1, full(stage));
        }
#pragma unroll
        for (int i = 0; i < 8; ++i) {
          const int r = 4 * i + (lane >> 3), chunk = lane & 7, column = ks * 128 + chunk * 16;
          const int64_t row = __shfl_sync(0xffffffffu, source, r);
          const bool valid = row >= 0 && column < row_bytes;
          cp_async_16(a_tile(stage) + sw128_offset(32 * warp_id + r, chunk), valid ? a_bytes + row * row_bytes + column : a_bytes,
                      valid);
        }
        if constexpr (kFp8) {
          cp_async_4(scale_tile(stage) + own * 4, p.a_scales + (source >= 0 ? source * p.scale_cols + ks : 0), source >= 0);
          if (own < 2) cp_async_4(scale_tile(stage) + (128 + own) * 4, p.w_scales + w_scale_row * p.scale_cols + ks, true);
        }
        mbarrier_arrive_cp_async(full(stage));
      }
    }
    cp_async_wait_group<0>();
    return;
  }

  setmaxnreg_inc<224>();
  // Consumer c: rows 64 c + 16 w + g (+ 8) of the tile; accumulator column 8 i + 2 q (+ 1) is weight row 8 i + 2 q (+ 1).
  const int consumer = (warp_id >> 2) - 1, warp = warp_id & 3, g = lane >> 2, q = lane & 3;
  const uint32_t a_offset = consumer * 64 * 128;
  int step = 0;
  if constexpr (!kFp8) {
    float acc[128];
    for (int index = blockIdx.x; index < num_items; index += gridDim.x) {
      const GemmItem item = grouped_gemm_item<kM>(p.expert_offsets, p.tile_offsets, p.num_experts, index,
                                                  p.num_n_tiles, kColumnsPerTile);
      for (int ks = 0; ks < num_k_steps; ++ks, ++step) {
        const int stage = step % T::kStages;
        mbarrier_wait(full(stage), (step / T::kStages) & 1);
        fence_proxy_async_shared();  // the A rows came through cp.async (generic proxy)
        wgmma_fence();
#pragma unroll
        for (int kk = 0; kk < 4; ++kk)
          wgmma_m64n256k16_ss(acc, sw128_descriptor(a_tile(stage) + a_offset + kk * 32, 16, 1024),
                              sw128_descriptor(b_tile(stage) + kk * 32, 16, 1024), ks > 0 || kk > 0);
        wgmma_commit_group();
        wgmma_wait_group<1>();  // the previous stage's MMAs are done: free it
        if (ks > 0 && lane == 0) mbarrier_arrive(empty((step - 1) % T::kStages));
      }
      wgmma_wait_group<0>();
      if (lane == 0) mbarrier_arrive(empty((step - 1) % T::kStages));
#pragma unroll
      for (int h = 0; h < 2; ++h) {
        const int r = consumer * 64 + warp * 16 + g + 8 * h;
        if (r >= item.rows) continue;
        if constexpr (kGateUp) {
          store_silu_mul_row<16>(static_cast<bf16*>(p.out) + static_cast<int64_t>(item.row0 + r) * p.N, acc, item.n0,
                                 p.N, h, q);
        } else {
          store_f32_row(static_cast<float*>(p.out) + static_cast<int64_t>(item.row0 + r) * p.N, acc, item.n0, p.N, h,
                        q);
        }
      }
    }
  } else {
    float acc[64], part[64];
    for (int index = blockIdx.x; index < num_items; index += gridDim.x) {
      const GemmItem item = grouped_gemm_item<kM>(p.expert_offsets, p.tile_offsets, p.num_experts, index,
                                                  p.num_n_tiles, kColumnsPerTile);
#pragma unroll
      for (int i = 0; i < 64; ++i) acc[i] = 0.0f;
      for (int ks = 0; ks < num_k_steps; ++ks, ++step) {
        const int stage = step % T::kStages;
        mbarrier_wait(full(stage), (step / T::kStages) & 1);
        fence_proxy_async_shared();
        wgmma_fence();
#pragma unroll
        for (int kk = 0; kk < 4; ++kk)
          wgmma_m64n128k32_e4m3_ss(part, sw128_descriptor(a_tile(stage) + a_offset + kk * 32, 16, 1024),
                                   sw128_descriptor(b_tile(stage) + kk * 32, 16, 1024), kk > 0);
        wgmma_commit_group();
        wgmma_wait_group<0>();
        const float* scales = reinterpret_cast<const float*>(smem_raw + (scale_tile(stage) - smem_u32(smem_raw)));
        float row_scale[2][2];  // [row half][weight block: columns < 64 or >= 64]
#pragma unroll
        for (int h = 0; h < 2; ++h) {
          const float a_scale = scales[consumer * 64 + warp * 16 + g + 8 * h];
          row_scale[h][0] = a_scale * scales[128];
          row_scale[h][1] = a_scale * scales[129];
        }
        if (lane == 0) mbarrier_arrive(empty(stage));
#pragma unroll
        for (int i = 0; i < 64; ++i) acc[i] += part[i] * row_scale[(i >> 1) & 1][i >= 32];
      }
#pragma unroll
      for (int h = 0; h < 2; ++h) {
        const int r = consumer * 64 + warp * 16 + g + 8 * h;
        if (r >= item.rows) continue;
        if constexpr (kGateUp) {
          store_silu_mul_row<8>(static_cast<bf16*>(p.out) + static_cast<int64_t>(item.row0 + r) * p.N, acc, item.n0,
                                p.N, h, q);
        } else {
          store_f32_row(static_cast<float*>(p.out) + static_cast<int64_t>(item.row0 + r) * p.N, acc, item.n0, p.N, h,
                        q);
        }
      }
    }
  }
#endif
}

template <bool kFp8>
cudaError_t launch_prefill_gemm(const PrefillArgs& args, const void* w, int max_tiles, bool gate_up,
                                cudaStream_t stream) {
  using T = Tile<kFp8>;
  if (!hopper_kernels_available()) return cudaErrorNotSupported;
  if (args.K % (kFp8 ? 16 : 8) != 0) return cudaErrorInvalidValue;
  if (max_tiles == 0) return cudaSuccess;
  const int element_bytes = kFp8 ? 1 : 2;
  const uint64_t weight_rows = static_cast<uint64_t>(args.num_experts) * (gate_up ? 2 * args.N : args.N);
  CUtensorMap map;
  cudaError_t error = make_tensor_map_2d(&map, w, element_bytes, weight_rows, args.K,
                                         static_cast<uint64_t>(args.K) * element_bytes, T::kBoxRows, T::kKStep);
  if (error != cudaSuccess) return error;
  auto kernel = gate_up ? prefill_grouped_gemm_kernel<kFp8, true> : prefill_grouped_gemm_kernel<kFp8, false>;
  error = cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, T::kSmemBytes);
  if (error != cudaSuccess) return error;
  const int blocks = std::min(multiprocessor_count(), args.num_n_tiles * max_tiles);
  kernel<<<blocks, kThreads, T::kSmemBytes, stream>>>(map, args);
  return cudaGetLastError();
}

int num_n_tiles(int N, bool gate_up, int weight_rows) {
  const int columns = gate_up ? weight_rows / 2 : weight_rows;
  return (N + columns - 1) / columns;
}

}  // namespace

int moe_tile_rows(int64_t rows, int num_experts) {
  return hopper_kernels_available() && rows >= int64_t{64} * num_experts ? kPrefillGemmTileRows : kGroupedGemmTileRows;
}

cudaError_t wgmma_grouped_gemm_prefill(const GroupedGemmParams& p, cudaStream_t stream) {
  const PrefillArgs args{p.a,     nullptr, p.sorted_token, nullptr, p.expert_offsets, p.tile_offsets,
                         p.out,   p.N,     p.K,            p.num_experts,
                         num_n_tiles(p.N, p.gate_up, Tile<false>::kWeightRows), 0, 0};
  return launch_prefill_gemm<false>(args, p.w, p.max_tiles, p.gate_up, stream);
}

cudaError_t fp8_grouped_gemm_prefill(const Fp8GroupedGemmParams& p, cudaStream_t stream) {
  if (p.k_splits != 1) return cudaErrorInvalidValue;
  const PrefillArgs args{p.a,     p.a_scales, p.sorted_token, p.w_scales, p.expert_offsets, p.tile_offsets,
                         p.out,   p.N,        p.K,            p.num_experts,
                         num_n_tiles(p.N, p.gate_up, Tile<true>::kWeightRows), (p.K + 127) / 128, (p.N + 127) / 128};
  return launch_prefill_gemm<true>(args, p.w, p.max_tiles, p.gate_up, stream);
}

}  // namespace moe::ops::cuda
