// The MXFP8 grouped GEMM of the MoE experts on Blackwell (sm_100a): 5th-gen
// tensor cores (tcgen05) with block scaling, so the E8M0 scales are applied by
// the MMA itself instead of by per-32 promotion in registers as on Hopper.
// COMPILED, NEVER RUN: no Blackwell GPU has executed this file; it is not wired
// into the model. It computes exactly mxfp8_grouped_gemm's function (kernels.h,
// Mxfp8GroupedGemmParams, same tile_offsets of kGroupedGemmTileRows rows), so
// the MoE layer could swap it in once tests/gpu/ops_cuda_test.cc passes on a B200.
//
// Algorithm. At decode sizes an expert gets a handful of rows, while the
// block-scaled tcgen05 MMA has M = 128 (one CTA), so the product is computed
// transposed ("swap AB"): the weight rows are the MMA's M, the tile's permuted
// token rows its N:
//   D[128 weight rows, N tokens] (+)= (W * sf_w)[128, 32] . ((X * sf_x)[N, 32])^T
// where N is the tile's row count rounded up to 16 (16..64): the instruction
// descriptor is a register, so a 3-row tile does not pay for 64. A work item is
// one row tile (<= 64 rows of one expert) x 256 weight rows, as two MMAs of
// M = 128 into two TMEM accumulators: gate_up takes the gate rows n0..n0+127 and
// the up rows n0..n0+127, so one TMEM lane holds the gate and the up value of
// the same output column and the SiLU-multiply needs no exchange; down takes
// output columns n0..n0+255. Items are spread over a persistent grid as in the
// Hopper kernels (grouped_gemm.cuh).
//
// Pipeline: 192 threads, one CTA per SM, kStages = 5 shared-memory stages of
// K = 128 (one 128-byte swizzle row per operand row, four MX blocks).
//   warp 0, producer: per stage, two TMA boxes of 128 weight rows x 128 bytes,
//     cp.async gathers of the 64 token rows into the same 128-byte-swizzled
//     K-major layout, and cp.async of the 4 E8M0 bytes of every weight row and
//     token row into the layout tcgen05.cp reads (below).
//   warp 1, MMA: allocates the 512 TMEM columns; one thread copies the stage's
//     scale factors to TMEM (three tcgen05.cp 32x128b.warpx4; copy -> MMA is
//     ordered by the tcgen05 pipeline) and issues 4 K-slices x 2 halves
//     tcgen05.mma kind::mxf8f6f4.block_scale, the slice's scale byte selected by
//     the SF ids of the instruction descriptor; tcgen05.commit frees the stage,
//     a last commit hands the accumulator to the epilogue. Two accumulator
//     buffers, so the MMAs of the next item run while the epilogue drains one.
//   warps 2..5, epilogue: warp w reads TMEM lanes 32 (w % 4).. (weight rows) with
//     tcgen05.ld, releases the buffer, then writes bf16(silu(gate) * up) or f32.
//
// Scale factors. tcgen05.cp .32x128b.warpx4 copies 32 rows of 16 bytes into
// TMEM lanes 0..31, 4 columns, replicated into all four 32-lane quarters (the
// MMA requires the replication). Row m (0..127) of an operand block keeps its
// 4 bytes (K-blocks 0..3 of the stage) at byte (m % 32) * 16 + (m / 32) * 4, so
// in TMEM lane m % 32 (+ 32 q), column m / 32, byte k: the MMA with SF id k
// reads there the scale of its row m (A: weights) or column n (B: tokens).
// TMEM columns: [0, 256) accumulators, [buffer][half] x 64 f32 columns;
// [256, 336) scale factors, 16 columns per stage (weight halves at +0 and +4,
// tokens at +8), one slot per shared-memory stage, so a copy never overwrites
// scales that an MMA still reads (MMA -> copy is not ordered by the pipeline).
//
// Floor on a B200 (HBM3e 8 TB/s, ~4.5 PFLOP/s dense MXFP8, 148 SMs): decode
// reads each touched expert's weights once; Qwen3-235B-A22B: 128 experts x
// 3 x 1536 x 4096 E4M3 bytes = 2.42 GB per MoE layer, + 1/32 for scales =
// 2.49 GB, 0.31 ms at 8 TB/s when the batch touches every expert. The MMAs do
// 2 FLOPs per weight byte and token row, so they stay under the memory time up
// to ~280 rows per expert (4.5e15 / 8e12 / 2). Per SM: 54 GB/s = ~28 B/clk at
// 1.9 GHz, a stage's 32 KB of weights every ~1,150 clk against <= 256 clk for
// its 8 MMAs (128 x 64 x 32 at ~8K MAC/clk/SM): the loads decide. Little's law
// wants ~54 KB in flight per SM at 1 us latency; four stages ahead hold ~166 KB.
// Prefill sizes want 128- or 256-token tiles (N = 256, 2-CTA MMAs): not here.
#include <algorithm>
#include <cstdint>
#include <cuda_bf16.h>

#include "ops/cuda/grouped_gemm.cuh"
#include "ops/cuda/kernels.h"
#include "ops/cuda/tensor_map.h"
#include "ops/cuda/wgmma.cuh"  // smem_u32, cp.async, mbarrier, 128-byte swizzle (plain PTX, valid on sm_100)

// tcgen05 exists only in the arch-specific sm_100a target (nvcc defines
// __CUDA_ARCH_FEAT_SM100_ALL for it); the sm_90a build compiles an empty kernel.
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 1000 && defined(__CUDA_ARCH_FEAT_SM100_ALL)
#define MOE_SM100A_DEVICE 1
#else
#define MOE_SM100A_DEVICE 0
#endif

namespace moe::ops::cuda {
namespace {

constexpr int kTileRows = kGroupedGemmTileRows;  // token rows per item: the MMA's N, at most
constexpr int kHalfRows = 128;                   // weight rows per MMA: M
constexpr int kKStep = 128;                      // K per stage (FP8: 128 bytes)
constexpr int kMxBlock = 32;
constexpr int kStages = 5;
constexpr int kThreads = 192;

// Shared memory, 1024-aligned base: weight tiles, token tiles, scale factors
// (each per stage), barriers, the TMEM address.
constexpr int kHalfBytes = kHalfRows * kKStep;      // 16 KB: one TMA box
constexpr int kWeightBytes = 2 * kHalfBytes;
constexpr int kTokenBytes = kTileRows * kKStep;     // 8 KB
constexpr int kSfAtomBytes = 512;                   // 128 rows x 4 bytes, one tcgen05.cp
constexpr int kSfBytes = 3 * kSfAtomBytes;          // weight halves 0, 1, tokens
constexpr int kTokenBase = kStages * kWeightBytes;
constexpr int kSfBase = kTokenBase + kStages * kTokenBytes;
constexpr int kBarrierBase = kSfBase + kStages * kSfBytes;
constexpr int kNumBarriers = 2 * kStages + 4;       // full, empty per stage; acc_full, acc_empty per buffer
constexpr int kTmemSlot = kBarrierBase + 8 * kNumBarriers;
constexpr int kSmemBytes = kTmemSlot + 16 + 1024;  // + alignment slack
static_assert(kTokenBase % 1024 == 0 && kSfBase % 1024 == 0, "swizzle atoms are 1024-aligned");
static_assert(kSmemBytes <= 232448, "B200 shared memory per block");

// Tensor memory columns (32-bit cells; lane = bits 31..16 of an address).
constexpr uint32_t kAccColumns = kTileRows;           // one accumulator half: 64 tokens
constexpr uint32_t kSfColumnBase = 4 * kAccColumns;   // after [2 buffers][2 halves]
constexpr uint32_t kSfColumnsPerStage = 16;
constexpr uint32_t kTmemColumns = 512;                // a power of two >= 32
static_assert(kSfColumnBase + kStages * kSfColumnsPerStage <= kTmemColumns, "TMEM budget");

// Instruction descriptor of tcgen05.mma .kind::mxf8f6f4 (PTX ISA, "Instruction
// descriptor format for .kind::mxf8f6f4"): bits 4-5 B scale-factor id, 7-9 /
// 10-12 A / B type (E4M3 = 0), 15 / 16 transpose (0: K-major), 17-22 N >> 3,
// 23 scale type (UE8M0 = 1), 27-28 M >> 7, 29-30 A scale-factor id.
constexpr uint32_t mxf8_instr_desc(uint32_t n, uint32_t sf_id) {
  return (sf_id << 4) | ((n >> 3) << 17) | (1u << 23) | ((uint32_t{kHalfRows} >> 7) << 27) | (sf_id << 29);
}
static_assert(mxf8_instr_desc(64, 0) == 0x08900000u && mxf8_instr_desc(16, 3) == 0x68840030u, "descriptor bits");

struct Sm100GemmArgs {
  Mxfp8GroupedGemmParams p;
  int num_n_tiles;
  int scale_cols;  // K / 32
};

#if MOE_SM100A_DEVICE
constexpr int kMmaK = 32;                       // K per MMA = one MX block
constexpr int kProducerWarp = 0, kMmaWarp = 1;  // warps 2..5: the epilogue
constexpr int kEpilogueWarps = 4;

// Byte offset of row m's 4 scale bytes inside a tcgen05.cp 32x128b atom.
__device__ __forceinline__ uint32_t sf_offset(int m) { return static_cast<uint32_t>((m % 32) * 16 + (m / 32) * 4); }

// Shared-memory matrix descriptor (PTX ISA, tcgen05 "Shared memory descriptor"):
// start >> 4 (bits 0-13), LBO >> 4 (16-29), SBO >> 4 (32-45), 0b001 (46-48),
// base offset 0 (atoms 1024-aligned), swizzle mode (61-63: 2 = 128-byte).
// K-major, 128-byte swizzle: 8-row atoms of 1024 bytes (SBO), LBO unused (1).
__device__ __forceinline__ uint64_t sw128_kmajor_desc(uint32_t smem_addr) {
  return ((smem_addr & 0x3FFFFu) >> 4) | (uint64_t{1} << 16) | (uint64_t{1024 >> 4} << 32) | (uint64_t{1} << 46) |
         (uint64_t{2} << 61);
}
// A scale-factor atom for tcgen05.cp: no swizzle, 8 rows of 16 bytes per core
// matrix (SBO 128 bytes), one core matrix along K (LBO 0).
__device__ __forceinline__ uint64_t sf_atom_desc(uint32_t smem_addr) {
  return ((smem_addr & 0x3FFFFu) >> 4) | (uint64_t{128 >> 4} << 32) | (uint64_t{1} << 46);
}

__device__ __forceinline__ void fence_barrier_init() {
  asm volatile("fence.mbarrier_init.release.cluster;\n" ::: "memory");
}
__device__ __forceinline__ void fence_async_shared() { asm volatile("fence.proxy.async.shared::cta;\n" ::: "memory"); }
__device__ __forceinline__ void expect_tx(uint32_t bar, uint32_t bytes) {
  asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;\n" ::"r"(bar), "r"(bytes) : "memory");
}
__device__ __forceinline__ void tma_load_box(uint32_t dst, const CUtensorMap* map, int x, int y, uint32_t bar) {
  asm volatile(
      "cp.async.bulk.tensor.2d.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1, {%2, %3}], [%4];\n" ::"r"(dst),
      "l"(map), "r"(x), "r"(y), "r"(bar)
      : "memory");
}

// Tensor memory allocation: one warp, .sync.aligned; the address lands in shared memory.
__device__ __forceinline__ void tmem_alloc(uint32_t smem_slot, uint32_t columns) {
  asm volatile("tcgen05.alloc.cta_group::1.sync.aligned.shared::cta.b32 [%0], %1;\n" ::"r"(smem_slot), "r"(columns)
               : "memory");
  asm volatile("tcgen05.relinquish_alloc_permit.cta_group::1.sync.aligned;\n" ::: "memory");
}
__device__ __forceinline__ void tmem_dealloc(uint32_t taddr, uint32_t columns) {
  asm volatile("tcgen05.dealloc.cta_group::1.sync.aligned.b32 %0, %1;\n" ::"r"(taddr), "r"(columns) : "memory");
}
// Order tcgen05 operations across a thread synchronisation (barrier, mbarrier).
__device__ __forceinline__ void tcgen05_before_sync() { asm volatile("tcgen05.fence::before_thread_sync;\n" ::: "memory"); }
__device__ __forceinline__ void tcgen05_after_sync() { asm volatile("tcgen05.fence::after_thread_sync;\n" ::: "memory"); }

// 32 lanes x 128 bits of shared memory to TMEM lanes 0..31 (4 columns from
// `taddr`), replicated into the other three lane quarters.
__device__ __forceinline__ void tmem_copy_sf(uint32_t taddr, uint64_t smem_desc) {
  asm volatile("tcgen05.cp.cta_group::1.32x128b.warpx4 [%0], %1;\n" ::"r"(taddr), "l"(smem_desc) : "memory");
}
// D[128, N] (+)= (A * sf_a) . (B * sf_b)^T, E4M3 operands, UE8M0 scales per 32 along K.
__device__ __forceinline__ void mma_mxf8(uint32_t d_tmem, uint64_t a_desc, uint64_t b_desc, uint32_t idesc,
                                         uint32_t sfa_tmem, uint32_t sfb_tmem, bool accumulate) {
  asm volatile(
      "{\n.reg .pred p;\nsetp.ne.b32 p, %6, 0;\n"
      "tcgen05.mma.cta_group::1.kind::mxf8f6f4.block_scale.scale_vec::1X [%0], %1, %2, %3, [%4], [%5], p;\n}\n" ::"r"(
          d_tmem),
      "l"(a_desc), "l"(b_desc), "r"(idesc), "r"(sfa_tmem), "r"(sfb_tmem), "r"(accumulate ? 1u : 0u)
      : "memory");
}
// Arrives once on `bar` when every tcgen05 operation this thread issued before has completed.
__device__ __forceinline__ void tmem_commit(uint32_t bar) {
  asm volatile("tcgen05.commit.cta_group::1.mbarrier::arrive::one.shared::cluster.b64 [%0];\n" ::"r"(bar) : "memory");
}
// Columns [c, c + 32) of this warp's 32 lanes at two addresses, and the wait in
// the same statement, so nothing can read the registers before they landed.
__device__ __forceinline__ void tmem_load_2x32(uint32_t taddr_a, uint32_t taddr_b, uint32_t (&a)[32],
                                               uint32_t (&b)[32]) {
  asm volatile(
      "tcgen05.ld.sync.aligned.32x32b.x32.b32 {%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, "
      "%16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31}, [%64];\n"
      "tcgen05.ld.sync.aligned.32x32b.x32.b32 {%32, %33, %34, %35, %36, %37, %38, %39, %40, %41, %42, %43, %44, %45, "
      "%46, %47, %48, %49, %50, %51, %52, %53, %54, %55, %56, %57, %58, %59, %60, %61, %62, %63}, [%65];\n"
      "tcgen05.wait::ld.sync.aligned;\n"
      : "=r"(a[0]), "=r"(a[1]), "=r"(a[2]), "=r"(a[3]), "=r"(a[4]), "=r"(a[5]), "=r"(a[6]), "=r"(a[7]), "=r"(a[8]),
        "=r"(a[9]), "=r"(a[10]), "=r"(a[11]), "=r"(a[12]), "=r"(a[13]), "=r"(a[14]), "=r"(a[15]), "=r"(a[16]),
        "=r"(a[17]), "=r"(a[18]), "=r"(a[19]), "=r"(a[20]), "=r"(a[21]), "=r"(a[22]), "=r"(a[23]), "=r"(a[24]),
        "=r"(a[25]), "=r"(a[26]), "=r"(a[27]), "=r"(a[28]), "=r"(a[29]), "=r"(a[30]), "=r"(a[31]), "=r"(b[0]),
        "=r"(b[1]), "=r"(b[2]), "=r"(b[3]), "=r"(b[4]), "=r"(b[5]), "=r"(b[6]), "=r"(b[7]), "=r"(b[8]), "=r"(b[9]),
        "=r"(b[10]), "=r"(b[11]), "=r"(b[12]), "=r"(b[13]), "=r"(b[14]), "=r"(b[15]), "=r"(b[16]), "=r"(b[17]),
        "=r"(b[18]), "=r"(b[19]), "=r"(b[20]), "=r"(b[21]), "=r"(b[22]), "=r"(b[23]), "=r"(b[24]), "=r"(b[25]),
        "=r"(b[26]), "=r"(b[27]), "=r"(b[28]), "=r"(b[29]), "=r"(b[30]), "=r"(b[31])
      : "r"(taddr_a), "r"(taddr_b)
      : "memory");
}

// Shared-memory addresses of the pipeline (1024-aligned base).
struct Smem {
  uint32_t base;
  __device__ uint32_t weights(int stage) const { return base + stage * kWeightBytes; }
  __device__ uint32_t tokens(int stage) const { return base + kTokenBase + stage * kTokenBytes; }
  __device__ uint32_t sf(int stage) const { return base + kSfBase + stage * kSfBytes; }
  __device__ uint32_t full(int stage) const { return base + kBarrierBase + 8 * stage; }
  __device__ uint32_t empty(int stage) const { return base + kBarrierBase + 8 * (kStages + stage); }
  __device__ uint32_t acc_full(int buffer) const { return base + kBarrierBase + 8 * (2 * kStages + buffer); }
  __device__ uint32_t acc_empty(int buffer) const { return base + kBarrierBase + 8 * (2 * kStages + 2 + buffer); }
};

template <bool kGateUp>
__device__ __forceinline__ GemmItem sm100_item(const Sm100GemmArgs& args, int index) {
  const Mxfp8GroupedGemmParams& p = args.p;
  return grouped_gemm_item(p.expert_offsets, p.tile_offsets, p.num_experts, index, args.num_n_tiles,
                           kGateUp ? kHalfRows : 2 * kHalfRows);
}

// Warp 0: fills stage after stage; every lane issues cp.async, lane 0 the TMA.
template <bool kGateUp>
__device__ void produce(const CUtensorMap* weights, const Sm100GemmArgs& args, const Smem& s, int num_items) {
  const Mxfp8GroupedGemmParams& p = args.p;
  const int lane = threadIdx.x & 31, num_k_steps = p.K / kKStep;
  const int64_t rows_per_expert = kGateUp ? 2 * p.N : p.N;
  const int64_t weight_rows = p.num_experts * rows_per_expert;
  int step = 0;
  for (int index = blockIdx.x; index < num_items; index += gridDim.x) {
    const GemmItem item = sm100_item<kGateUp>(args, index);
    int64_t source[2];  // the source rows of token rows lane and lane + 32 (-1: past the tile)
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      const int r = lane + 32 * h;
      source[h] = r >= item.rows ? -1 : kGateUp ? p.sorted_token[item.row0 + r] : item.row0 + r;
    }
    const int64_t first = item.expert * rows_per_expert + item.n0;  // the halves' first weight rows:
    const int64_t half_row[2] = {first, kGateUp ? first + p.N : first + kHalfRows};  // gate | up, or 2 x 128 columns
    for (int ks = 0; ks < num_k_steps; ++ks, ++step) {
      const int stage = step % kStages;
      if (step >= kStages) mbarrier_wait(s.empty(stage), ((step / kStages) - 1) & 1);
      if (lane == 0) {
        expect_tx(s.full(stage), kWeightBytes);
        for (int h = 0; h < 2; ++h)
          tma_load_box(s.weights(stage) + h * kHalfBytes, weights, ks * kKStep, static_cast<int>(half_row[h]),
                       s.full(stage));
      }
#pragma unroll
      for (int i = 0; i < kTileRows * 8 / 32; ++i) {  // 64 rows x 8 chunks of 16 bytes
        const int r = 4 * i + (lane >> 3), chunk = lane & 7;
        const int64_t row = __shfl_sync(0xffffffffu, source[i / 8], r & 31);
        const bool valid = row >= 0;
        cp_async_16(s.tokens(stage) + sw128_offset(r, chunk), valid ? p.a + row * p.K + ks * kKStep + chunk * 16 : p.a,
                    valid);
      }
      // The step's 4 E8M0 bytes (K-blocks 4 ks .. 4 ks + 3) of each weight row, then of each token row.
#pragma unroll
      for (int i = 0; i < 2 * kHalfRows / 32; ++i) {
        const int h = i / 4, m = lane + 32 * (i % 4);
        const int64_t y = half_row[h] + m;
        const bool valid = y < weight_rows;
        cp_async_4(s.sf(stage) + h * kSfAtomBytes + sf_offset(m),
                   valid ? p.w_scales + y * args.scale_cols + ks * 4 : p.w_scales, valid);
      }
#pragma unroll
      for (int h = 0; h < 2; ++h) {
        const bool valid = source[h] >= 0;
        cp_async_4(s.sf(stage) + 2 * kSfAtomBytes + sf_offset(lane + 32 * h),
                   valid ? p.a_scales + source[h] * args.scale_cols + ks * 4 : p.a_scales, valid);
      }
      mbarrier_arrive_cp_async(s.full(stage));
    }
  }
  cp_async_wait_group<0>();
}

// Warp 1, one thread: scale factors to TMEM and the MMAs, stage after stage.
template <bool kGateUp>
__device__ void issue_mmas(const Sm100GemmArgs& args, const Smem& s, uint32_t tmem, int num_items) {
  const int num_k_steps = args.p.K / kKStep;
  int step = 0, local = 0;
  for (int index = blockIdx.x; index < num_items; index += gridDim.x, ++local) {
    const GemmItem item = sm100_item<kGateUp>(args, index);
    const int buffer = local & 1;
    if (local >= 2) mbarrier_wait(s.acc_empty(buffer), ((local >> 1) - 1) & 1);
    tcgen05_after_sync();
    const uint32_t n = item.rows >= kTileRows ? kTileRows : (item.rows + 15) & ~15;  // M = 128 takes N % 16 == 0
    const uint32_t acc = tmem + buffer * 2 * kAccColumns;
    for (int ks = 0; ks < num_k_steps; ++ks, ++step) {
      const int stage = step % kStages;
      mbarrier_wait(s.full(stage), (step / kStages) & 1);
      fence_async_shared();  // token rows and scales came through cp.async (generic proxy)
      tcgen05_after_sync();
      const uint32_t sf = tmem + kSfColumnBase + stage * kSfColumnsPerStage;
#pragma unroll
      for (int atom = 0; atom < 3; ++atom) tmem_copy_sf(sf + 4 * atom, sf_atom_desc(s.sf(stage) + atom * kSfAtomBytes));
#pragma unroll
      for (int kk = 0; kk < kKStep / kMmaK; ++kk) {
        const uint32_t idesc = mxf8_instr_desc(n, kk);
        const uint64_t b_desc = sw128_kmajor_desc(s.tokens(stage) + kk * kMmaK);
#pragma unroll
        for (int h = 0; h < 2; ++h)
          mma_mxf8(acc + h * kAccColumns, sw128_kmajor_desc(s.weights(stage) + h * kHalfBytes + kk * kMmaK), b_desc,
                   idesc, sf + 4 * h, sf + 8, ks > 0 || kk > 0);
      }
      tmem_commit(s.empty(stage));
    }
    tmem_commit(s.acc_full(buffer));
  }
}

// Warps 2..5: warp w owns TMEM lanes 32 (w % 4) .. + 31, i.e. weight row
// `row` of both halves, and all the item's tokens (columns).
template <bool kGateUp>
__device__ void drain_epilogue(const Sm100GemmArgs& args, const Smem& s, uint32_t tmem, int num_items) {
  const Mxfp8GroupedGemmParams& p = args.p;
  const int quarter = (threadIdx.x >> 5) & 3, row = 32 * quarter + (threadIdx.x & 31);
  const uint32_t lanes = tmem + (static_cast<uint32_t>(32 * quarter) << 16);
  int local = 0;
  for (int index = blockIdx.x; index < num_items; index += gridDim.x, ++local) {
    const GemmItem item = sm100_item<kGateUp>(args, index);
    const int buffer = local & 1;
    mbarrier_wait(s.acc_full(buffer), (local >> 1) & 1);
    __syncwarp();  // tcgen05.ld is .sync.aligned: the whole warp, converged
    tcgen05_after_sync();
    uint32_t v[2][2][32];  // [half][token / 32][token % 32]
    const uint32_t acc = lanes + buffer * 2 * kAccColumns;
#pragma unroll
    for (int c = 0; c < 2; ++c) tmem_load_2x32(acc + 32 * c, acc + kAccColumns + 32 * c, v[0][c], v[1][c]);
    tcgen05_before_sync();
    __syncwarp();
    if ((threadIdx.x & 31) == 0) mbarrier_arrive(s.acc_empty(buffer));
    // Token t of the item is column t: a warp stores 32 consecutive columns of one output row.
    if constexpr (kGateUp) {
      const int n = item.n0 + row;
      if (n < p.N) {
        bf16* out = static_cast<bf16*>(p.out) + static_cast<int64_t>(item.row0) * p.N + n;
#pragma unroll
        for (int t = 0; t < kTileRows; ++t) {
          if (t < item.rows) {
            const float gate = __uint_as_float(v[0][t / 32][t % 32]), up = __uint_as_float(v[1][t / 32][t % 32]);
            out[static_cast<int64_t>(t) * p.N] = __float2bfloat16(gate / (1.0f + __expf(-gate)) * up);
          }
        }
      }
    } else {
      const int64_t first = static_cast<int64_t>(item.row0) * p.N;
#pragma unroll
      for (int h = 0; h < 2; ++h) {
        const int n = item.n0 + h * kHalfRows + row;
        if (n < p.N) {
#pragma unroll
          for (int t = 0; t < kTileRows; ++t) {
            if (t >= item.rows) continue;
            const float value = __uint_as_float(v[h][t / 32][t % 32]);
            if (p.bf16_out) {
              static_cast<bf16*>(p.out)[first + static_cast<int64_t>(t) * p.N + n] = __float2bfloat16(value);
            } else {
              static_cast<float*>(p.out)[first + static_cast<int64_t>(t) * p.N + n] = value;
            }
          }
        }
      }
    }
  }
}
#endif  // MOE_SM100A_DEVICE

template <bool kGateUp>
__global__ void __launch_bounds__(kThreads, 1)
    mxfp8_grouped_gemm_sm100_kernel(const __grid_constant__ CUtensorMap weights, const Sm100GemmArgs args) {
#if MOE_SM100A_DEVICE
  extern __shared__ unsigned char smem_raw[];  // aligned by hand below
  const Smem s{(smem_u32(smem_raw) + 1023) & ~1023u};
  unsigned char* const base = smem_raw + (s.base - smem_u32(smem_raw));
  const int warp = threadIdx.x >> 5;
  // Scale-factor rows 64..127 of the token atoms are never written: keep them zero.
  for (int i = threadIdx.x; i < kStages * kSfBytes / 16; i += kThreads)
    reinterpret_cast<uint4*>(base + kSfBase)[i] = make_uint4(0, 0, 0, 0);
  if (threadIdx.x == 0) {
    for (int stage = 0; stage < kStages; ++stage) {
      mbarrier_init(s.full(stage), 1 + 32);  // the expect-tx arrival + the producer lanes' cp.async arrivals
      mbarrier_init(s.empty(stage), 1);      // tcgen05.commit
    }
    for (int buffer = 0; buffer < 2; ++buffer) {
      mbarrier_init(s.acc_full(buffer), 1);                // tcgen05.commit
      mbarrier_init(s.acc_empty(buffer), kEpilogueWarps);  // one per epilogue warp
    }
    fence_barrier_init();
  }
  if (warp == kMmaWarp) tmem_alloc(s.base + kTmemSlot, kTmemColumns);
  tcgen05_before_sync();
  __syncthreads();
  tcgen05_after_sync();
  const uint32_t tmem = *reinterpret_cast<volatile uint32_t*>(base + kTmemSlot);
  const int num_items = args.p.tile_offsets[args.p.num_experts] * args.num_n_tiles;

  if (warp == kProducerWarp) {
    produce<kGateUp>(&weights, args, s, num_items);
  } else if (warp == kMmaWarp) {
    if ((threadIdx.x & 31) == 0) issue_mmas<kGateUp>(args, s, tmem, num_items);
    __syncwarp();
  } else {
    drain_epilogue<kGateUp>(args, s, tmem, num_items);
  }
  // Every MMA has completed (the epilogue saw each acc_full) and every TMEM
  // load has waited: the columns can go.
  __syncthreads();
  if (warp == kMmaWarp) {
    tcgen05_after_sync();
    tmem_dealloc(tmem, kTmemColumns);
  }
#endif
}

bool sm100_device() {
  static const bool available = [] {
    int device = 0, major = 0, minor = 0;
    if (cudaGetDevice(&device) != cudaSuccess) return false;
    if (cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, device) != cudaSuccess) return false;
    if (cudaDeviceGetAttribute(&minor, cudaDevAttrComputeCapabilityMinor, device) != cudaSuccess) return false;
    return major == 10 && minor == 0;
  }();
  return available;
}

}  // namespace

bool sm100_kernels_available() { return sm100_device(); }

cudaError_t mxfp8_grouped_gemm_sm100(const Mxfp8GroupedGemmParams& p, cudaStream_t stream) {
  if (!sm100_device()) return cudaErrorNotSupported;
  if (p.K <= 0 || p.K % kKStep != 0 || p.N <= 0 || p.k_splits != 1) return cudaErrorInvalidValue;
  if (p.max_tiles == 0) return cudaSuccess;
  const int columns_per_item = p.gate_up ? kHalfRows : 2 * kHalfRows;
  const Sm100GemmArgs args{p, (p.N + columns_per_item - 1) / columns_per_item, p.K / kMxBlock};
  const uint64_t weight_rows = static_cast<uint64_t>(p.num_experts) * (p.gate_up ? 2 * p.N : p.N);
  CUtensorMap map;
  cudaError_t error =
      make_tensor_map_2d(&map, p.w, 1, weight_rows, p.K, static_cast<uint64_t>(p.K), kHalfRows, kKStep);
  if (error != cudaSuccess) return error;
  const int blocks = std::min(multiprocessor_count(), args.num_n_tiles * p.max_tiles);
  auto kernel = p.gate_up ? mxfp8_grouped_gemm_sm100_kernel<true> : mxfp8_grouped_gemm_sm100_kernel<false>;
  error = cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, kSmemBytes);
  if (error != cudaSuccess) return error;
  kernel<<<blocks, kThreads, kSmemBytes, stream>>>(map, args);
  return cudaGetLastError();
}

}  // namespace moe::ops::cuda
