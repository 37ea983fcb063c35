// Paged attention on the tensor cores, for head_dim 128 and up to 16 q heads
// per kv head (every Qwen3 MoE model): the decode kernel of the CUDA backend.
//
// Algorithm (flash-decoding): block = (token, kv head, split of the visible
// positions); its 4 warps take 16-position chunks in turn. For a chunk a warp
// has the K and V rows (one page when page_size is 16) copied into shared
// memory, kStages deep, then on the tensor cores (mma.m16n8k16, bf16
// in, f32 accumulate) computes S = Q K^T for the 16 rows of q heads, keeps an
// online softmax per row in registers, and accumulates O += P V with P reused
// straight from the S accumulators as the A operand. Warps and splits merge
// their (max, sum, O) at the end; splits through a small f32 workspace and a
// combine kernel. The launch is a programmatic dependent of the kernel that
// wrote q and the new K/V: positions and page indices are read while that
// kernel drains.
//
// The copies: where a chunk never straddles pages and the caller gives the
// pool's size (PagedAttentionParams::num_pages), lane 0 issues four tensor
// copies per chunk (the bulk copy engine, TMA: K and V, dims 0-63 and
// 64-127, 16 rows each, 128-byte swizzle) onto the warp's mbarrier of that
// stage; otherwise the 32 lanes copy 16-byte pieces with cp.async into rows
// padded to 272 bytes. Measured on an H200 (2026-12-04, alternated with the
// cp.async-only kernel in one call): 64 x 1k 79.6-80.0% -> 82.7-83.4% of the
// copy bandwidth, and +2 to +4 points at every batch x context up to 64 x
// 32k (98%). Copying each 256-byte row with its own bulk copy (no tensor map,
// padded rows) had gained 1-3 points from 8k positions on but lost 2 at
// 128-256 x 1k and nothing at 64 x 1k
// (bench/results/2026-12-04_gpu_decode_attention_tma.md).
//
// At small batch x context (64 x 1k: 134 MB, 31 us at the copy bandwidth)
// what is left is fixed cost and imbalance, measured on an H200 with
// per-warp timestamps (2026-12-01): ~1 us before the first copies (position,
// page table), ~0.65 us of merge, and SMs that stream at different rates:
// the warps of some ~20 SMs finish their 1024 positions at ~27-30 us, most
// at ~34-36 us, and the faster SMs then idle (more splits, which the block
// scheduler would balance, cost more in ramp-up and the combine kernel:
// 0.050 ms at 2 splits against 0.040 at 1).
//
// Floor: decode reads every K/V byte of the visible positions once per kv
// head (bytes / HBM bandwidth); the 2 MMAs per position are far below the
// tensor-core rate, so the kernel is memory-bound by design.
#include <algorithm>
#include <cstdint>

#include "ops/cuda/attention_mma.cuh"
#include "ops/cuda/tensor_map.h"

namespace moe::ops::cuda {
namespace {

using namespace mma_attention;

constexpr int kChunk = 16, kWarps = 4;
constexpr int kChunkBytes = kChunk * kRowBytes;
// A decode warp's shared memory: kStages chunks of K and V, kStages - 1 of
// them loading while it attends to one. Measured on an H200 (2026-12-01,
// 64 q / 4 kv heads, pages of 16): three stages (two blocks per SM) beat two
// (three blocks per SM) at every batch x context from 64 x 1k to 64 x 32k,
// by up to 27% at 64 x 1k, and four (one block per SM) lose 3-18%.
constexpr int kDefaultDecodeStages = 3;
// kTma: the chunks come by tensor copies (whole 16-row boxes of 64 dims,
// 128-byte swizzle, no padding) instead of cp.async.
template <bool kTma>
constexpr int kStageBytes = kTma ? 2 /*K, V*/ * kChunk * kD * 2 : 2 * kChunkBytes;
template <int kStages, bool kTma = false>
constexpr int kWarpSmem = kStages * kStageBytes<kTma>;
// The warps' merge: f32 rows of kD + 8 floats, so the float2 stores of a
// warp's O fragments (8 rows x 4 column pairs) hit distinct banks.
constexpr int kMergeStride = kD + 8;
constexpr int kMergeBytes = kWarps * kRows * (kMergeStride + 2) * sizeof(float);
template <int kStages, bool kTma = false>
constexpr int kTilesAndMerge = std::max(kWarps * kWarpSmem<kStages, kTma>, kMergeBytes);
// kTma: + alignment slack for the swizzle atoms, then an mbarrier per warp and stage.
template <int kStages, bool kTma = false>
constexpr int kDecodeSmem = kTma ? 1024 + kTilesAndMerge<kStages, kTma> + kWarps * kStages * 8 : kTilesAndMerge<kStages>;
constexpr int kMinSplitPositions = 64, kMaxSplits = 64;  // split-KV bounds

// Per-warp timestamps of the decode kernel for bench/gpu/attention_trace,
// compiled in only with MOE_ATTENTION_TRACE: slot 0 %globaltimer at entry,
// 1 clock64 at entry, 7 after griddepcontrol.wait, 2 first chunk in shared
// memory, 3 end of the warp's loop, 4 clock64 and 5 %globaltimer at the
// block's exit, 6 the SM; record (token, kv head, split, warp).
#ifdef MOE_ATTENTION_TRACE
__device__ unsigned long long g_attention_trace[1 << 16][8];
#define MOE_TRACE(slot, value)                                                                      \
  do {                                                                                              \
    if ((threadIdx.x & 31) == 0)                                                                    \
      g_attention_trace[((blockIdx.x * gridDim.y + blockIdx.y) * gridDim.z + blockIdx.z) * kWarps + \
                        (threadIdx.x >> 5)][slot] = (value);                                        \
  } while (0)
__device__ __forceinline__ unsigned long long global_timer() {
  unsigned long long t;
  asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));
  return t;
}
__device__ __forceinline__ unsigned long long sm_id() {
  unsigned s;
  asm volatile("mov.u32 %0, %%smid;" : "=r"(s));
  return s;
}
#else
#define MOE_TRACE(slot, value) \
  do {                         \
  } while (0)
#endif

struct MmaAttentionParams {
  PagedAttentionParams p;
  int num_splits;
  int split_len;      // positions per split, a multiple of kChunk
  float* partial_o;   // [num_tokens, num_q_heads, num_splits, kD]
  float* partial_ml;  // [num_tokens, num_q_heads, num_splits, 2]
};

// The tensor copies of kTma (sm_90): a box of the 2-D tensor map at (x, y)
// into shared memory, completing its bytes on an mbarrier.
__device__ __forceinline__ void barrier_init(uint32_t bar) {
  asm volatile("mbarrier.init.shared::cta.b64 [%0], 1;\n" ::"r"(bar) : "memory");
}
__device__ __forceinline__ void barrier_expect_bytes(uint32_t bar, uint32_t bytes) {
  asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;\n" ::"r"(bar), "r"(bytes) : "memory");
}
__device__ __forceinline__ void barrier_wait(uint32_t bar, uint32_t parity) {
  asm volatile(
      "{\n.reg .pred done;\n"
      "wait_again:\n"
      "mbarrier.try_wait.parity.shared::cta.b64 done, [%0], %1;\n"
      "@!done bra wait_again;\n}\n" ::"r"(bar),
      "r"(parity)
      : "memory");
}
__device__ __forceinline__ void tensor_copy(uint32_t dst, const CUtensorMap* map, int x, int y, uint32_t bar) {
  asm volatile(
      "cp.async.bulk.tensor.2d.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1, {%2, %3}], [%4];\n" ::"r"(dst),
      "l"(map), "r"(x), "r"(y), "r"(bar)
      : "memory");
}

// The merge's four columns col .. col + 3 of a row: the warps' O rows
// (merge_o, [kWarps][kRows][kMergeStride]) weighted by c.
__device__ __forceinline__ float4 merged_columns(const float* merge_o, int row, int col, const float (&c)[kWarps]) {
  float4 sum = make_float4(0.0f, 0.0f, 0.0f, 0.0f);
#pragma unroll
  for (int w = 0; w < kWarps; ++w) {
    const float4 v = *reinterpret_cast<const float4*>(merge_o + (w * kRows + row) * kMergeStride + col);
    sum.x += v.x * c[w], sum.y += v.y * c[w], sum.z += v.z * c[w], sum.w += v.w * c[w];
  }
  return sum;
}

// kFp8Out: the output rows in E4M3 (PagedAttentionParams::out_fp8), an
// instantiation of its own: with the bf16 epilogue and the FP8 one in one
// kernel, batch 64 x 1k read 79.2-79.3% of the copy against 80.9-81.1%
// (H200, alternated in one call, 2026-12-03).
// kTma (page_size a multiple of kChunk): each chunk's K and V rows come as
// four tensor copies (k_map, v_map: the pools as [pages x kv heads x page
// rows, kD]) issued by lane 0 onto the warp's barrier of that stage.
template <int kStages, bool kFp8Out, bool kTma>
__global__ void __launch_bounds__(kWarps * 32)
    mma_attention_kernel(MmaAttentionParams args, const __grid_constant__ CUtensorMap k_map,
                         const __grid_constant__ CUtensorMap v_map) {
  const PagedAttentionParams& p = args.p;
  const int t = blockIdx.x, kv_head = blockIdx.y, split = blockIdx.z;
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, g = lane >> 2, tq = lane & 3;
  const int group = p.num_q_heads / p.num_kv_heads;
  MOE_TRACE(0, global_timer());
  MOE_TRACE(1, clock64());
  MOE_TRACE(6, sm_id());
  const int pos = p.positions[t];
  const int begin = split * args.split_len;
  if (begin > pos) return;
  const int end = min(pos + 1, begin + args.split_len);
  const int32_t* pages = p.page_table + static_cast<int64_t>(p.token_seq[t]) * p.max_pages_per_seq;

  extern __shared__ __align__(128) unsigned char smem_raw[];
  unsigned char* smem =  // kTma: the swizzle atoms are 1024-byte aligned
      kTma ? smem_raw + ((1024 - smem_address(smem_raw) % 1024) % 1024) : smem_raw;
  unsigned char* warp_smem = smem + warp * kWarpSmem<kStages, kTma>;
  const uint32_t bars = smem_address(smem + kTilesAndMerge<kStages, kTma>) + warp * kStages * 8;
  if constexpr (kTma) {
    if (lane < kStages) barrier_init(bars + lane * 8);
    asm volatile("fence.mbarrier_init.release.cluster;\n" ::: "memory");
    __syncwarp();
  }

  // Chunks of this warp: first + warp + kWarps * i, kStages - 1 of them
  // loading while it attends to one. Every step commits a group (empty past
  // the last chunk) so wait_group's count stays the same.
  const int first_chunk = begin / kChunk, last_chunk = (end - 1) / kChunk;
  // When a chunk never straddles pages (page_size a multiple of kChunk), its
  // K rows are 4 KB in a row: lane i keeps the page of the warp's chunk
  // i (mod 32), read 32 chunks at a time, so no copy waits on a page-table
  // load (measured on an H200 at batch 64 x 1k, two stages: 0.069 ms with a
  // lookup per copied piece, 0.062 ms so).
  const bool page_chunks = p.page_size % kChunk == 0;
  int lane_page = 0;
  auto refill_pages = [&](int chunk) {  // pages of the warp's 32 chunks from `chunk` on
    const int mine = chunk + kWarps * lane;
    lane_page = mine <= last_chunk ? pages[mine * kChunk / p.page_size] : 0;
  };
  auto issue = [&](int i, int stage) {  // the warp's i-th chunk
    const int chunk = first_chunk + warp + kWarps * i;
    unsigned char* tile = warp_smem + stage * kStageBytes<kTma>;
    if constexpr (kTma) {
      if ((i & 31) == 0 && i > 0) refill_pages(chunk);
      const int page = __shfl_sync(0xffffffffu, lane_page, i & 31);
      if (chunk <= last_chunk && lane == 0) {
        const int first_row = (page * p.num_kv_heads + kv_head) * p.page_size + chunk * kChunk % p.page_size;
        const uint32_t bar = bars + stage * 8, k_dst = smem_address(tile), v_dst = k_dst + kChunk * kD * 2;
        barrier_expect_bytes(bar, kStageBytes<true>);
#pragma unroll
        for (int half = 0; half < 2; ++half) {
          tensor_copy(k_dst + half * kChunk * 128, &k_map, half * 64, first_row, bar);
          tensor_copy(v_dst + half * kChunk * 128, &v_map, half * 64, first_row, bar);
        }
      }
      return;
    } else if (page_chunks) {
      if ((i & 31) == 0 && i > 0) refill_pages(chunk);
      const int page = __shfl_sync(0xffffffffu, lane_page, i & 31);
      if (chunk <= last_chunk) {
        const int64_t first_row =
            (static_cast<int64_t>(page) * p.num_kv_heads + kv_head) * p.page_size + chunk * kChunk % p.page_size;
        const bf16* k_rows = p.k_pages + first_row * kD;
        const bf16* v_rows = p.v_pages + (k_rows - p.k_pages);
#pragma unroll
        for (int j = 0; j < 8; ++j) {
          const int piece = lane + 32 * j, row = piece >> 4;
          const bool valid = chunk * kChunk + row < end;
          const uint32_t dst = smem_address(tile + row * kRowBytes + (piece & 15) * 16);
          cp_async16_l2_256(dst, valid ? k_rows + piece * 8 : p.k_pages, valid);
          cp_async16_l2_256(dst + kChunkBytes, valid ? v_rows + piece * 8 : p.v_pages, valid);
        }
      }
    } else if (chunk <= last_chunk) {
#pragma unroll
      for (int j = 0; j < 8; ++j)
        copy_chunk_piece<kChunk>(p, pages, kv_head, chunk, end, lane + 32 * j, tile);
    }
    asm volatile("cp.async.commit_group;\n" ::);
  };
  if (page_chunks) refill_pages(first_chunk + warp);
  // Launched as a programmatic dependent of the kernel before it (the one
  // that writes q and this step's K/V): everything above overlaps that
  // kernel's tail; nothing written by it is read before this wait.
  asm volatile("griddepcontrol.wait;\n" ::: "memory");
  MOE_TRACE(7, clock64());
  uint32_t qa[kD / 16][4];
  load_q_raw(qa, p.q + (static_cast<int64_t>(t) * p.num_q_heads + kv_head * group) * kD, group, lane);
#pragma unroll
  for (int s = 0; s < kStages - 1; ++s) issue(s, s);

  scale_q(qa, p.scale * 1.4426950408889634f);
  RowState state;
  state.init();
  int stage = 0;
  for (int i = 0, chunk = first_chunk + warp; chunk <= last_chunk; ++i, chunk += kWarps) {
    issue(i + kStages - 1, (stage + kStages - 1) % kStages);
    const unsigned char* k_tile = warp_smem + stage * kStageBytes<kTma>;
    const unsigned char* v_tile = k_tile + kStageBytes<kTma> / 2;
    if constexpr (kTma) {
      barrier_wait(bars + stage * 8, (i / kStages) & 1);
      // Rows past `end` hold whatever the page held: zero their V rows (P is
      // 0 there, and 0 x NaN would not be); K's are masked in S.
      const int visible = end - chunk * kChunk;
      if (visible < kChunk) {
        for (int piece = visible * 16 + lane; piece < kChunk * 16; piece += 32)
          *reinterpret_cast<uint4*>(const_cast<unsigned char*>(v_tile) + (piece & 8) / 8 * (kChunk * 128) +
                                    (piece >> 4) * 128 + (piece & 7) * 16) = make_uint4(0, 0, 0, 0);
      }
    } else {
      asm volatile("cp.async.wait_group %0;\n" ::"n"(kStages - 1));
    }
    __syncwarp();
    if (i == 0) MOE_TRACE(2, clock64());
    attend_chunk<kChunk, kTma>(state, qa, k_tile, v_tile, chunk * kChunk, begin, end, lane);
    __syncwarp();
    stage = (stage + 1) % kStages;
  }
  MOE_TRACE(3, clock64());
  asm volatile("cp.async.wait_group 0;\n" ::);  // nothing in flight when the merge reuses shared memory
  float (&o)[kD / 8][4] = state.o;
  float (&m)[2] = state.m;
  float (&l)[2] = state.l;

  // Merge the 4 warps: row sums across the quad, then through shared memory.
#pragma unroll
  for (int h = 0; h < 2; ++h) {
    l[h] += __shfl_xor_sync(0xffffffffu, l[h], 1);
    l[h] += __shfl_xor_sync(0xffffffffu, l[h], 2);
  }
  __syncthreads();
  float* merge_o = reinterpret_cast<float*>(smem);            // [kWarps][kRows][kMergeStride]
  float* merge_ml = merge_o + kWarps * kRows * kMergeStride;  // [kWarps][kRows][2]
#pragma unroll
  for (int dt = 0; dt < kD / 8; ++dt)
#pragma unroll
    for (int h = 0; h < 2; ++h)
      *reinterpret_cast<float2*>(merge_o + (warp * kRows + g + h * 8) * kMergeStride + dt * 8 + tq * 2) =
          make_float2(o[dt][2 * h], o[dt][2 * h + 1]);
  if (tq == 0) {
    merge_ml[(warp * kRows + g) * 2] = m[0], merge_ml[(warp * kRows + g) * 2 + 1] = l[0];
    merge_ml[(warp * kRows + g + 8) * 2] = m[1], merge_ml[(warp * kRows + g + 8) * 2 + 1] = l[1];
  }
  __syncthreads();
  // A row of the group per kMergeThreads threads: one row's weights (one
  // exp2 per warp), then thread q sums columns 4q + 32j (j < kD / 32) over
  // the warps, so the 8 threads of a row read 128 contiguous bytes per load.
  // Measured on an H200 at batch 64 x 1k (per-warp timestamps): the merge
  // took ~1.35 us when every column pair recomputed its row's weights, ~0.65
  // us so; the kernel 0.0400-0.0403 -> 0.0390-0.0392 ms.
  constexpr int kMergeThreads = kWarps * 32 / kRows;
  static_assert(kWarps * 32 % kRows == 0 && kD % (4 * kMergeThreads) == 0);
  const int q = threadIdx.x % kMergeThreads;
  for (int row = threadIdx.x / kMergeThreads; row < group; row += kWarps * 32 / kMergeThreads) {
    float c[kWarps], max_all = -FLT_MAX, denominator = 0.0f;
#pragma unroll
    for (int w = 0; w < kWarps; ++w) max_all = fmaxf(max_all, merge_ml[(w * kRows + row) * 2]);
#pragma unroll
    for (int w = 0; w < kWarps; ++w) {
      const float2 ml = *reinterpret_cast<const float2*>(merge_ml + (w * kRows + row) * 2);
      c[w] = ml.y > 0.0f ? fast_exp2(ml.x - max_all) : 0.0f;
      denominator += ml.y * c[w];
    }
    const float inv = 1.0f / denominator;
#pragma unroll
    for (int w = 0; w < kWarps; ++w) c[w] *= inv;
    const int head = kv_head * group + row;
    if constexpr (!kFp8Out) {
#pragma unroll
      for (int j = 0; j < kD / (4 * kMergeThreads); ++j) {
        const int col = j * 4 * kMergeThreads + q * 4;
        const float4 sum = merged_columns(merge_o, row, col, c);
        if (args.num_splits == 1) {
          const uint2 packed{pack_bf16(sum.x, sum.y), pack_bf16(sum.z, sum.w)};
          *reinterpret_cast<uint2*>(p.out + (static_cast<int64_t>(t) * p.num_q_heads + head) * kD + col) =
              packed;
        } else {
          const int64_t slot = (static_cast<int64_t>(t) * p.num_q_heads + head) * args.num_splits + split;
          *reinterpret_cast<float4*>(args.partial_o + slot * kD + col) = sum;
          if (col == 0) args.partial_ml[slot * 2] = max_all, args.partial_ml[slot * 2 + 1] = denominator;
        }
      }
    } else {
      // All of the thread's columns first: with one split the row (one
      // 1 x 128 group) is quantized as quantize_fp8_groups does its bf16
      // values, across the row's kMergeThreads lanes.
      constexpr int kColumnSets = kD / (4 * kMergeThreads);
      float4 sums[kColumnSets];
#pragma unroll
      for (int j = 0; j < kColumnSets; ++j) {
        const int col = j * 4 * kMergeThreads + q * 4;
        sums[j] = merged_columns(merge_o, row, col, c);
      }
      const int64_t out_row = static_cast<int64_t>(t) * p.num_q_heads + head;
      if (args.num_splits > 1) {  // as above; combine_splits_kernel quantizes
        const int64_t slot = out_row * args.num_splits + split;
#pragma unroll
        for (int j = 0; j < kColumnSets; ++j)
          *reinterpret_cast<float4*>(args.partial_o + slot * kD + j * 4 * kMergeThreads + q * 4) = sums[j];
        if (q == 0) args.partial_ml[slot * 2] = max_all, args.partial_ml[slot * 2 + 1] = denominator;
      } else {
        float v[kColumnSets][4], amax = 0.0f;
#pragma unroll
        for (int j = 0; j < kColumnSets; ++j) {
          const float x[4] = {sums[j].x, sums[j].y, sums[j].z, sums[j].w};
#pragma unroll
          for (int e = 0; e < 4; ++e) {
            v[j][e] = __bfloat162float(__float2bfloat16_rn(x[e]));
            amax = fmaxf(amax, fabsf(v[j][e]));
          }
        }
        // The row's kMergeThreads lanes, all active or not together.
        const unsigned lanes = ((1u << kMergeThreads) - 1) << (threadIdx.x & 31 & ~(kMergeThreads - 1));
#pragma unroll
        for (int offset = 1; offset < kMergeThreads; offset <<= 1)
          amax = fmaxf(amax, __shfl_xor_sync(lanes, amax, offset));
        const float scale = fmaxf(amax, 1e-10f) / 448.0f, inv = 1.0f / scale;
#pragma unroll
        for (int j = 0; j < kColumnSets; ++j)
          *reinterpret_cast<uint32_t*>(p.out_fp8 + out_row * kD + j * 4 * kMergeThreads + q * 4) =
              e4m3x4(v[j][0], v[j][1], v[j][2], v[j][3], scale, inv);
        if (q == 0)
          p.out_scales[p.scales_by_group ? static_cast<int64_t>(head) * p.num_tokens + t
                                         : static_cast<int64_t>(t) * p.num_q_heads + head] = scale;
      }
    }
  }
  MOE_TRACE(4, clock64());
  MOE_TRACE(5, global_timer());
}

// One block of kD threads per (token, q head), a column each: merges the
// splits that saw any position. With out_fp8 the row (one 1 x 128 group) is
// quantized as quantize_fp8_groups does its bf16 values.
__global__ void combine_splits_kernel(MmaAttentionParams args) {
  __shared__ float scratch[kD / 32];
  const PagedAttentionParams& p = args.p;
  const int t = blockIdx.x, head = blockIdx.y, col = threadIdx.x;
  const int num_valid = p.positions[t] / args.split_len + 1;
  const int64_t base = (static_cast<int64_t>(t) * p.num_q_heads + head) * args.num_splits;
  float max_all = -FLT_MAX;
  for (int s = 0; s < num_valid; ++s) max_all = fmaxf(max_all, args.partial_ml[(base + s) * 2]);
  float numerator = 0.0f, denominator = 0.0f;
  for (int s = 0; s < num_valid; ++s) {
    const float w = args.partial_ml[(base + s) * 2 + 1] * exp2f(args.partial_ml[(base + s) * 2] - max_all);
    numerator += args.partial_o[(base + s) * kD + col] * w;
    denominator += w;
  }
  const int64_t at = (static_cast<int64_t>(t) * p.num_q_heads + head) * kD + col;
  const bf16 value = __float2bfloat16(numerator / denominator);
  if (p.out_fp8 == nullptr) {
    p.out[at] = value;
    return;
  }
  const float v = __bfloat162float(value);
  const float warp_amax = warp_max(fabsf(v));
  if ((col & 31) == 0) scratch[col / 32] = warp_amax;
  __syncthreads();
  float amax = 0.0f;
#pragma unroll
  for (int w = 0; w < kD / 32; ++w) amax = fmaxf(amax, scratch[w]);
  const float scale = fmaxf(amax, 1e-10f) / 448.0f;
  p.out_fp8[at] = __nv_cvt_float_to_fp8(divide_by_scale(v, scale, 1.0f / scale), __NV_SATFINITE, __NV_E4M3);
  if (col == 0)
    p.out_scales[p.scales_by_group ? static_cast<int64_t>(head) * p.num_tokens + t
                                   : static_cast<int64_t>(t) * p.num_q_heads + head] = scale;
}

}  // namespace

bool mma_attention_supported(const PagedAttentionParams& p) {
  return p.head_dim == kD && p.num_kv_heads > 0 && p.num_q_heads % p.num_kv_heads == 0 &&
         p.num_q_heads / p.num_kv_heads <= kRows;
}

size_t mma_attention_workspace_bytes(int num_tokens, int num_q_heads, int max_position) {
  const int splits = std::min(kMaxSplits, max_position / kMinSplitPositions + 1);
  return static_cast<size_t>(num_tokens) * num_q_heads * splits * (kD + 2) * sizeof(float);
}

namespace {

template <int kStages>
int decode_block_slots() {  // blocks of the decode kernel resident at once on the device
  static const int blocks = [] {
    int count = 0;
    auto kernel = mma_attention_kernel<kStages, false, false>;  // the others fit as many (kTma: less shared memory)
    if (cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, kDecodeSmem<kStages>) != cudaSuccess ||
        cudaOccupancyMaxActiveBlocksPerMultiprocessor(&count, kernel, kWarps * 32, kDecodeSmem<kStages>) != cudaSuccess)
      return 1;
    return std::max(1, count * multiprocessor_count());
  }();
  return blocks;
}

// The number of splits of the visible positions: the grid runs in waves of
// `slots` blocks, and a block's time is about its chunks per warp plus a
// fixed cost (prologue, merge), so the estimate is waves x (chunks + 2), plus
// one for the combine kernel when splitting. Measured on an H200 before this
// model: splitting only until the grid reached 2 blocks per SM left the last
// of two waves 30% full at batch 64 (65% of the bandwidth floor).
int choose_splits(int slots, int num_blocks, int positions, int max_splits) {
  int best = 1;
  double best_cost = 1e30;
  for (int splits = 1; splits <= max_splits; ++splits) {
    const int split_len = ((positions + splits - 1) / splits + kChunk - 1) / kChunk * kChunk;
    if (splits > 1 && (splits - 1) * split_len >= positions) break;  // the last split would be empty
    const int chunks_per_warp = (split_len / kChunk + kWarps - 1) / kWarps;
    const int waves = (num_blocks * splits + slots - 1) / slots;
    const double cost = waves * (chunks_per_warp + 2.0) + (splits > 1 ? 1.0 : 0.0);
    if (cost < best_cost) best_cost = cost, best = splits;
  }
  return best;
}

template <int kStages, bool kTma>
cudaError_t launch_decode(const MmaAttentionParams& args, cudaStream_t stream) {
  const PagedAttentionParams& p = args.p;
  const auto kernel = p.out_fp8 != nullptr ? mma_attention_kernel<kStages, true, kTma>
                                           : mma_attention_kernel<kStages, false, kTma>;
  constexpr int smem_bytes = kDecodeSmem<kStages, kTma>;
  cudaError_t error = cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, smem_bytes);
  if (error != cudaSuccess) return error;
  CUtensorMap maps[2] = {};
  if constexpr (kTma) {
    const uint64_t rows = static_cast<uint64_t>(p.num_pages) * p.num_kv_heads * p.page_size;
    for (int i = 0; i < 2; ++i) {
      error = make_tensor_map_2d(&maps[i], i == 0 ? p.k_pages : p.v_pages, 2, rows, kD, kD * 2, kChunk, 64);
      if (error != cudaSuccess) return error;
    }
  }
  // Programmatic dependent launch: this grid may start while the previous
  // kernel in the stream finishes (see griddepcontrol.wait in the kernel).
  // Measured on an H200, same binary with and without, twice each: batch
  // 64 x 1k 0.0405-0.0409 ms against 0.0422 eager, 0.0402 against 0.0407
  // in a graph; no change in the 4-layer decode step.
  cudaLaunchAttribute attribute{};
  attribute.id = cudaLaunchAttributeProgrammaticStreamSerialization;
  attribute.val.programmaticStreamSerializationAllowed = 1;
  cudaLaunchConfig_t config{};
  config.gridDim = dim3(p.num_tokens, p.num_kv_heads, args.num_splits);
  config.blockDim = dim3(kWarps * 32);
  config.dynamicSmemBytes = smem_bytes;
  config.stream = stream;
  config.attrs = &attribute;
  config.numAttrs = 1;
  error = cudaLaunchKernelEx(&config, kernel, args, maps[0], maps[1]);
  if (error != cudaSuccess) return error;
  if (args.num_splits > 1) combine_splits_kernel<<<dim3(p.num_tokens, p.num_q_heads), kD, 0, stream>>>(args);
  return cudaGetLastError();
}

}  // namespace

cudaError_t mma_paged_attention(const PagedAttentionParams& p, int max_position, float* workspace,
                                size_t workspace_bytes, cudaStream_t stream) {
  if (!mma_attention_supported(p)) return cudaErrorInvalidValue;
  if (p.num_tokens == 0) return cudaSuccess;
  const int stages = p.decode_stages != 0 ? p.decode_stages : kDefaultDecodeStages;
  if (stages < 2 || stages > 4 || p.decode_splits < 0) return cudaErrorInvalidValue;
  const int positions = max_position + 1;
  const size_t split_bytes = static_cast<size_t>(p.num_tokens) * p.num_q_heads * (kD + 2) * sizeof(float);
  const int by_workspace = workspace == nullptr ? 1 : static_cast<int>(std::min<size_t>(workspace_bytes / split_bytes, kMaxSplits));
  const int max_splits = std::max(1, std::min({by_workspace, kMaxSplits, max_position / kMinSplitPositions + 1}));
  const int slots = stages == 2   ? decode_block_slots<2>()
                    : stages == 3 ? decode_block_slots<3>()
                                  : decode_block_slots<4>();
  const int splits = p.decode_splits != 0
                         ? std::min(p.decode_splits, max_splits)
                         : choose_splits(slots, p.num_tokens * p.num_kv_heads, positions, max_splits);
  const int split_len = ((positions + splits - 1) / splits + kChunk - 1) / kChunk * kChunk;
  MmaAttentionParams args{p, (positions + split_len - 1) / split_len, split_len, nullptr, nullptr};
  if (args.num_splits > 1) {
    const size_t entries = static_cast<size_t>(p.num_tokens) * p.num_q_heads * args.num_splits;
    args.partial_o = workspace;
    args.partial_ml = workspace + entries * kD;
  }
  // Tensor copies where chunks never straddle pages and the pool's size is
  // known (its rows must fit the copies' 32-bit coordinates).
  const bool tma = p.num_pages > 0 && p.page_size % kChunk == 0 && hopper_kernels_available() &&
                   int64_t{p.num_pages} * p.num_kv_heads * p.page_size <= INT32_MAX;
  if (tma)
    return stages == 2   ? launch_decode<2, true>(args, stream)
           : stages == 3 ? launch_decode<3, true>(args, stream)
                         : launch_decode<4, true>(args, stream);
  return stages == 2   ? launch_decode<2, false>(args, stream)
         : stages == 3 ? launch_decode<3, false>(args, stream)
                       : launch_decode<4, false>(args, stream);
}

}  // namespace moe::ops::cuda
