// The MoE grouped GEMMs with FP8 weights on Hopper (wgmma e4m3) -- block
// scaling (fp8-block) and MXFP8 -- and the activation quantizers they read.
//
// Format (ops/quant.h, fp8-block): weights E4M3 with one f32 multiplier per
// 128 x 128 block, activations E4M3 with one f32 multiplier per row and 128
// columns. A K-block of 128 therefore has one activation scale per row and one
// weight scale per 128 weight rows, so the kernel accumulates each K-block's
// MMAs in a partial f32 accumulator and adds it to the running one times
// (activation scale x weight scale) -- the "promotion" of DeepSeek-V3's FP8
// GEMMs, which also keeps the tensor cores' reduced-precision FP8 accumulation
// to 128 products.
//
// Algorithm: a persistent grid walks items of up to 64 permuted rows of one
// expert x 512 weight rows; per item K goes through shared memory 128
// columns at a time (one scale block, 128 bytes per row: the 128-byte
// swizzle). Two consumer warpgroups multiply all 64 rows, each by 256 of the
// weight rows (gate_up: 128 gate rows and the matching 128 up rows, so
// SiLU-multiply runs on the accumulators; down: 256 output columns), one
// half (128 rows, one 128 x 128 scale block) at a time: the MMAs go into a
// partial m64n128 accumulator, which is then added to the m64n256 sum times
// (activation scale x weight scale) while the other consumer's MMAs run
// (ptxas serialises wgmma when a warpgroup reads one accumulator while
// another of its MMAs is in flight). One producer warp fills two rings: per
// K-step the activation rows (cp.async, gathered through sorted_token for
// gate_up; contiguous rows with a_rows given: one tensor copy, see
// launch_fp8_gemm) and the step's scales, three steps deep; and per K-step and half
// a slot of the two consumers' 128 weight rows each (the bulk tensor copy
// engine), six slots deep, each freed as soon as both consumers' MMAs of
// that half are done. Registers: the producer's warpgroup hands its own
// down to 64 so the consumers hold 216 (no spills in any variant).
//
// Down right after gate_up (early_weights) is launched as gate_up's
// programmatic dependent: its CTAs take the SMs gate_up's leave and ask for
// their first item's first kSteps K-steps of weights before
// griddepcontrol.wait, the activation rows after it.
//
// gate_up's epilogue can write the down GEMM's input directly: each
// consumer's 128 output columns are one 1 x 128 quantization group, so it
// quantizes its SiLU-multiplied rows to E4M3 with their scales
// (store_silu_mul_fp8_row, the bytes quantize_fp8_groups would make).
//
// Why 512 weight rows: both GEMMs keep the link between the H200's two L2
// partitions (lts__ltcfabric2ltc) 91-94% busy already at 1 row per expert
// (ncu, 2026-12-01), and every activation row re-read per column tile crosses
// it again, so the 256-row items before these reached 84-91.5% of the copy
// bandwidth at 64 rows per expert, by machine. Items of 512 rows read the
// activation rows half as often: alternated with the 256-row kernel in one
// call (2026-12-03), 64 rows per expert 0.627-0.628 ms (89.8-90.0%) against
// 0.637-0.670 ms, 1 row 0.580 against 0.575 ms. One 72 KB stage ring three
// deep had lost 3% at 1 row, hence the weight slots of half a step.
//
// MXFP8 (OCP MX: one E8M0 scale per 1 x 32 for weights and activations)
// has no block-scaled MMA on Hopper, so the same kernel runs each 32-wide K
// slice through wgmma on its own and promotes it with its activation scale
// times a per-column weight scale: four promotions per stage instead of one,
// each waiting for its MMA. Its cost against fp8-block is measured in
// gpu_bench; on Blackwell tcgen05's block-scaled MMA applies the scales in
// hardware (grouped_gemm_sm100.cu: compiled, never run).
//
// Floor: FP8 halves the weight bytes: 2.4 GB per Qwen3-235B MoE layer, 0.57 ms
// at 4.27 TB/s (MXFP8's scales add 1/32 of that).
#include <algorithm>
#include <cstdint>
#include <cuda_fp8.h>

#include "ops/cuda/grouped_gemm.cuh"
#include "ops/cuda/kernels.h"
#include "ops/cuda/tensor_map.h"
#include "ops/cuda/wgmma.cuh"

namespace moe::ops::cuda {
namespace {

constexpr int kM = kGroupedGemmTileRows, kWeightRows = 512, kKStep = 128;
constexpr int kSteps = 3;          // K-steps in flight: activation rows and scales
constexpr int kSlots = 2 * kSteps;  // weight slots: one per K-step and half
constexpr int kBoxRows = 128;       // a consumer's half: one box, one scale block
constexpr int kThreads = 384;  // warpgroup 0: the producer (warp 0); warpgroups 1, 2: the consumers
constexpr int kABytes = kM * 128, kSlotBytes = 2 * kBoxRows * 128;  // a slot: consumer 0's box, then consumer 1's
// Scales per K-step: fp8-block 64 activation + 4 weight floats (box 2 c + half);
// MXFP8 4 E8M0 bytes (the step's 128 columns) per activation row, then per
// weight row (consumer c's half h: rows (2 c + h) x 128 ..).
template <bool kMx>
constexpr int kScaleBytes = kMx ? kM * 4 + kWeightRows * 4 : (kM + 4) * 4;
[[maybe_unused]] constexpr int kMxActivationScaleBytes = kM * 4;  // used by sm_90a device code only
constexpr int kABase = kSlots * kSlotBytes;
constexpr int kScaleBase = kABase + kSteps * kABytes;
template <bool kMx>
constexpr int kBarrierBase = kScaleBase + kSteps * kScaleBytes<kMx>;  // full, empty x (steps, slots)
template <bool kMx>
constexpr int kOffsetsBase = kBarrierBase<kMx> + 2 * (kSteps + kSlots) * 8;  // then copy_item_offsets' offsets
template <bool kMx>
constexpr int kSmemBytes = kOffsetsBase<kMx> + 1024;  // + alignment slack
static_assert(kSlotBytes % 1024 == 0 && kABytes % 1024 == 0, "tiles keep the swizzle atoms 1024-aligned");
constexpr int kGroup = 128;  // fp8-block quantization group along K
constexpr int kMxGroup = 32;  // MXFP8's

// The two formats' parameters, scales untyped (f32 or E8M0 bytes).
struct Fp8GemmArgs {
  const uint8_t* a;
  const void* a_scales;
  const int32_t* sorted_token;
  const void* w_scales;
  const int32_t* expert_offsets;
  const int32_t* tile_offsets;
  void* out;
  int N, K, num_experts;
  int num_n_tiles;
  int scale_cols;        // fp8-block: ceil(K / 128) floats; MXFP8: K / 32 bytes
  int gate_block_rows;   // fp8-block gate_up: ceil(N / 128), where the up half's block rows start
  int k_splits;          // down only: K-steps split over this many items, each adding its share into `out`
  bool bf16_out = false;  // down only, k_splits 1: bf16 rows
  float* out_scales = nullptr;  // gate_up, fp8-block only: E4M3 rows into `out`, their 1 x 128 scales here
  bool early_weights = false;   // down only: launched as the kernel before's programmatic dependent
};

// 2^(code - 127); code 0 is 2^-127 (a denormal), as the CPU reference reads it.
__device__ __forceinline__ float e8m0_to_float(uint32_t code) {
  return code == 0 ? __int_as_float(0x00400000) : __int_as_float(static_cast<int>(code << 23));
}

// kRowsByTma: contiguous activation rows (fp8-block) by tensor copies (the
// `rows` map), else gathered with cp.async. kSplitK: down's items add their
// share of K into `out` (k_splits > 1). kNarrowOut: gate_up writes E4M3 rows
// and their scales (out_scales), down bf16 rows (bf16_out). Compiled in
// rather than read from the arguments, so the paths a launch does not take
// cost its kernel nothing: kRowsByTma and kSplitK took the GEMMs at 64 rows
// per expert from 89.3-89.6% to 90.0-90.3% of the copy bandwidth (H200,
// 2026-12-04, timed interleaved, three rounds; the prefill GEMMs gained 3%
// from the same).
template <bool kGateUp, bool kMx, bool kRowsByTma, bool kSplitK, bool kNarrowOut>
__global__ void __launch_bounds__(kThreads, 1) fp8_grouped_gemm_kernel(const __grid_constant__ CUtensorMap weights,
                                                                       Fp8GemmArgs args,
                                                                       const __grid_constant__ CUtensorMap rows) {
#if MOE_SM90A_DEVICE
  constexpr int kBarriers = kBarrierBase<kMx>;
  const Fp8GemmArgs& p = args;
  const int num_items = p.tile_offsets[p.num_experts] * args.num_n_tiles * args.k_splits;
  const int num_k_steps = (p.K + kKStep - 1) / kKStep;
  const int split_steps = (num_k_steps + args.k_splits - 1) / args.k_splits;  // an empty last split adds zeros
  const int columns_per_tile = kGateUp ? kWeightRows / 2 : kWeightRows;
  extern __shared__ unsigned char smem_raw[];
  const uint32_t smem = (smem_u32(smem_raw) + 1023) & ~1023u;  // swizzle atoms are 1024-aligned
  auto slot_tile = [&](int slot) { return smem + slot * kSlotBytes; };
  auto a_tile = [&](int step) { return smem + kABase + step * kABytes; };
  auto scale_tile = [&](int step) { return smem + kScaleBase + step * kScaleBytes<kMx>; };  // activation, then weight
  auto step_full = [&](int step) { return smem + kBarriers + step * 8; };
  auto step_empty = [&](int step) { return smem + kBarriers + (kSteps + step) * 8; };
  auto slot_full = [&](int slot) { return smem + kBarriers + (2 * kSteps + slot) * 8; };
  auto slot_empty = [&](int slot) { return smem + kBarriers + (2 * kSteps + kSlots + slot) * 8; };
  const int warp_id = threadIdx.x >> 5, lane = threadIdx.x & 31;
  const ItemOffsets offsets =
      copy_item_offsets(reinterpret_cast<int32_t*>(smem_raw + (smem + kOffsetsBase<kMx> - smem_u32(smem_raw))),
                        p.expert_offsets, p.tile_offsets, p.num_experts);
  if (threadIdx.x == 0) {
    for (int s = 0; s < kSteps; ++s) {
      mbarrier_init(step_full(s), 32);  // the producer lanes' cp.async arrivals
      mbarrier_init(step_empty(s), 8);  // one per consumer warp
    }
    for (int s = 0; s < kSlots; ++s) {
      mbarrier_init(slot_full(s), 1);  // the expect-tx arrival
      mbarrier_init(slot_empty(s), 8);
    }
  }
  __syncthreads();
  // The next kernel may start its blocks as these exit (down's, early_weights).
  if (threadIdx.x == 0) grid_launch_dependents();

  if (warp_id < 4) {
    setmaxnreg_dec<64>();
    if (warp_id != 0) return;
    // Producer warp. Lane l holds the source rows l and l + 32 (-1: past the tile).
    int step = 0;
    // early_weights: the first item's first kSteps K-steps of weights are
    // asked for before griddepcontrol.wait, everything else after it.
    int early_steps = 0;
    for (int index = blockIdx.x; index < num_items; index += gridDim.x) {
      const GemmItem item = grouped_gemm_item(offsets.expert_offsets, offsets.tile_offsets, p.num_experts, index / args.k_splits,
                                              args.num_n_tiles, columns_per_tile);
      const int ks_begin = index % args.k_splits * split_steps, ks_end = min(num_k_steps, ks_begin + split_steps);
      int64_t source[2];
#pragma unroll
      for (int h = 0; h < 2; ++h) {
        const int r = lane + 32 * h;
        source[h] = r >= item.rows ? -1 : kGateUp ? p.sorted_token[item.row0 + r] : item.row0 + r;
      }
      // Box b = 2 c + half: consumer c's weight rows of that half (gate_up:
      // half 0 the gate rows of output columns n0 + 128 c .. + 127, half 1
      // the matching up rows; down: output columns n0 + 128 b ..), each within
      // one 128-row scale block. Boxes past the expert's rows load finite
      // values whose columns the stores drop (past the whole tensor: zeros).
      const int rows_per_expert = kGateUp ? 2 * p.N : p.N;
      const int base = item.expert * rows_per_expert + item.n0;
      auto box_row = [&](int box) {
        return kGateUp ? base + (box & 1) * p.N + (box >> 1) * kBoxRows : base + box * kBoxRows;
      };
      // fp8-block: lane b < 4 copies box b's weight scale.
      int64_t scale_row = 0;
      if constexpr (!kMx) {
        const int box = min(lane, 3);
        if (kGateUp) {
          scale_row = static_cast<int64_t>(item.expert) * 2 * args.gate_block_rows + (box & 1) * args.gate_block_rows +
                      min((item.n0 + (box >> 1) * kBoxRows) / 128, args.gate_block_rows - 1);
        } else {
          const int blocks_per_expert = (p.N + 127) / 128;
          scale_row = static_cast<int64_t>(item.expert) * blocks_per_expert +
                      min((item.n0 + box * kBoxRows) / 128, blocks_per_expert - 1);
        }
      }
      if (args.early_weights && step == 0) {
        // The weights do not depend on the kernel before (which writes this
        // GEMM's activation rows and scales): the first steps' slots are free.
        for (int ks = ks_begin; ks < min(ks_end, ks_begin + kSteps); ++ks, ++early_steps) {
          if (lane == 0) {
#pragma unroll
            for (int half = 0; half < 2; ++half) {
              const int slot = 2 * early_steps + half;
              mbarrier_arrive_expect_tx(slot_full(slot), kSlotBytes);
#pragma unroll
              for (int c = 0; c < 2; ++c)
                tma_load_2d(slot_tile(slot) + c * (kSlotBytes / 2), &weights, ks * kKStep, box_row(2 * c + half),
                            slot_full(slot));
            }
          }
        }
        grid_dependency_wait();
      }
      for (int ks = ks_begin; ks < ks_end; ++ks, ++step) {
        const int s = step % kSteps, phase = ((step / kSteps) - 1) & 1;
        // Half 0's weights as soon as its slot is free, then the step's rows and
        // scales, then half 1's weights (their slots free together).
        auto load_half = [&](int half) {
          const int slot = 2 * s + half;
          if (step < early_steps) return;  // asked for before the wait
          if (step >= kSteps) mbarrier_wait(slot_empty(slot), phase);
          if (lane == 0) {
            mbarrier_arrive_expect_tx(slot_full(slot), kSlotBytes);
#pragma unroll
            for (int c = 0; c < 2; ++c)
              tma_load_2d(slot_tile(slot) + c * (kSlotBytes / 2), &weights, ks * kKStep, box_row(2 * c + half),
                          slot_full(slot));
          }
        };
        load_half(0);
        if (step >= kSteps) mbarrier_wait(step_empty(s), phase);
        if constexpr (kRowsByTma) {
          // One box of the tile's 64 rows (rows past the tile's are dropped
          // at the stores, past the tensor's are zeros), on the step's
          // barrier besides the lanes' cp.async arrivals for the scales.
          if (lane == 0) {
            mbarrier_expect_tx(step_full(s), kABytes);
            tma_load_2d(a_tile(s), &rows, ks * kKStep, item.row0, step_full(s));
          }
        } else {
#pragma unroll
          for (int i = 0; i < kM * 8 / 32; ++i) {
            const int r = 4 * i + (lane >> 3), chunk = lane & 7, column = ks * kKStep + chunk * 16;
            const int64_t row = __shfl_sync(0xffffffffu, source[i / 8], r & 31);
            const bool valid = row >= 0 && column < p.K;
            cp_async_16(a_tile(s) + sw128_offset(r, chunk), valid ? p.a + row * p.K + column : p.a, valid);
          }
        }
        if constexpr (kMx) {
          // The step's 4 E8M0 bytes of activation rows lane, lane + 32, then of
          // the 512 weight rows by box (rows past the weights: zero).
          const auto* a_scales = static_cast<const uint8_t*>(p.a_scales);
          const auto* w_scales = static_cast<const uint8_t*>(p.w_scales);
          const int64_t weight_rows = static_cast<int64_t>(p.num_experts) * rows_per_expert;
#pragma unroll
          for (int h = 0; h < 2; ++h) {
            const bool valid = source[h] >= 0;
            cp_async_4(scale_tile(s) + (lane + 32 * h) * 4,
                       a_scales + (valid ? source[h] * args.scale_cols + ks * 4 : 0), valid);
          }
#pragma unroll 1  // (unrolled, all rows' addresses stay live across the K loop: producer spills)
          for (int box = 0; box < 4; ++box)
#pragma unroll
            for (int i = 0; i < kBoxRows / 32; ++i) {
              const int64_t y = box_row(box) + lane + 32 * i;
              cp_async_4(scale_tile(s) + kMxActivationScaleBytes + (box * kBoxRows + lane + 32 * i) * 4,
                         w_scales + (y < weight_rows ? y * args.scale_cols + ks * 4 : 0), y < weight_rows);
            }
        } else {
          // Activation rows lane and lane + 32, then the four boxes' weight scales.
          const auto* a_scales = static_cast<const float*>(p.a_scales);
          const auto* w_scales = static_cast<const float*>(p.w_scales);
#pragma unroll
          for (int h = 0; h < 2; ++h) {
            const bool valid = source[h] >= 0;
            cp_async_4(scale_tile(s) + (lane + 32 * h) * 4,
                       a_scales + (valid ? source[h] * args.scale_cols + ks : 0), valid);
          }
          if (lane < 4) cp_async_4(scale_tile(s) + (kM + lane) * 4, w_scales + scale_row * args.scale_cols + ks, true);
        }
        mbarrier_arrive_cp_async(step_full(s));
        load_half(1);
      }
    }
    cp_async_wait_group<0>();
    return;
  }

  setmaxnreg_inc<216>();
  // Consumer warpgroup c: rows 16 w + g (+ 8) of the tile; accumulator column
  // 8 i + 2 q (+ 1) is its weight row 8 i + 2 q (+ 1) (half 0's box, then half 1's).
  const int consumer = (warp_id >> 2) - 1, warp = warp_id & 3, g = lane >> 2, q = lane & 3;
  float acc[128], part[64];
  int step = 0;
  for (int index = blockIdx.x; index < num_items; index += gridDim.x) {
    const GemmItem item = grouped_gemm_item(offsets.expert_offsets, offsets.tile_offsets, p.num_experts, index / args.k_splits,
                                            args.num_n_tiles, columns_per_tile);
    const int ks_begin = index % args.k_splits * split_steps, ks_end = min(num_k_steps, ks_begin + split_steps);
#pragma unroll
    for (int i = 0; i < 128; ++i) acc[i] = 0.0f;
    for (int ks = ks_begin; ks < ks_end; ++ks, ++step) {
      const int s = step % kSteps, phase = (step / kSteps) & 1;
      mbarrier_wait(step_full(s), phase);
      fence_proxy_async_shared();  // the A rows came through cp.async (generic proxy)
      const unsigned char* scale_bytes = smem_raw + (scale_tile(s) - smem_u32(smem_raw));
      // Half h: wait for its weights, start its MMAs (kk: the 32-wide K slices, into `part`).
      auto mma = [&](int half, int kk, bool accumulate) {
        wgmma_m64n128k32_e4m3_ss(
            part, sw128_descriptor(a_tile(s) + kk * 32, 16, 1024),
            sw128_descriptor(slot_tile(2 * s + half) + consumer * (kSlotBytes / 2) + kk * 32, 16, 1024), accumulate);
      };
      // A half's slot is free once its last MMA completes; the step's rows and
      // scales once half 1's MMAs completed and the scales were read.
      auto release_slot = [&](int half) {
        if (lane == 0) mbarrier_arrive(slot_empty(2 * s + half));
      };
      auto release_step = [&] {
        if (lane == 0) mbarrier_arrive(step_empty(s));
      };
      if constexpr (kMx) {
        // One 32-wide slice at a time: acc += part x activation scale (row) x weight scale (column).
#pragma unroll
        for (int half = 0; half < 2; ++half) {
          mbarrier_wait(slot_full(2 * s + half), phase);
#pragma unroll
          for (int kk = 0; kk < kKStep / kMxGroup; ++kk) {
            wgmma_fence();
            mma(half, kk, false);
            wgmma_commit_group();
            wgmma_wait_group<0>();
            if (kk == kKStep / kMxGroup - 1) release_slot(half);
            float a_scale[2];
#pragma unroll
            for (int h = 0; h < 2; ++h) a_scale[h] = e8m0_to_float(scale_bytes[(warp * 16 + g + 8 * h) * 4 + kk]);
#pragma unroll
            for (int i = 0; i < 16; ++i)
#pragma unroll
              for (int j = 0; j < 2; ++j) {
                const int column = (2 * consumer + half) * kBoxRows + 8 * i + 2 * q + j;
                const float w_scale = e8m0_to_float(scale_bytes[kMxActivationScaleBytes + column * 4 + kk]);
#pragma unroll
                for (int h = 0; h < 2; ++h)
                  acc[64 * half + 4 * i + 2 * h + j] += part[4 * i + 2 * h + j] * a_scale[h] * w_scale;
              }
          }
        }
        release_step();
      } else {
        const float* scales = reinterpret_cast<const float*>(scale_bytes);
        const float a_scale[2] = {scales[warp * 16 + g], scales[warp * 16 + g + 8]};
        const float w_scale[2] = {scales[kM + 2 * consumer], scales[kM + 2 * consumer + 1]};
#pragma unroll
        for (int half = 0; half < 2; ++half) {
          mbarrier_wait(slot_full(2 * s + half), phase);
          wgmma_fence();
#pragma unroll
          for (int kk = 0; kk < kKStep / 32; ++kk) mma(half, kk, kk > 0);
          wgmma_commit_group();
          wgmma_wait_group<0>();
          release_slot(half);
          if (half == 1) release_step();  // the scales are in registers
          const float row_scale[2] = {a_scale[0] * w_scale[half], a_scale[1] * w_scale[half]};
#pragma unroll
          for (int i = 0; i < 64; ++i) acc[64 * half + i] += part[i] * row_scale[(i >> 1) & 1];
        }
      }
    }
    const int n_base = item.n0 + consumer * (kGateUp ? kBoxRows : 2 * kBoxRows);
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      const int r = warp * 16 + g + 8 * h;
      const bool live = r < item.rows;  // every lane calls the stores (they shuffle within quads)
      if constexpr (kGateUp) {
        const int64_t row = item.row0 + r;
        if constexpr (kNarrowOut) {
          store_silu_mul_fp8_row(static_cast<uint8_t*>(p.out) + row * p.N,
                                 args.out_scales + row * args.gate_block_rows + n_base / 128, acc, n_base, p.N, h, q,
                                 live);
        } else {
          store_silu_mul_row<16>(static_cast<bf16*>(p.out) + row * p.N, acc, n_base, p.N, h, q, live);
        }
      } else if constexpr (kSplitK) {
        add_f32_row(static_cast<float*>(p.out) + static_cast<int64_t>(item.row0 + r) * p.N, acc, n_base, p.N, h, q,
                    live);
      } else {
        store_down_row(p.out, kNarrowOut, item.row0 + r, p.N, acc, n_base, h, q, live);
      }
    }
  }
#endif
}

// A half-warp per (row, group of 128 columns), each lane 8 columns read with
// one 16-byte load where the columns allow (cols % 8 == 0, aligned rows); a
// warp takes 2 x kRounds groups per round, all of each half-warp's loads
// issued before any is reduced, and the grid strides over the groups. The
// division by the scale is divide_by_scale's. One
// group per warp with four 2-byte loads per lane streamed at ~1.1 TB/s at
// prefill sizes (4096 x 4096 and 4096 x 8192: 45 and 88 us, H200, ncu).
// With a row count on the device the grid covers `rows`, the kernel the live ones.
template <int kRounds>  // groups per half-warp per round
__global__ void quantize_fp8_groups_kernel(QuantizeFp8Params p) {
  constexpr int kColumns = 8;  // per lane
  const int groups = (p.cols + kGroup - 1) / kGroup;
  const int rows = p.live_rows != nullptr ? min(p.rows, *p.live_rows) : p.rows;
  const int64_t tasks = static_cast<int64_t>(rows) * groups;
  const int lane = threadIdx.x & 31, half = lane >> 4, sub = lane & 15;
  const bool vector = p.cols % kColumns == 0 && reinterpret_cast<uintptr_t>(p.in) % 16 == 0 &&
                      reinterpret_cast<uintptr_t>(p.out) % 8 == 0;
  const int64_t warps = static_cast<int64_t>(gridDim.x) * blockDim.x >> 5;
  for (int64_t first = ((static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x) >> 5) * 2 * kRounds;
       first < tasks; first += warps * 2 * kRounds) {  // warp-uniform: every lane shuffles
    float v[kRounds][kColumns];
    int64_t at[kRounds];  // this lane's first column in the matrix
    int col0[kRounds], row[kRounds], group[kRounds];
#pragma unroll
    for (int u = 0; u < kRounds; ++u) {
      const int64_t task = first + 2 * u + half;
      row[u] = static_cast<int>(task / groups), group[u] = static_cast<int>(task % groups);
      col0[u] = task < tasks ? group[u] * kGroup + sub * kColumns : p.cols;  // past the tasks: no columns
      at[u] = static_cast<int64_t>(row[u]) * p.cols + col0[u];
#pragma unroll
      for (int j = 0; j < kColumns; ++j) v[u][j] = 0.0f;
      if (vector) {
        if (col0[u] < p.cols) {
          const uint4 raw = *reinterpret_cast<const uint4*>(p.in + at[u]);
          const uint32_t words[4] = {raw.x, raw.y, raw.z, raw.w};
#pragma unroll
          for (int j = 0; j < 4; ++j) {
            const float2 pair = __bfloat1622float2(*reinterpret_cast<const __nv_bfloat162*>(&words[j]));
            v[u][2 * j] = pair.x, v[u][2 * j + 1] = pair.y;
          }
        }
      } else {
#pragma unroll
        for (int j = 0; j < kColumns; ++j)
          if (col0[u] + j < p.cols) v[u][j] = __bfloat162float(p.in[at[u] + j]);
      }
    }
#pragma unroll
    for (int u = 0; u < kRounds; ++u) {
      float amax = 0.0f;
#pragma unroll
      for (int j = 0; j < kColumns; ++j) amax = fmaxf(amax, fabsf(v[u][j]));
#pragma unroll
      for (int offset = 8; offset > 0; offset >>= 1) amax = fmaxf(amax, __shfl_xor_sync(0xffffffffu, amax, offset));
      const float scale = fmaxf(amax, 1e-10f) / 448.0f, inv = 1.0f / scale;
      const uint32_t words[2] = {  // columns col0 .. col0 + 7, E4M3, the first in the low byte
          e4m3x4(v[u][0], v[u][1], v[u][2], v[u][3], scale, inv), e4m3x4(v[u][4], v[u][5], v[u][6], v[u][7], scale, inv)};
      if (col0[u] >= p.cols) continue;
      if (vector) {
        *reinterpret_cast<uint2*>(p.out + at[u]) = make_uint2(words[0], words[1]);
      } else {
#pragma unroll
        for (int j = 0; j < kColumns; ++j)
          if (col0[u] + j < p.cols) p.out[at[u] + j] = static_cast<uint8_t>(words[j / 4] >> (8 * (j % 4)));
      }
      if (sub == 0 && p.scales != nullptr)
        p.scales[p.scales_by_group ? static_cast<int64_t>(group[u]) * p.rows + row[u]
                                   : static_cast<int64_t>(row[u]) * groups + group[u]] = scale;
      if (p.dequantized != nullptr) {
#pragma unroll
        for (int j = 0; j < kColumns; ++j) {
          if (col0[u] + j < p.cols) {
            const auto e4m3 = static_cast<__nv_fp8_storage_t>(words[j / 4] >> (8 * (j % 4)));
            const float q = __half2float(__half(__nv_cvt_fp8_to_halfraw(e4m3, __NV_E4M3)));
            p.dequantized[at[u] + j] = __float2bfloat16(q * scale);
          }
        }
      }
    }
  }
}

// MXFP8 activations: one warp per (row, 32 columns), a lane per column. The
// OCP rule of ops/quant.h: scale 2^(floor(log2 amax) - 8) as an E8M0 code
// (0 for an all-zero group, 255 when amax is not finite), elements
// e4m3(x / scale) saturated.
__global__ void quantize_mxfp8_kernel(QuantizeMxfp8Params p) {
  const int groups = (p.cols + kMxGroup - 1) / kMxGroup;
  const int64_t warp = (static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x) >> 5;
  const int lane = threadIdx.x & 31;
  if (warp >= static_cast<int64_t>(p.rows) * groups) return;
  const int64_t row = warp / groups;
  const int col = static_cast<int>(warp % groups) * kMxGroup + lane;
  const float v = col < p.cols ? __bfloat162float(p.in[row * p.cols + col]) : 0.0f;
  float amax = fabsf(v);
  for (int offset = 16; offset > 0; offset >>= 1) amax = fmaxf(amax, __shfl_xor_sync(0xffffffffu, amax, offset));
  int code = 0;
  if (!isfinite(amax)) {
    code = 255;
  } else if (amax > 0.0f) {
    int exponent = 0;
    frexpf(amax, &exponent);  // amax = m * 2^exponent, m in [0.5, 1)
    code = min(max(exponent - 1 - 8, -127), 127) + 127;
  }
  if (col < p.cols) {
    const float element = code == 255 ? v : ldexpf(v, 127 - code);
    const auto e4m3 = static_cast<uint8_t>(__nv_cvt_float_to_fp8(element, __NV_SATFINITE, __NV_E4M3));
    p.out[row * p.cols + col] = e4m3;
    if (p.dequantized != nullptr) {
      const float q = __half2float(__half(__nv_cvt_fp8_to_halfraw(e4m3, __NV_E4M3)));
      p.dequantized[row * p.cols + col] = __float2bfloat16(code == 255 ? NAN : q * e8m0_to_float(code));
    }
  }
  if (lane == 0 && p.scales != nullptr) p.scales[row * groups + col / kMxGroup] = static_cast<uint8_t>(code);
}

// The instantiation for a launch (gate_up gathers its rows and never splits
// K; split-K adds f32; MXFP8 has no E4M3 output and no rows by tensor copies).
template <bool kMx>
auto pick_fp8_kernel(bool gate_up, bool rows_by_tma, bool split_k, bool narrow_out) {
  if (gate_up)
    return narrow_out ? fp8_grouped_gemm_kernel<true, kMx, false, false, !kMx>
                      : fp8_grouped_gemm_kernel<true, kMx, false, false, false>;
  if (split_k)
    return rows_by_tma ? fp8_grouped_gemm_kernel<false, kMx, !kMx, true, false>
                       : fp8_grouped_gemm_kernel<false, kMx, false, true, false>;
  if (rows_by_tma)
    return narrow_out ? fp8_grouped_gemm_kernel<false, kMx, !kMx, false, true>
                      : fp8_grouped_gemm_kernel<false, kMx, !kMx, false, false>;
  return narrow_out ? fp8_grouped_gemm_kernel<false, kMx, false, false, true>
                    : fp8_grouped_gemm_kernel<false, kMx, false, false, false>;
}

template <bool kMx>
cudaError_t launch_fp8_gemm(Fp8GemmArgs args, const void* w, int max_tiles, bool gate_up, int a_rows,
                            cudaStream_t stream) {
  if (!hopper_kernels_available()) return cudaErrorNotSupported;
  if (args.K % (kMx ? 128 : 16) != 0) return cudaErrorInvalidValue;
  if (args.k_splits < 1 || (gate_up && args.k_splits > 1)) return cudaErrorInvalidValue;
  if (args.bf16_out && args.k_splits > 1) return cudaErrorInvalidValue;  // the split shares add up in f32
  if (args.early_weights && (gate_up || args.k_splits > 1)) return cudaErrorInvalidValue;
  if (args.out_scales != nullptr && (kMx || !gate_up || args.N % 16 != 0)) return cudaErrorInvalidValue;
  if (max_tiles == 0) return cudaSuccess;
  const uint64_t weight_rows = static_cast<uint64_t>(args.num_experts) * (gate_up ? 2 * args.N : args.N);
  CUtensorMap map;
  cudaError_t error = make_tensor_map_2d(&map, w, 1, weight_rows, args.K, static_cast<uint64_t>(args.K),
                                         kBoxRows, kKStep);
  if (error != cudaSuccess) return error;
  // Contiguous activation rows (down, dense projections) by tensor copies
  // where the caller says how many `a` has (fp8-block; MXFP8 keeps cp.async).
  // Measured on an H200 (2026-12-04, alternated with cp.async in one call):
  // the FP8 decode step 0.3-1.6% faster, the GEMMs at 1-8 rows per expert +0.3
  // to +0.6 points of the copy bandwidth, at 64 no change. gate_up's
  // gathered rows as boxes of one row each lost 12 points at 64 rows per
  // expert (64 tensor copies per step), so they stay on cp.async.
  CUtensorMap rows_map{};
  const bool rows_by_tma = !kMx && a_rows > 0 && args.K % 16 == 0 && args.sorted_token == nullptr;
  if (rows_by_tma) {
    error = make_tensor_map_2d(&rows_map, args.a, 1, static_cast<uint64_t>(a_rows), args.K, args.K, kM, kKStep);
    if (error != cudaSuccess) return error;
  }
  const int blocks = std::min(multiprocessor_count(), args.num_n_tiles * max_tiles * args.k_splits);
  auto kernel = pick_fp8_kernel<kMx>(gate_up, rows_by_tma, args.k_splits > 1,
                                     gate_up ? args.out_scales != nullptr : args.bf16_out);
  const int smem_bytes = kSmemBytes<kMx> + offsets_smem_bytes(args.num_experts);
  error = allow_dynamic_smem(kernel, smem_bytes);
  if (error != cudaSuccess) return error;
  if (!args.early_weights) {
    kernel<<<blocks, kThreads, smem_bytes, stream>>>(map, args, rows_map);
    return cudaGetLastError();
  }
  cudaLaunchAttribute attribute{};
  attribute.id = cudaLaunchAttributeProgrammaticStreamSerialization;
  attribute.val.programmaticStreamSerializationAllowed = 1;
  cudaLaunchConfig_t config{};
  config.gridDim = dim3(blocks);
  config.blockDim = dim3(kThreads);
  config.dynamicSmemBytes = smem_bytes;
  config.stream = stream;
  config.attrs = &attribute;
  config.numAttrs = 1;
  return cudaLaunchKernelEx(&config, kernel, map, args, rows_map);
}

int fp8_n_tiles(int N, bool gate_up) {
  const int columns_per_tile = gate_up ? kWeightRows / 2 : kWeightRows;
  return (N + columns_per_tile - 1) / columns_per_tile;
}

}  // namespace

int fp8_gemm_k_splits(int N, int K, int row_tiles) {
  const int items = fp8_n_tiles(N, false) * row_tiles, steps = (K + kKStep - 1) / kKStep;
  const int sms = multiprocessor_count();
  if (steps < 8) return 1;
  // Each split at least 4 K-steps (512 columns). The time goes as the waves
  // of items times the K-steps per item; every split adds atomics, so take
  // the fewest splits within 10% of the best (qkv at 256 tokens without
  // cuBLASLt: 72 items on 132 SMs, 3 splits).
  auto cost = [&](int splits) {
    return static_cast<int64_t>((items * splits + sms - 1) / sms) * ((steps + splits - 1) / splits);
  };
  int64_t best = cost(1);
  for (int splits = 2; splits <= steps / 4; ++splits) best = std::min(best, cost(splits));
  for (int splits = 1;; ++splits) {
    if (cost(splits) * 10 <= best * 11) {
      const int split_steps = (steps + splits - 1) / splits;
      return (steps + split_steps - 1) / split_steps;  // none empty
    }
  }
}

cudaError_t quantize_fp8_groups(const QuantizeFp8Params& p, cudaStream_t stream) {
  if (p.rows == 0 || p.cols == 0) return cudaSuccess;
  const int64_t tasks = static_cast<int64_t>(p.rows) * ((p.cols + kGroup - 1) / kGroup);
  // Blocks of two warps, a grid of at most 32 per SM. A decode step's few
  // groups (up to 128 per SM) take one group per half-warp, so the launch is
  // one round of loads; prefill sizes two per half-warp per round. (With two
  // per half-warp at decode sizes a 64 x 4096 launch took 5.1-5.4 us against
  // 4.2-4.7 for the one-group-per-warp kernel before; H200, ncu, 2026-12-03.)
  const int64_t max_blocks = int64_t{32} * multiprocessor_count();
  if (tasks <= 4 * max_blocks) {
    quantize_fp8_groups_kernel<1><<<static_cast<unsigned>((tasks + 3) / 4), 64, 0, stream>>>(p);
  } else {
    quantize_fp8_groups_kernel<2><<<static_cast<unsigned>(std::min((tasks + 7) / 8, max_blocks)), 64, 0, stream>>>(p);
  }
  return cudaGetLastError();
}

cudaError_t quantize_mxfp8(const QuantizeMxfp8Params& p, cudaStream_t stream) {
  if (p.rows == 0 || p.cols == 0) return cudaSuccess;
  const int64_t warps = static_cast<int64_t>(p.rows) * ((p.cols + kMxGroup - 1) / kMxGroup);
  quantize_mxfp8_kernel<<<static_cast<unsigned>((warps * 32 + 255) / 256), 256, 0, stream>>>(p);
  return cudaGetLastError();
}

cudaError_t fp8_grouped_gemm(const Fp8GroupedGemmParams& p, cudaStream_t stream) {
  Fp8GemmArgs args{p.a, p.a_scales, p.sorted_token, p.w_scales, p.expert_offsets, p.tile_offsets, p.out, p.N,
                   p.K, p.num_experts, fp8_n_tiles(p.N, p.gate_up), (p.K + kGroup - 1) / kGroup,
                   (p.N + 127) / 128, p.k_splits};
  args.bf16_out = p.bf16_out;
  args.out_scales = p.out_scales;
  args.early_weights = p.early_weights;
  return launch_fp8_gemm<false>(args, p.w, p.max_tiles, p.gate_up, p.a_rows, stream);
}

cudaError_t mxfp8_grouped_gemm(const Mxfp8GroupedGemmParams& p, cudaStream_t stream) {
  Fp8GemmArgs args{p.a, p.a_scales, p.sorted_token, p.w_scales, p.expert_offsets, p.tile_offsets, p.out, p.N,
                   p.K, p.num_experts, fp8_n_tiles(p.N, p.gate_up), p.K / kMxGroup, 0, p.k_splits};
  args.bf16_out = p.bf16_out;
  return launch_fp8_gemm<true>(args, p.w, p.max_tiles, p.gate_up, 0, stream);
}

}  // namespace moe::ops::cuda
