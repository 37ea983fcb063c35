// The MoE grouped GEMMs at prefill sizes -- hundreds of permuted rows per
// expert, where the tensor cores rather than the weight bytes set the time --
// in bf16 and in FP8 block scaling, on Hopper's warpgroup MMA. Same contracts
// as wgmma_grouped_gemm and fp8_grouped_gemm (kernels.h), except that a row
// tile holds kPrefillGemmTileRows = 128 rows (moe_permute must count
// tile_offsets with that tile_rows) and that gate_up too reads its rows
// contiguous, in permuted order (sorted_token null, a_rows set).
//
// Algorithm: a persistent grid of clusters of two CTAs (one with
// MOE_PREFILL_GEMM_CLUSTER=1; cluster_ctas) walks items
// of (128 permuted rows of one expert) x (a column tile of 256 weight rows
// per CTA; gate_up takes 128 gate and the 128 matching up rows, so
// SiLU-multiply runs on the accumulators). The CTAs of a pair share half
// their operands, loading them with the bulk tensor copy engine (TMA) and
// multicasting them to both: two row tiles of one expert share the weight
// rows (each CTA loads one of the two weight boxes), and an expert's last
// row tile when its count is odd is shared by two column tiles (each CTA
// loads half the rows); a CTA of a pair pulls 2/3 (5/6) of the L2 bytes it
// would alone. In a
// CTA, three warpgroups share a ring of shared-memory stages, each holding
// 128 bytes of every row along K:
//   - the producer (warpgroup 0, registers handed down to 56): one thread
//     issues the TMA copies (its share of the activation rows -- a lone CTA
//     copies only the 32-row quarters that hold an expert's last rows --;
//     the weight rows as two boxes; 128-byte swizzle); FP8: the 128 threads copy the
//     stage's activation and weight scales with cp.async;
//   - two consumers (warpgroups 1, 2, registers raised to 224) each multiply
//     64 of the rows by all the stage's weight rows with wgmma from shared
//     memory. bf16: one m64n256 accumulator; a stage is freed once the MMAs of
//     the next one are issued (wait_group 1), so the tensor cores never wait
//     on the consumer. FP8: per 128-wide K block (one scale block) and half
//     of the weight rows, the MMAs go into a partial m64n128 accumulator,
//     which is then added to the m64n256 sum times (activation scale x
//     weight scale); the other consumer's MMAs run meanwhile.
//   A stage is free once the consumers of every CTA of the cluster are done
//   with it (each consumer warp arrives on the stage's barrier in each, lane
//   c on CTA c's in one instruction), since the peers' multicasts write it
//   too.
// bf16: an expert's last row tile when it holds at most 64 rows is "split":
// both consumers multiply those rows, each by half the weight rows (so their
// SiLU-multiply stays in its registers), instead of consumer 1 idling through
// the item (2% at 256 rows per expert with random routing); FP8 does not
// split, as its split path's code cost the unrolled K loop more than split
// items gained.
// The activation rows must be contiguous (rows of `a` in permuted order): a
// gate_up caller gathers them first (gather_rows). Consecutive items are the
// column tiles of one row tile, and the row tiles of an expert follow each
// other, so the grid's concurrent items share their activation rows and
// expert weights in L2.
//
// Floor (Qwen3-235B, 128 experts, hidden 4096, moe_intermediate 1536, 375 rows
// per expert = 6000 tokens x top-8): 2 x 48000 x 4096 x 4608 = 1.81 TFLOP per
// layer, 2.3 ms at the ~790 TFLOP/s dense bf16 rate and 1.15 ms at FP8's
// twice that; the weights (4.8 GB bf16, 2.4 GB FP8) stream in 1.1 / 0.6 ms,
// so both are compute-bound when L2 serves an expert's weights to all of its
// row tiles. L2 is the next limit: a CTA's stage is 48 KB for 4.2 MFLOP
// (bf16) or 8.4 MFLOP (FP8), ~9-10 TB/s across the grid at the bf16
// tensor-core rate against ~7.2 TB/s measured; the pairs cut that to 32-40 KB.
//
// Where it stands (H200, 2026-12-04; docs/prefill_gemm.md has every
// measurement behind this shape and the variants that lost): FP8 at 375 rows
// per expert 1.005-1.007x of cuBLASLt's block-scaled FP8 GEMM timed
// interleaved, ~1,150 TFLOP/s at the 1.3-1.45 GHz the power limit allows;
// the tensor cores ~75% (gate_up) / ~70% (down) busy per clock. One CTA per
// item, gate_up's stages alone land at 6.8-7.0 TB/s (96-100% of the kernel's
// time); pairs land them 1.5x faster, but the consumers take ~1,350 cycles
// per stage (1,024 of MMAs) whatever the data's pace, 10% (gate_up) / 15%
// (down) of them in the epilogue, which both run at once while the tensor
// cores idle.
// After the build, tools/ffma_reuse rewrites the control bits of the
// consumers' promotion FFMAs in the library (CMake option MOE_FFMA_REUSE, on by
// default): each keeps its scale operand in the reuse cache for the next and
// none yields, where ptxas alternates (2.7-3.0% faster as a patch,
// bench/results/2026-12-04_gpu_fp8_prefill_epilogue_warps, call 6; 1.3-2.2%
// timed interleaved as the build step, bench/results/2026-12-05_gpu_ffma_reuse_ab).
#include <algorithm>
#include <atomic>
#include <cstdint>
#include <cstdlib>
#include <string_view>
#include <type_traits>

#include "ops/cuda/grouped_gemm.cuh"
#include "ops/cuda/kernels.h"
#include "ops/cuda/prefill_gemm_trace.cuh"
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
  static constexpr int kWeightRows = 256;           // per item
  static constexpr int kKStep = kFp8 ? 128 : 64;    // elements per stage: 128 bytes of each row
  static constexpr int kBoxRows = kWeightRows / 2;  // the weight rows arrive as two boxes
  static constexpr int kStages = 4;
  static constexpr int kABytes = kM * 128, kBBytes = kWeightRows * 128;
  static constexpr int kScaleBytes = kFp8 ? 1024 : 0;  // 128 activation + 2 weight scales, padded
  static constexpr int kStageBytes = kABytes + kBBytes + kScaleBytes;
  static constexpr int kBarrierBase = kStages * kStageBytes;
  // FP8: per consumer warp, 16 rows x 64 bf16 columns of down's output on
  // their way out (store_down_rows_staged), 128-byte swizzled.
  static constexpr int kOutPartBytes = 16 * 128;
  static constexpr int kOutBase = (kBarrierBase + 2 * kStages * 8 + 1023) / 1024 * 1024;
  static constexpr int kOutBytes = kFp8 ? 8 * kOutPartBytes : 0;
  // Then expert_offsets and tile_offsets ([num_experts + 1] each, so dynamic).
  static constexpr int kOffsetsBase = kOutBase + kOutBytes;
  static constexpr int kSmemBytes = kOffsetsBase + 1024;  // + alignment slack
  static int smem_bytes(int num_experts) { return kSmemBytes + offsets_smem_bytes(num_experts); }
  static_assert(kStageBytes % 1024 == 0, "stages keep the swizzle atoms 1024-aligned");
};

struct PrefillArgs {
  const float* a_scales;        // FP8: [rows, scale_cols]
  const int32_t* a_scale_rows;  // FP8, optional: row r's scales are a_scales row a_scale_rows[r]
  const float* w_scales;        // FP8: [num_experts, blocks per expert, scale_cols]
  const int32_t* expert_offsets;
  const int32_t* tile_offsets;
  void* out;
  int N, K, num_experts, num_n_tiles;
  int scale_cols;       // ceil(K / 128)
  int gate_block_rows;  // gate_up: ceil(N / 128), where the up half's scale block rows start
  bool bf16_out;        // down: bf16 rows
  bool staged_out;      // FP8 down, bf16 rows, N % 8 == 0, `out` 16-aligned: store_down_rows_staged
  float* out_scales;    // FP8 gate_up: E4M3 rows into `out`, their 1 x 128 scales here (store_silu_mul_fp8_row)
};

// The epilogue of a consumer thread: its tile rows `row` and `row + 8` (those
// the item has; the whole warp runs it) from the accumulator, SiLU-multiplied to bf16 (gate_up; FP8 with
// out_scales: E4M3) or as they are (down: f32, or bf16 with bf16_out).
template <bool kGateUp, bool kFp8, int kSize>
__device__ __forceinline__ void store_rows(const PrefillArgs& p, const GemmItem& item,
                                           const float (&acc)[kSize], int row, int q) {
#pragma unroll
  for (int h = 0; h < 2; ++h) {
    const int r = row + 8 * h;
    const bool live = r < item.rows;  // every lane calls the stores (they shuffle within quads)
    const int64_t out_row = item.row0 + r;
    if constexpr (kGateUp && kFp8) {
      static_assert(kSize == 128, "an FP8 gate_up item's 128 output columns are one quantization group");
      if (p.out_scales != nullptr) {
        store_silu_mul_fp8_row(static_cast<uint8_t*>(p.out) + out_row * p.N,
                               p.out_scales + out_row * p.gate_block_rows + item.n0 / 128, acc, item.n0, p.N, h, q,
                               live);
        continue;
      }
    }
    if constexpr (kGateUp) {
      store_silu_mul_row<kSize / 8>(static_cast<bf16*>(p.out) + out_row * p.N, acc, item.n0, p.N, h, q, live);
    } else {
      store_down_row(p.out, p.bf16_out, item.row0 + r, p.N, acc, item.n0, h, q, live);
    }
  }
}

// A bf16 split item's epilogue (rows 0 .. 63 as `row` and `row + 8`,
// acc[0 .. 63] this consumer's half): gate_up's 64 output columns from 64 c
// on, down's 128 from 128 c on.
template <bool kGateUp>
__device__ __forceinline__ void store_split_rows(const PrefillArgs& p, const GemmItem& item, const float (&acc)[128],
                                                 int row, int q, int consumer, bool idle) {
  const float(&half)[64] = *reinterpret_cast<const float(*)[64]>(&acc[0]);
#pragma unroll
  for (int h = 0; h < 2; ++h) {
    const int r = row + 8 * h;
    const bool live = !idle && r < item.rows;
    if constexpr (kGateUp) {
      store_silu_mul_row<8>(static_cast<bf16*>(p.out) + (item.row0 + r) * p.N, half, item.n0 + 64 * consumer, p.N, h,
                            q, live);
    } else {
      store_down_row(p.out, p.bf16_out, item.row0 + r, p.N, half, item.n0 + 128 * consumer, h, q, live);
    }
  }
}

// kKSteps > 0: K known at compile time (kKSteps stages, a multiple of the
// ring), so the consumers' K loop unrolls by one round of the
// ring with every stage index and shared-memory address a constant (DeepGEMM
// unrolls its whole K loop; here a full unroll made ptxas hoist every stage's
// descriptors and spill 1-3 KB per thread); 0: any K. kCtas: the cluster's
// CTAs, 1 or 2 (compiled apart: with the count known at run time, the pairs'
// code cost the lone CTAs' kernel ~2%, gpu_bench on an H200, 2026-12-04).
template <bool kFp8, bool kGateUp, int kKSteps, int kCtas>
__global__ void __launch_bounds__(kThreads, 1)
    prefill_grouped_gemm_kernel(const __grid_constant__ CUtensorMap weights,
                                const __grid_constant__ CUtensorMap rows,
                                const __grid_constant__ CUtensorMap row_quarters, PrefillArgs p) {
#if MOE_SM90A_DEVICE
  using T = Tile<kFp8>;
  static_assert(kKSteps % T::kStages == 0, "whole rounds of the ring");
  constexpr int kColumnsPerTile = kGateUp ? T::kWeightRows / 2 : T::kWeightRows;
  // The cluster (kCtas, as launched). A pair's items come in two
  // kinds (item_of): two row tiles of one expert and one column tile, each
  // CTA loading its rows and one of the two weight boxes for both; or, for
  // an expert's last row tile when its count is odd (and everywhere when
  // the column tiles are odd), one row tile and two column tiles, each CTA
  // loading its weights and half the rows for both.
  static_assert(kCtas == 1 || kCtas == 2, "one CTA or a pair");
  constexpr uint32_t ctas = kCtas;
  const uint32_t rank = ctas == 1 ? 0 : cluster_ctarank();
  const bool weight_pairs = ctas == 2 && p.num_n_tiles % 2 == 0;
  const int num_pairs = (p.num_n_tiles + ctas - 1) / ctas;  // cluster items per row tile
  const int num_items = p.tile_offsets[p.num_experts] * num_pairs;
  const int num_k_steps = (p.K + T::kKStep - 1) / T::kKStep;
  const int cluster = blockIdx.x / ctas, num_clusters = gridDim.x / ctas;
  extern __shared__ unsigned char smem_raw[];
  const uint32_t smem = (smem_u32(smem_raw) + 1023) & ~1023u;  // swizzle atoms are 1024-aligned
  auto a_tile = [&](int stage) { return smem + stage * T::kStageBytes; };
  auto b_tile = [&](int stage) { return a_tile(stage) + T::kABytes; };
  auto scale_tile = [&](int stage) { return b_tile(stage) + T::kBBytes; };  // FP8: [128] activation, [2] weight
  const ItemOffsets offsets =
      copy_item_offsets(reinterpret_cast<int32_t*>(smem_raw + (smem + T::kOffsetsBase - smem_u32(smem_raw))),
                        p.expert_offsets, p.tile_offsets, p.num_experts);
  auto full = [&](int stage) { return smem + T::kBarrierBase + stage * 8; };
  auto empty = [&](int stage) { return smem + T::kBarrierBase + (T::kStages + stage) * 8; };
  // Cluster item index -> this CTA's item. Past the last column tile (an odd
  // count) the CTA still loads and multiplies: n0 >= N drops its stores.
  struct ClusterItem {
    GemmItem item;
    bool idle;           // nothing of it is stored
    bool share_weights;  // the pair shares the weight rows (else the activation rows)
  };
  auto item_of = [&](int index) {
    ClusterItem c{};
    const int row_tile = index / num_pairs;
    if (!weight_pairs) {
      const int n_tile = (index % num_pairs) * ctas + rank;
      c.idle = n_tile >= p.num_n_tiles;
      c.item = grouped_gemm_item<kM>(offsets.expert_offsets, offsets.tile_offsets, p.num_experts,
                                     row_tile * p.num_n_tiles + (c.idle ? p.num_n_tiles - 1 : n_tile),
                                     p.num_n_tiles, kColumnsPerTile);
      c.item.n0 = n_tile * kColumnsPerTile;
      return c;
    }
    // An expert with R row tiles has R x num_pairs cluster items: first the
    // row-tile pairs (R / 2 of them) x every column tile, then (R odd) its
    // last row tile x the column-tile pairs.
    const int e = grouped_gemm_item<kM>(offsets.expert_offsets, offsets.tile_offsets, p.num_experts,
                                        row_tile * p.num_n_tiles, p.num_n_tiles, kColumnsPerTile)
                      .expert;
    const int first_tile = offsets.tile_offsets[e], tiles = offsets.tile_offsets[e + 1] - first_tile;
    const int j = index - first_tile * num_pairs, paired = tiles / 2 * p.num_n_tiles;
    int local_tile, n_tile;
    if (j < paired) {
      c.share_weights = true;
      local_tile = 2 * (j / p.num_n_tiles) + static_cast<int>(rank), n_tile = j % p.num_n_tiles;
    } else {
      local_tile = tiles - 1, n_tile = 2 * (j - paired) + static_cast<int>(rank);
    }
    c.item.expert = e;
    c.item.row0 = offsets.expert_offsets[e] + local_tile * kM;
    c.item.rows = min(kM, offsets.expert_offsets[e + 1] - c.item.row0);
    c.item.n0 = n_tile * kColumnsPerTile;
    return c;
  };
  const int warp_id = threadIdx.x >> 5, lane = threadIdx.x & 31;
  if (threadIdx.x == 0) {
    for (int s = 0; s < T::kStages; ++s) {
      mbarrier_init(full(s),
                    kFp8 ? 1 + kProducerThreads : 1);  // the expect-tx arrival (+ FP8: the scales' cp.async)
      mbarrier_init(empty(s), 8 * ctas);               // one per consumer warp of the cluster
    }
    fence_mbarrier_init_cluster();
  }
  cluster_sync();  // the peer's barriers are initialised before anything arrives on them (and the offsets copied)

  if (warp_id < 4) {
    setmaxnreg_dec<56>();
    // Trace phases: 0 waiting for a free stage, 1 issuing its copies.
    PhaseClock trace;
    const int own = threadIdx.x;  // FP8: thread t copies row t's activation scale
    if (kFp8 || own == 0) {
      const uint16_t cta_mask = static_cast<uint16_t>((1u << ctas) - 1);
      const int share_rows = kM / static_cast<int>(ctas);
      int step = 0;
      for (int index = cluster; index < num_items; index += num_clusters) {
        const auto [item, idle, share_weights] = item_of(index);
        const int y0 = item.expert * (kGateUp ? 2 * p.N : p.N) + item.n0;
        const int y1 = kGateUp ? y0 + p.N : y0 + T::kBoxRows;
        // FP8: thread 0 copies the scale of the weight block of the tile's
        // first 128 columns (gate_up: the gate ones), thread 1 of the last
        // 128 (gate_up: the matching up ones), if the tile reaches them.
        int64_t w_scale_row = 0;
        bool w_scale_live = !idle;
        if constexpr (kFp8) {
          const int blocks_per_expert = kGateUp ? 2 * p.gate_block_rows : (p.N + 127) / 128;
          w_scale_row = static_cast<int64_t>(item.expert) * blocks_per_expert + item.n0 / 128 +
                        (own == 1 ? (kGateUp ? p.gate_block_rows : 1) : 0);
          if (!kGateUp && own == 1) w_scale_live = w_scale_live && item.n0 + 128 < p.N;
        }
        // FP8: thread `own` copies the activation scale of the item's row `own`.
        const bool a_scale_live = kFp8 && own < item.rows;
        int64_t a_scale_row = 0;
        if (a_scale_live)
          a_scale_row = p.a_scale_rows != nullptr ? p.a_scale_rows[item.row0 + own] : item.row0 + own;
        // One CTA: a tile of at most 96 rows (an expert's last) loads only
        // the 32-row quarters that hold them; the MMAs of the rest multiply
        // stale rows that are never stored.
        const int quarters = ctas == 1 ? min(4, (item.rows + kM / 4 - 1) / (kM / 4)) : 4;
        for (int ks = 0; ks < num_k_steps; ++ks, ++step) {
          const int stage = step % T::kStages;
          if (step >= T::kStages) mbarrier_wait(empty(stage), ((step / T::kStages) - 1) & 1);
          trace.mark(0);
          if (own == 0) {
            mbarrier_arrive_expect_tx(full(stage), quarters * (T::kABytes / 4) + T::kBBytes);
            const int x = ks * T::kKStep;
            if (ctas == 1 && quarters == 4) {
              tma_load_2d(a_tile(stage), &rows, x, item.row0, full(stage));
            } else if (ctas == 1) {
              for (int i = 0; i < quarters; ++i)
                tma_load_2d(a_tile(stage) + i * (T::kABytes / 4), &row_quarters, x, item.row0 + i * (kM / 4),
                            full(stage));
            } else if (share_weights) {  // own rows (two boxes); weight box `rank` for both CTAs
              tma_load_2d(a_tile(stage), &rows, x, item.row0, full(stage));
              tma_load_2d(a_tile(stage) + share_rows * 128, &rows, x, item.row0 + share_rows, full(stage));
              tma_load_2d_multicast(b_tile(stage) + rank * (T::kBBytes / 2), &weights, x, rank == 0 ? y0 : y1,
                                    full(stage), cta_mask);
            } else {  // rows [rank, rank + 1) x kM / 2 for both CTAs
              tma_load_2d_multicast(a_tile(stage) + rank * share_rows * 128, &rows, x,
                                    item.row0 + static_cast<int>(rank) * share_rows, full(stage), cta_mask);
            }
            if (!share_weights) {
              tma_load_2d(b_tile(stage), &weights, x, y0, full(stage));
              tma_load_2d(b_tile(stage) + T::kBBytes / 2, &weights, x, y1, full(stage));
            }
          }
          if constexpr (kFp8) {
            cp_async_4(scale_tile(stage) + own * 4, p.a_scales + (a_scale_live ? a_scale_row * p.scale_cols + ks : 0),
                       a_scale_live);
            if (own < 2)
              cp_async_4(scale_tile(stage) + (128 + own) * 4,
                         p.w_scales + (w_scale_live ? w_scale_row * p.scale_cols + ks : 0), w_scale_live);
            mbarrier_arrive_cp_async(full(stage));
          }
          trace.mark(1);
        }
      }
      if constexpr (kFp8) cp_async_wait_group<0>();
      trace.store();
    }
  } else {
    setmaxnreg_inc<224>();
    // Consumer c: rows 64 c + 16 w + g (+ 8) of the tile; accumulator column 8 i + 2 q (+ 1) is weight row 8
    // i + 2 q (+ 1).
    // (consumer through a shuffle: the compiler then knows it is the same in
    // a warp, and keeps the descriptors in uniform registers.)
    const int consumer = __shfl_sync(0xffffffffu, (warp_id >> 2) - 1, 0), warp = warp_id & 3, g = lane >> 2,
              q = lane & 3;
    const uint32_t a_offset = consumer * 64 * 128;
    // The stage is free in every CTA of the cluster: lane c of each warp
    // arrives on CTA c's barrier, all in one instruction (lane 0 arriving on
    // each in turn waited for the first remote arrival before the second).
    auto release = [&](int stage) {
      if (ctas == 1) {
        mbarrier_arrive_if(empty(stage), lane == 0);
      } else {
        const bool arrives = static_cast<uint32_t>(lane) < ctas;
        mbarrier_arrive_cluster_if(empty(stage), arrives ? static_cast<uint32_t>(lane) : 0u, arrives);
      }
    };
    int step = 0;
    if constexpr (!kFp8) {
      float acc[128];
      const uint64_t a_desc = sw128_descriptor(a_tile(0) + a_offset, 16, 1024);
      const uint64_t b_desc = sw128_descriptor(b_tile(0), 16, 1024);
      // Split items: rows 0 .. 63 for both consumers, consumer c's half of
      // the weight rows into acc[0 .. 63] (gate_up: gate and up rows 64 c ..
      // 64 c + 63, two m64n64 MMAs; down: rows 128 c .. 128 c + 127).
      const uint64_t a_desc_split = sw128_descriptor(a_tile(0), 16, 1024);
      // (gate_up's two m64n64 accumulators as arrays of their own: as views
      // of acc, ptxas serialized the gate_up kernels' MMAs, C7511.)
      float(&acc_64)[64] = *reinterpret_cast<float(*)[64]>(&acc[0]);
      float acc_lo[32], acc_hi[32];
      auto k_step = [&](auto split, int ks, int stage, uint32_t parity) {
        mbarrier_wait(full(stage), parity);
        wgmma_fence();
#pragma unroll
        for (int kk = 0; kk < 4; ++kk) {
          const int accumulate = ks > 0 || kk > 0;
          const uint32_t b = stage * T::kStageBytes + kk * 32;
          if constexpr (!split) {
            wgmma_m64n256k16_ss(acc, advance_descriptor(a_desc, b), advance_descriptor(b_desc, b), accumulate);
          } else if constexpr (kGateUp) {
            const uint64_t a = advance_descriptor(a_desc_split, b);
            wgmma_m64n64k16_ss<0>(acc_lo, a, advance_descriptor(b_desc, b + consumer * 64 * 128), accumulate);
            wgmma_m64n64k16_ss<0>(acc_hi, a, advance_descriptor(b_desc, b + T::kBBytes / 2 + consumer * 64 * 128),
                                  accumulate);
          } else {
            wgmma_m64n128k16_ss<0>(acc_64, advance_descriptor(a_desc_split, b),
                                   advance_descriptor(b_desc, b + consumer * (T::kBBytes / 2)), accumulate);
          }
        }
        wgmma_commit_group();
        wgmma_wait_group<1>();  // the previous stage's MMAs are done: free it
        if (ks > 0) release((stage + T::kStages - 1) % T::kStages);
      };
      for (int index = cluster; index < num_items; index += num_clusters) {
        const auto [item, idle, share_weights] = item_of(index);
        if (item.rows <= 64) {  // split (the runtime loop: less code)
          for (int ks = 0; ks < num_k_steps; ++ks, ++step)
            k_step(std::true_type{}, ks, step % T::kStages, (step / T::kStages) & 1);
        } else if constexpr (kKSteps > 0) {  // step is a multiple of the ring here: ks % kStages is the stage
#pragma unroll 4
          for (int ks = 0; ks < kKSteps; ++ks)
            k_step(std::false_type{}, ks, ks % T::kStages, ((step + ks) / T::kStages) & 1);
          step += kKSteps;
        } else {
          for (int ks = 0; ks < num_k_steps; ++ks, ++step)
            k_step(std::false_type{}, ks, step % T::kStages, (step / T::kStages) & 1);
        }
        wgmma_wait_group<0>();
        release((step - 1) % T::kStages);
        if (item.rows <= 64) {
          if constexpr (kGateUp) {
#pragma unroll
            for (int i = 0; i < 32; ++i) acc[i] = acc_lo[i], acc[32 + i] = acc_hi[i];
          }
          store_split_rows<kGateUp>(p, item, acc, warp * 16 + g, q, consumer, idle);
        } else if (!idle) {
          store_rows<kGateUp, kFp8>(p, item, acc, consumer * 64 + warp * 16 + g, q);
        }
      }
    } else {
      // Per 128-wide K block (one scale block) and half of the weight rows,
      // the MMAs go into a partial accumulator that is then added to the
      // running sum times (activation scale x weight scale). Registers hold
      // only one partial beside the m64n256 sum, so within a warpgroup a
      // half's MMAs and its promotion alternate; the tensor cores run the
      // other consumer's MMAs meanwhile, and stay busy only while each
      // consumer's time between two batches of MMAs (a promotion, 64 FFMAs)
      // is shorter than the other's batch. So everything else of a stage
      // change -- waiting for the next stage, reading its scales -- happens
      // while MMAs run, and the descriptors are one add from a base
      // (gate_up's tensor pipe 68 -> 74% busy; the variants that gained
      // nothing are in docs/prefill_gemm.md).
      float acc[128], part[64];
      const uint64_t a_desc = sw128_descriptor(a_tile(0) + a_offset, 16, 1024);
      const uint64_t b_desc = sw128_descriptor(b_tile(0), 16, 1024);
      // A stage's two row scales (rows g and g + 8 of the warp) for each half.
      struct StageScales {
        float half[2][2];
      };
      auto read_scales = [&](int stage) {
        const float* scales =
            reinterpret_cast<const float*>(smem_raw + (scale_tile(stage) - smem_u32(smem_raw)));
        const float a0 = scales[consumer * 64 + warp * 16 + g],
                    a1 = scales[consumer * 64 + warp * 16 + g + 8];
        const float w0 = scales[128], w1 = scales[129];
        return StageScales{{{a0 * w0, a1 * w0}, {a0 * w1, a1 * w1}}};
      };
      auto issue_half = [&](int stage, int half) {
        wgmma_fence();
#pragma unroll
        for (int kk = 0; kk < 4; ++kk)
          wgmma_m64n128k32_e4m3_ss(
              part, advance_descriptor(a_desc, stage * T::kStageBytes + kk * 32),
              advance_descriptor(b_desc, stage * T::kStageBytes + half * (T::kBBytes / 2) + kk * 32), kk > 0);
        wgmma_commit_group();
      };
      auto promote = [&](int half, const float(&scale)[2]) {
#pragma unroll
        for (int i = 0; i < 64; ++i) acc[64 * half + i] += part[i] * scale[(i >> 1) & 1];
      };
      // FP8 down's bf16 rows through shared memory (p.staged_out): per 64
      // columns, the warp's 16 tile rows (16 w, w = 4 consumer + warp) go into
      // its part of the staging area by stmatrix (matrix i of lane 8 i + r:
      // chunk c + i / 2 of 8 columns, row 8 (i % 2) + r; 128-byte swizzle, so
      // both the stmatrix rows and the reads back fall on distinct banks),
      // then each lane reads back 16 bytes of four rows and stores them,
      // eight lanes a full 128-byte row each. No shuffles (the quad
      // transposes of store_bf16_row took ~11% of down's cycles), and whole
      // lines stored.
      auto store_down_rows_staged = [&](const GemmItem& item) {
        const int first = (consumer * 4 + warp) * 16;
        const uint32_t part_buf = smem + T::kOutBase + (consumer * 4 + warp) * T::kOutPartBytes;
        const unsigned char* part_ptr = smem_raw + (part_buf - smem_u32(smem_raw));
        const int m = lane >> 3, r = 8 * (m & 1) + (lane & 7), read_chunk = lane & 7;
        bf16* out = static_cast<bf16*>(p.out);
#pragma unroll
        for (int part = 0; part < 4; ++part) {
#pragma unroll
          for (int c2 = 0; c2 < 8; c2 += 2) {
            const int c = 8 * part + c2, chunk = c2 + (m >> 1);
            const uint32_t r4[4] = {bf16_pair(acc[4 * c], acc[4 * c + 1]), bf16_pair(acc[4 * c + 2], acc[4 * c + 3]),
                                    bf16_pair(acc[4 * c + 4], acc[4 * c + 5]),
                                    bf16_pair(acc[4 * c + 6], acc[4 * c + 7])};
            stmatrix_x4(part_buf + r * 128 + ((chunk ^ (r & 7)) << 4), r4);
          }
          __syncwarp();
          const int col = item.n0 + 64 * part + 8 * read_chunk;
#pragma unroll
          for (int i = 0; i < 4; ++i) {
            const int row = (lane >> 3) + 4 * i;
            const uint4 v = *reinterpret_cast<const uint4*>(part_ptr + row * 128 + ((read_chunk ^ (row & 7)) << 4));
            if (first + row < item.rows && col < p.N)
              *reinterpret_cast<uint4*>(out + static_cast<int64_t>(item.row0 + first + row) * p.N + col) = v;
          }
          __syncwarp();
        }
      };
      // One stage whose data has arrived: both halves, each promoted; its
      // scales (and, in an item's first stage, the next item `look_ahead`: a
      // binary search over the offsets) are read while the first half's MMAs
      // run, and the next stage of the item (if `has_next`) is waited for
      // while the second half's do.
      ClusterItem next{};
      // Trace phases: 0 issuing the first half (+ scales, look-ahead), 1
      // waiting for its MMAs, 2 its promotion, 3 issuing the second half, 4
      // waiting for the next stage, 5 for the second half's MMAs, 6 its
      // promotion, 7 the epilogue (and zeroing the sums), 8 waiting for an
      // item's first stage.
      PhaseClock trace;
      const bool no_math = trace_no_math();
      auto k_step = [&](int stage, bool has_next, int next_stage, uint32_t next_parity, int look_ahead = -1) {
        if (no_math) {
          if (look_ahead >= 0 && look_ahead < num_items) next = item_of(look_ahead);
          if (has_next) mbarrier_wait(full(next_stage), next_parity);
          release(stage);
          trace.mark(4);
          return;
        }
        issue_half(stage, 0);
        const StageScales scales = read_scales(stage);
        if (look_ahead >= 0 && look_ahead < num_items) next = item_of(look_ahead);
        trace.mark(0);
        wgmma_wait_group<0>();
        trace.mark(1);
        promote(0, scales.half[0]);
        trace.mark(2);
        issue_half(stage, 1);
        trace.mark(3);
        if (has_next) mbarrier_wait(full(next_stage), next_parity);
        trace.mark(4);
        wgmma_wait_group<0>();
        trace.mark(5);
        release(stage);
        promote(1, scales.half[1]);
        trace.mark(6);
      };
      ClusterItem current = cluster < num_items ? item_of(cluster) : ClusterItem{};
      for (int index = cluster; index < num_items; index += num_clusters, current = next) {
        const auto [item, idle, share_weights] = current;
#pragma unroll
        for (int i = 0; i < 128; ++i) acc[i] = 0.0f;
        trace.mark(7);
        mbarrier_wait(full(step % T::kStages), (step / T::kStages) & 1);
        trace.mark(8);
        if constexpr (kKSteps > 0) {  // step is a multiple of the ring here: ks % kStages is the stage
#pragma unroll 4
          for (int ks = 0; ks < kKSteps; ++ks)
            k_step(ks % T::kStages, ks + 1 < kKSteps, (ks + 1) % T::kStages,
                   ((step + ks + 1) / T::kStages) & 1, ks == 0 ? index + num_clusters : -1);
          step += kKSteps;
        } else {
          for (int ks = 0; ks < num_k_steps; ++ks, ++step)
            k_step(step % T::kStages, ks + 1 < num_k_steps, (step + 1) % T::kStages,
                   ((step + 1) / T::kStages) & 1, ks == 0 ? index + num_clusters : -1);
        }
        if (!idle && !no_math) {
          if (!kGateUp && p.staged_out) {
            store_down_rows_staged(item);
          } else {
            store_rows<kGateUp, kFp8>(p, item, acc, consumer * 64 + warp * 16 + g, q);
          }
        }
      }
      trace.mark(7);
      trace.store();
    }
  }
  // No CTA leaves while its peer may still arrive on its barriers or write its stages.
  cluster_sync();
#endif
}

// The measuring switches below are read at every launch (the bench flips
// them between calls); unset reads as "".
std::string_view env_value(const char* name) {
  const char* v = std::getenv(name);
  return v == nullptr ? std::string_view() : std::string_view(v);
}

// CTAs per cluster: pairs. FP8 took one CTA per item below four row tiles
// per expert until 2026-12-05, when, with the promotion FFMAs' reuse bits,
// pairs served 1.3-2.7% more prefill tokens/s end to end at 128-384 rows per
// expert and as many at 64 (docs/prefill_gemm.md). MOE_PREFILL_GEMM_CLUSTER=1
// or 2 overrides, for measuring and for the tests.
int cluster_ctas() {
  const std::string_view v = env_value("MOE_PREFILL_GEMM_CLUSTER");
  if (v == "1" || v == "2") return v[0] - '0';
  return 2;
}

// MOE_PREFILL_GEMM_UNROLL=0: the kernels' runtime K loop even where an
// unrolled one exists.
bool unroll_k() { return env_value("MOE_PREFILL_GEMM_UNROLL") != "0"; }

// The instantiation for a launch: Qwen3-235B's K (4096 into gate_up, 1536
// into down) unrolled.
template <bool kFp8, int kCtas>
auto pick_kernel(bool gate_up, int k_steps) {
  using T = Tile<kFp8>;
  constexpr int kGateUpSteps = 4096 / T::kKStep, kDownSteps = 1536 / T::kKStep;
  const bool unroll = unroll_k();
  if (gate_up) {
    return unroll && k_steps == kGateUpSteps ? prefill_grouped_gemm_kernel<kFp8, true, kGateUpSteps, kCtas>
                                             : prefill_grouped_gemm_kernel<kFp8, true, 0, kCtas>;
  }
  return unroll && k_steps == kDownSteps ? prefill_grouped_gemm_kernel<kFp8, false, kDownSteps, kCtas>
                                         : prefill_grouped_gemm_kernel<kFp8, false, 0, kCtas>;
}

template <bool kFp8>
cudaError_t launch_prefill_gemm(const PrefillArgs& args, const void* a, int a_rows, const void* w,
                                int max_tiles, bool gate_up, cudaStream_t stream) {
  using T = Tile<kFp8>;
  if (!hopper_kernels_available()) return cudaErrorNotSupported;
  if (args.K <= 0 || args.K % (kFp8 ? 16 : 8) != 0 || a_rows <= 0) return cudaErrorInvalidValue;
  if (max_tiles == 0) return cudaSuccess;
  const int element_bytes = kFp8 ? 1 : 2, ctas = cluster_ctas();
  const uint64_t row_bytes = static_cast<uint64_t>(args.K) * element_bytes;
  const uint64_t weight_rows = static_cast<uint64_t>(args.num_experts) * (gate_up ? 2 * args.N : args.N);
  CUtensorMap weight_map, row_map, quarter_map;
  cudaError_t error = make_tensor_map_2d(&weight_map, w, element_bytes, weight_rows, args.K, row_bytes,
                                         T::kBoxRows, T::kKStep);
  if (error != cudaSuccess) return error;
  error = make_tensor_map_2d(&row_map, a, element_bytes, static_cast<uint64_t>(a_rows), args.K, row_bytes,
                             kM / ctas, T::kKStep);
  if (error != cudaSuccess) return error;
  error = make_tensor_map_2d(&quarter_map, a, element_bytes, static_cast<uint64_t>(a_rows), args.K, row_bytes, kM / 4,
                             T::kKStep);
  if (error != cudaSuccess) return error;
  const int k_steps = (args.K + T::kKStep - 1) / T::kKStep;
  auto kernel = ctas == 1 ? pick_kernel<kFp8, 1>(gate_up, k_steps) : pick_kernel<kFp8, 2>(gate_up, k_steps);
  const int smem_bytes = T::smem_bytes(args.num_experts);
  error = allow_dynamic_smem(kernel, smem_bytes);
  if (error != cudaSuccess) return error;
  cudaLaunchAttribute attribute{};
  attribute.id = cudaLaunchAttributeClusterDimension;
  attribute.val.clusterDim.x = ctas;
  attribute.val.clusterDim.y = 1;
  attribute.val.clusterDim.z = 1;
  cudaLaunchConfig_t config{};
  config.blockDim = dim3(kThreads);
  config.dynamicSmemBytes = smem_bytes;
  config.stream = stream;
  config.attrs = &attribute;
  config.numAttrs = 1;
  // Persistent: as many clusters as fit at once (a GPC with an odd SM count
  // leaves one SM out of the 2-CTA clusters), never more than the items.
  static std::atomic<int> max_clusters[2][2] = {};  // [gate_up][ctas - 1]
  int fit = max_clusters[gate_up][ctas - 1].load(std::memory_order_relaxed);
  if (fit == 0) {
    config.gridDim = dim3(ctas * multiprocessor_count());
    error = cudaOccupancyMaxActiveClusters(&fit, kernel, &config);
    if (error != cudaSuccess) return error;
    if (fit == 0) return cudaErrorNotSupported;
    max_clusters[gate_up][ctas - 1].store(fit, std::memory_order_relaxed);
  }
  const int pairs = (args.num_n_tiles + ctas - 1) / ctas;
  config.gridDim = dim3(ctas * std::min(fit, pairs * max_tiles));
  error = cudaLaunchKernelEx(&config, kernel, weight_map, row_map, quarter_map, args);
  if (error != cudaSuccess) return error;
  return cudaGetLastError();
}

int num_n_tiles(int N, bool gate_up, int weight_rows) {
  const int columns = gate_up ? weight_rows / 2 : weight_rows;
  return (N + columns - 1) / columns;
}

// The fields of both dtypes' params (GroupedGemmParams, Fp8GroupedGemmParams).
template <typename Params>
PrefillArgs prefill_args(const Params& p, int weight_rows) {
  PrefillArgs args{};
  args.expert_offsets = p.expert_offsets, args.tile_offsets = p.tile_offsets, args.out = p.out;
  args.N = p.N, args.K = p.K, args.num_experts = p.num_experts, args.bf16_out = p.bf16_out;
  args.num_n_tiles = num_n_tiles(p.N, p.gate_up, weight_rows);
  return args;
}

}  // namespace

int moe_tile_rows(int64_t rows, int num_experts) {
  return hopper_kernels_available() && rows >= int64_t{64} * num_experts ? kPrefillGemmTileRows : kGroupedGemmTileRows;
}

cudaError_t wgmma_grouped_gemm_prefill(const GroupedGemmParams& p, cudaStream_t stream) {
  if (p.sorted_token != nullptr) return cudaErrorInvalidValue;  // the rows come gathered (gather_rows)
  return launch_prefill_gemm<false>(prefill_args(p, Tile<false>::kWeightRows), p.a, p.a_rows, p.w,
                                    p.max_tiles, p.gate_up, stream);
}

cudaError_t fp8_grouped_gemm_prefill(const Fp8GroupedGemmParams& p, cudaStream_t stream) {
  if (p.k_splits != 1 || p.sorted_token != nullptr) return cudaErrorInvalidValue;
  if (p.out_scales != nullptr && (!p.gate_up || p.N % 16 != 0)) return cudaErrorInvalidValue;
  PrefillArgs args = prefill_args(p, Tile<true>::kWeightRows);
  args.out_scales = p.out_scales;
  // MOE_PREFILL_STAGED_OUT=0: down's rows from registers (store_bf16_row), for measuring.
  args.staged_out = !p.gate_up && p.bf16_out && p.N % 8 == 0 && reinterpret_cast<uintptr_t>(p.out) % 16 == 0 &&
                    env_value("MOE_PREFILL_STAGED_OUT") != "0";
  args.a_scales = p.a_scales, args.a_scale_rows = p.a_scale_rows, args.w_scales = p.w_scales;
  args.scale_cols = (p.K + 127) / 128, args.gate_block_rows = (p.N + 127) / 128;
  return launch_prefill_gemm<true>(args, p.a, p.a_rows, p.w, p.max_tiles, p.gate_up, stream);
}

}  // namespace moe::ops::cuda
