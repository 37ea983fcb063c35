// Prefill attention on Hopper's warpgroup MMA (wgmma), head_dim 128.
//
// Algorithm (flash attention 2, with the operands and pipelining of flash
// attention 3): a block owns 128 query rows of one kv head. With GQA the rows
// are (token, q head) pairs, `128 / group` consecutive tokens of one sequence
// times the `group` q heads sharing the kv head, so every K/V byte the block
// loads serves all of its heads and the causal mask only cuts the last key
// block. Roles: a producer warpgroup (72 registers per thread) copies the
// sequence's keys, 128 at a time (8 pages of 16), into 128-byte-swizzled
// shared memory with cp.async, three stages deep, signalling an mbarrier per
// stage; two consumer warpgroups (216 registers) own 64 rows each. Per key
// block j a consumer issues S_j = Q K_j^T (wgmma from shared memory) and,
// behind it, O += P_{j-1} V_{j-1} (P in registers as wgmma's A operand, V
// read transposed), then runs the online softmax of S_j (base 2) while the
// second MMA is still on the tensor cores; a stage goes back to the producer
// once its V has been consumed. The two consumers take turns issuing their
// MMAs (named barriers, "ping-pong"), so one's softmax runs under the
// other's MMAs.
//
// Floor: 4 * head_dim FLOPs per visible (query row, key) pair; causal 6k
// tokens x 64 heads = 0.62 PFLOP, 0.79 ms at 780 TFLOP/s. Shared memory: Q
// 32 KB + 3 stages x (K 32 KB + V 32 KB) = 224 KB, one block per SM.
#include <cfloat>
#include <climits>
#include <algorithm>
#include <cstdint>

#include "ops/cuda/common.cuh"
#include "ops/cuda/kernels.h"
#include "ops/cuda/wgmma.cuh"

namespace moe::ops::cuda {
namespace {

constexpr int kD = 128, kRows = 128, kKeys = 128, kStages = 3;
constexpr int kConsumerThreads = 256, kThreads = kConsumerThreads + 128;  // + the producer warpgroup
constexpr int kHalfTile = kRows * 128;     // one 64-wide half of a 128-row tile, bytes
constexpr int kTileBytes = 2 * kHalfTile;  // 128 rows x 128 dims bf16
// Layout: Q, then stages of (K, V), then the mbarriers: full and empty per
// stage, Q full, Q empty.
[[maybe_unused]] constexpr int kStageBase = kTileBytes, kBarrierBase = kTileBytes + kStages * 2 * kTileBytes;
constexpr int kSmemBytes = kBarrierBase + (2 * kStages + 2) * 8 + 1024;  // + alignment slack

struct WgmmaPrefillParams {
  PagedAttentionParams p;
  const int32_t* group_start;  // [num_groups + 1]
  int num_groups;
  int group_tokens;            // tokens per group: kRows / (q heads per kv head)
};

[[maybe_unused]] __device__ __forceinline__ uint32_t pack_bf16x2(float lo, float hi) {
  const __nv_bfloat162 v = __floats2bfloat162_rn(lo, hi);
  return *reinterpret_cast<const uint32_t*>(&v);
}

// Producer warp `warp` (0..3) copies rows 32 warp .. 32 warp + 31 of a key
// block of K and V into a stage. Lane l holds the element offset of row
// 32 warp + l (row_offset, -1 past the end); each instruction copies two
// rows (16 lanes x 16 bytes each) of K and of V.
[[maybe_unused]] __device__ __forceinline__ int64_t kv_row_offset(const PagedAttentionParams& p, const int32_t* pages,
                                                                  int kv_head, int block, int end, int warp, int lane) {
  const int position = block * kKeys + warp * 32 + lane;
  return position < end ? ((static_cast<int64_t>(pages[position / p.page_size]) * p.num_kv_heads + kv_head) *
                               p.page_size + position % p.page_size) * kD
                        : -1;
}
[[maybe_unused]] __device__ __forceinline__ void copy_kv_rows(const PagedAttentionParams& p, int64_t row_offset,
                                                              uint32_t k_tile, uint32_t v_tile, int warp, int lane) {
  const int part = lane & 15;
#pragma unroll
  for (int i = 0; i < 16; ++i) {
    const int local = 2 * i + (lane >> 4), row = warp * 32 + local;
    const int64_t offset = __shfl_sync(0xffffffffu, row_offset, local);
    const bool valid = offset >= 0;
    const int64_t element = valid ? offset + part * 8 : 0;
    const uint32_t dst = (part >> 3) * kHalfTile + sw128_offset(row, part & 7);
    cp_async_16(k_tile + dst, p.k_pages + element, valid);
    cp_async_16(v_tile + dst, p.v_pages + element, valid);
  }
}

// A tile is (group of tokens, kv head); tile i of the longest-first order.
struct Tile {
  int t0, t1, kv_head, end, num_blocks;
  const int32_t* pages;
};
[[maybe_unused]] __device__ __forceinline__ Tile tile_at(const WgmmaPrefillParams& args, int index) {
  const PagedAttentionParams& p = args.p;
  Tile tile;
  const int group_index = args.num_groups - 1 - index / p.num_kv_heads;  // later groups see longer prefixes
  tile.kv_head = index % p.num_kv_heads;
  tile.t0 = args.group_start[group_index];
  tile.t1 = args.group_start[group_index + 1];
  tile.end = p.positions[tile.t1 - 1] + 1;  // a group's tokens are in position order
  tile.num_blocks = (tile.end + kKeys - 1) / kKeys;
  tile.pages = p.page_table + static_cast<int64_t>(p.token_seq[tile.t0]) * p.max_pages_per_seq;
  return tile;
}

// Persistent: block b takes tiles b, b + gridDim.x, ... (longest first, so
// the blocks' totals even out); the producer runs ahead across tiles, so the
// next tile's Q and first keys load while the consumers finish this one.
__global__ void __launch_bounds__(kThreads, 1) wgmma_prefill_kernel(WgmmaPrefillParams args) {
#if MOE_SM90A_DEVICE
  const PagedAttentionParams& p = args.p;
  const int group = p.num_q_heads / p.num_kv_heads;
  const int num_tiles = args.num_groups * p.num_kv_heads;

  extern __shared__ unsigned char smem_raw[];
  const uint32_t smem = (smem_u32(smem_raw) + 1023) & ~1023u;  // swizzle atoms are 1024-aligned
  auto k_tile = [&](int stage) { return smem + kStageBase + stage * 2 * kTileBytes; };
  auto v_tile = [&](int stage) { return k_tile(stage) + kTileBytes; };
  auto full = [&](int stage) { return smem + kBarrierBase + stage * 8; };
  auto empty = [&](int stage) { return smem + kBarrierBase + (kStages + stage) * 8; };
  const uint32_t q_full = smem + kBarrierBase + 2 * kStages * 8, q_empty = q_full + 8;
  const int warp_id = threadIdx.x >> 5, lane = threadIdx.x & 31;
  // Consumer warps release a buffer with one arrival each, from lane 0 once
  // the warp's wgmma reads are complete (wgmma.wait_group is warp-wide).
  if (threadIdx.x == 0) {
    for (int s = 0; s < kStages; ++s) {
      mbarrier_init(full(s), 128);                     // the producer's threads
      mbarrier_init(empty(s), kConsumerThreads / 32);  // one arrival per consumer warp
    }
    mbarrier_init(q_full, 128);
    mbarrier_init(q_empty, kConsumerThreads / 32);
  }
  __syncthreads();

  if (warp_id < 4) {  // the producer warpgroup
    setmaxnreg_dec<88>();
    int step = 0, round = 0;  // key blocks and tiles loaded so far
    for (int index = blockIdx.x; index < num_tiles; index += gridDim.x, ++round) {
      const Tile tile = tile_at(args, index);
      // The page-table lookups of a block are made one block ahead, and the
      // first keys of a tile load before its Q (which waits for the last
      // tile's consumers), so neither latency lands on the consumers.
      int64_t next_offset = kv_row_offset(p, tile.pages, tile.kv_head, 0, tile.end, warp_id, lane);
      for (int block = 0; block < tile.num_blocks; ++block, ++step) {
        const int64_t offset = next_offset;
        if (block + 1 < tile.num_blocks)
          next_offset = kv_row_offset(p, tile.pages, tile.kv_head, block + 1, tile.end, warp_id, lane);
        const int stage = step % kStages;
        if (step >= kStages) mbarrier_wait(empty(stage), ((step / kStages) - 1) & 1);
        copy_kv_rows(p, offset, k_tile(stage), v_tile(stage), warp_id, lane);
        mbarrier_arrive_cp_async(full(stage));
        if (block > 0) continue;
        // Q rows: row r = (token t0 + r / group, head r % group); rows past the group are zeros.
        if (round > 0) mbarrier_wait(q_empty, (round - 1) & 1);
#pragma unroll
        for (int i = 0; i < kRows * 16 / 128; ++i) {
          const int piece = threadIdx.x + i * 128, row = piece >> 4, part = piece & 15;
          const int t = tile.t0 + row / group;
          const bool valid = row < args.group_tokens * group && t < tile.t1;
          const int64_t q_offset =
              valid ? (static_cast<int64_t>(t) * p.num_q_heads + tile.kv_head * group + row % group) * kD + part * 8
                    : 0;
          cp_async_16(smem + (part >> 3) * kHalfTile + sw128_offset(row, part & 7), p.q + q_offset, valid);
        }
        mbarrier_arrive_cp_async(q_full);
      }
    }
    cp_async_wait_group<0>();
    return;
  }
  setmaxnreg_inc<208>();

  // Consumers: warpgroup c owns rows 64 c .. 64 c + 63 of every tile.
  const int warpgroup = (warp_id >> 2) - 1, warp = warp_id & 3, g = lane >> 2, q = lane & 3;
  const uint32_t q_rows = smem + warpgroup * 64 * 128;  // 1024-aligned
  const float scale_log2 = p.scale * 1.4426950408889634f;
  float o[64], s[64];
  uint32_t pa[8][4];
  float m[2], l[2];
  int row_position[2], min_position = 0;

  auto issue_qk = [&](int stage) {
#pragma unroll
    for (int ks = 0; ks < kD / 16; ++ks) {
      const uint32_t half = (ks >> 2) * kHalfTile, k_bytes = (ks & 3) * 32;
      wgmma_m64n128k16_ss<0>(s, sw128_descriptor(q_rows + half + k_bytes, 16, 1024),
                             sw128_descriptor(k_tile(stage) + half + k_bytes, 16, 1024), ks > 0);
    }
    wgmma_commit_group();
  };
  auto issue_pv = [&](int stage) {
#pragma unroll
    for (int kk = 0; kk < 8; ++kk)
      wgmma_m64n128k16_rs<1>(o, pa[kk], sw128_descriptor(v_tile(stage) + kk * 16 * 128, kHalfTile, 1024), 1);
    wgmma_commit_group();
  };
  // Masks S (blocks that reach past a row's position), updates m and l, leaves
  // P = exp2(S * scale_log2 - m) in s, and returns the factors for O.
  auto softmax = [&](int block, float (&corr)[2]) {
    const int first_key = block * kKeys;
    if (first_key + kKeys - 1 > min_position) {
#pragma unroll
      for (int i = 0; i < 64; ++i) {
        const int key = first_key + (i >> 2) * 8 + 2 * q + (i & 1);
        if (key > row_position[(i >> 1) & 1]) s[i] = -INFINITY;
      }
    }
    float m_use[2];
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      float row_max = -INFINITY;
#pragma unroll
      for (int i = 0; i < 16; ++i) row_max = fmaxf(row_max, fmaxf(s[4 * i + 2 * h], s[4 * i + 2 * h + 1]));
      row_max = fmaxf(row_max, __shfl_xor_sync(0xffffffffu, row_max, 1));
      row_max = fmaxf(row_max, __shfl_xor_sync(0xffffffffu, row_max, 2));
      const float new_max = fmaxf(m[h], row_max * scale_log2);
      m_use[h] = new_max == -INFINITY ? 0.0f : new_max;  // a row with nothing visible yet
      corr[h] = fast_exp2(m[h] - m_use[h]);
      m[h] = new_max;
    }
    float sum[2] = {0.0f, 0.0f};
#pragma unroll
    for (int i = 0; i < 64; ++i) {
      const int h = (i >> 1) & 1;
      s[i] = fast_exp2(fmaf(s[i], scale_log2, -m_use[h]));
      sum[h] += s[i];
    }
#pragma unroll
    for (int h = 0; h < 2; ++h) l[h] = l[h] * corr[h] + sum[h];
  };
  auto convert_p = [&] {
#pragma unroll
    for (int kk = 0; kk < 8; ++kk) {
      pa[kk][0] = pack_bf16x2(s[8 * kk + 0], s[8 * kk + 1]);
      pa[kk][1] = pack_bf16x2(s[8 * kk + 2], s[8 * kk + 3]);
      pa[kk][2] = pack_bf16x2(s[8 * kk + 4], s[8 * kk + 5]);
      pa[kk][3] = pack_bf16x2(s[8 * kk + 6], s[8 * kk + 7]);
    }
  };

  // Ping-pong: a consumer waits for its turn (barrier 3 + its index), issues
  // its MMAs, then hands the turn to the other (both barriers count 256).
  // Both consumers walk the same tiles and blocks, so the turns alternate.
  const int my_turn = 3 + warpgroup, other_turn = 3 + (warpgroup ^ 1);
  if (warpgroup == 1) named_barrier_arrive(other_turn, kConsumerThreads);  // consumer 0 goes first
  int step = 0, round = 0;
  for (int index = blockIdx.x; index < num_tiles; index += gridDim.x, ++round) {
    const Tile tile = tile_at(args, index);
    // This thread's two rows and the positions they may see (-1: padding row).
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      const int row = warpgroup * 64 + warp * 16 + g + 8 * h;
      const int t = tile.t0 + row / group;
      row_position[h] = (row < args.group_tokens * group && t < tile.t1) ? p.positions[t] : -1;
    }
    min_position = min(row_position[0] < 0 ? INT_MAX : row_position[0],
                       row_position[1] < 0 ? INT_MAX : row_position[1]);
#pragma unroll
    for (int i = 0; i < 64; ++i) o[i] = 0.0f;
    m[0] = m[1] = -INFINITY;
    l[0] = l[1] = 0.0f;

    // Block 0: S only. Then per block: S_j and P_{j-1} V_{j-1} in flight, softmax of S_j behind them.
    float corr[2];
    mbarrier_wait(q_full, round & 1);
    mbarrier_wait(full(step % kStages), (step / kStages) & 1);
    fence_proxy_async_shared();
    named_barrier_sync(my_turn, kConsumerThreads);
    wgmma_fence();
    issue_qk(step % kStages);
    named_barrier_arrive(other_turn, kConsumerThreads);
    wgmma_wait_group<0>();
    softmax(0, corr);
    convert_p();
    for (int block = 1; block < tile.num_blocks; ++block) {
      const int previous = step % kStages;
      ++step;
      const int stage = step % kStages;
      mbarrier_wait(full(stage), (step / kStages) & 1);
      fence_proxy_async_shared();
      named_barrier_sync(my_turn, kConsumerThreads);
      wgmma_fence();
      issue_qk(stage);
      issue_pv(previous);
      named_barrier_arrive(other_turn, kConsumerThreads);
      wgmma_wait_group<1>();  // S_j is ready; P_{j-1} V_{j-1} may still run
      softmax(block, corr);
      wgmma_wait_group<0>();
      if (lane == 0) mbarrier_arrive(empty(previous));
#pragma unroll
      for (int i = 0; i < 64; ++i) o[i] *= corr[(i >> 1) & 1];
      convert_p();
    }
    if (lane == 0) mbarrier_arrive(q_empty);  // every S of this tile is done: the producer may load the next Q
    const bool last_round = index + gridDim.x >= num_tiles;
    named_barrier_sync(my_turn, kConsumerThreads);
    wgmma_fence();
    issue_pv(step % kStages);
    if (warpgroup == 0 || !last_round) named_barrier_arrive(other_turn, kConsumerThreads);  // no turn after the end
    wgmma_wait_group<0>();
    if (lane == 0) mbarrier_arrive(empty(step % kStages));
    ++step;

    // Normalise and store this thread's two rows: bf16, or their E4M3 (a
    // (token, head) row is one 1 x 128 group, quantized across the quad).
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      l[h] += __shfl_xor_sync(0xffffffffu, l[h], 1);
      l[h] += __shfl_xor_sync(0xffffffffu, l[h], 2);
      const bool live = row_position[h] >= 0;
      const int row = warpgroup * 64 + warp * 16 + g + 8 * h;
      const int t = live ? tile.t0 + row / group : 0, head = tile.kv_head * group + row % group;
      const float inv = live ? 1.0f / l[h] : 0.0f;
      if (p.out_fp8 != nullptr) {  // warp-uniform: every lane shuffles
        float v[32];
#pragma unroll
        for (int i = 0; i < 32; ++i)
          v[i] = __bfloat162float(__float2bfloat16_rn(o[4 * (i >> 1) + 2 * h + (i & 1)] * inv));
        float* scale = p.out_scales + (p.scales_by_group ? static_cast<int64_t>(head) * p.num_tokens + t
                                                         : static_cast<int64_t>(t) * p.num_q_heads + head);
        store_fp8_group_quad(p.out_fp8 + (static_cast<int64_t>(t) * p.num_q_heads + head) * kD, scale, v, kD, q,
                             live);
        continue;
      }
      if (!live) continue;
      bf16* out = p.out + (static_cast<int64_t>(t) * p.num_q_heads + head) * kD;
#pragma unroll
      for (int i = 0; i < 16; ++i)
        *reinterpret_cast<uint32_t*>(out + i * 8 + 2 * q) =
            pack_bf16x2(o[4 * i + 2 * h] * inv, o[4 * i + 2 * h + 1] * inv);
    }
  }
#endif
}

}  // namespace

bool hopper_kernels_available() {
  static const bool available = [] {
    int device = 0, major = 0, minor = 0;
    if (cudaGetDevice(&device) != cudaSuccess) return false;
    if (cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, device) != cudaSuccess) return false;
    if (cudaDeviceGetAttribute(&minor, cudaDevAttrComputeCapabilityMinor, device) != cudaSuccess) return false;
    return major == 9 && minor == 0;
  }();
  return available;
}

int multiprocessor_count() {
  static const int count = [] {
    int device = 0, n = 0;
    cudaGetDevice(&device);
    cudaDeviceGetAttribute(&n, cudaDevAttrMultiProcessorCount, device);
    return n;
  }();
  return count;
}

int wgmma_prefill_group_tokens(int num_q_heads, int num_kv_heads) { return kRows / (num_q_heads / num_kv_heads); }

cudaError_t wgmma_prefill_attention(const PagedAttentionParams& p, const int32_t* group_start, int num_groups,
                                    cudaStream_t stream) {
  if (!mma_attention_supported(p) || !hopper_kernels_available()) return cudaErrorNotSupported;
  if (num_groups == 0) return cudaSuccess;
  cudaError_t error = cudaFuncSetAttribute(wgmma_prefill_kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, kSmemBytes);
  if (error != cudaSuccess) return error;
  const int num_sms = multiprocessor_count();
  const int num_tiles = num_groups * p.num_kv_heads;
  wgmma_prefill_kernel<<<std::min(num_tiles, num_sms), kThreads, kSmemBytes, stream>>>(
      WgmmaPrefillParams{p, group_start, num_groups, wgmma_prefill_group_tokens(p.num_q_heads, p.num_kv_heads)});
  return cudaGetLastError();
}

}  // namespace moe::ops::cuda
