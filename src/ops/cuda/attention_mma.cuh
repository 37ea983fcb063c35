// The tensor-core building blocks the two mma.sync paged attention kernels
// share: the decode kernel (attention_mma.cu) and the prefill kernel for GPUs
// without Hopper's wgmma (attention_mma_prefill.cu). Head_dim 128, up to 16 q
// heads per kv head; mma.m16n8k16 (bf16 in, f32 accumulate) with an online
// softmax in base 2 held in registers (RowState), K/V chunks in shared memory
// as padded rows (cp.async, copy_chunk_piece) or, in the decode kernel,
// swizzled tensor-copy boxes (tile_address).
#pragma once

#include <cfloat>
#include <cstdint>

#include "ops/cuda/common.cuh"
#include "ops/cuda/kernels.h"

namespace moe::ops::cuda::mma_attention {

constexpr int kD = 128, kRows = 16;
constexpr int kRowBytes = kD * 2 + 16;  // padded shared-memory row: conflict-free ldmatrix

__device__ __forceinline__ uint32_t smem_address(const void* p) {
  return static_cast<uint32_t>(__cvta_generic_to_shared(p));
}

__device__ __forceinline__ void cp_async16(uint32_t dst, const void* src, bool valid) {
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(dst), "l"(src), "r"(valid ? 16 : 0));
}

// As cp_async16, asking L2 to fetch the whole 256-byte block: the decode
// kernel (a warp reads 512 contiguous bytes per instruction) gained 0.3-1.7
// points of the bandwidth floor at every batch x context from 64 x 1k to
// 64 x 32k (H200, 2026-12-02, with and without alternated twice in one call;
// 64 x 1k timed interleaved with a copy: 79.8-79.9% against 78.6-79.1%).
__device__ __forceinline__ void cp_async16_l2_256(uint32_t dst, const void* src, bool valid) {
  asm volatile("cp.async.cg.shared.global.L2::256B [%0], [%1], 16, %2;\n" ::"r"(dst), "l"(src),
               "r"(valid ? 16 : 0));
}

__device__ __forceinline__ void ldmatrix_x4(uint32_t address, uint32_t& r0, uint32_t& r1, uint32_t& r2,
                                            uint32_t& r3) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0, %1, %2, %3}, [%4];\n"
               : "=r"(r0), "=r"(r1), "=r"(r2), "=r"(r3)
               : "r"(address));
}

__device__ __forceinline__ void ldmatrix_x4_trans(uint32_t address, uint32_t& r0, uint32_t& r1, uint32_t& r2,
                                                  uint32_t& r3) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0, %1, %2, %3}, [%4];\n"
               : "=r"(r0), "=r"(r1), "=r"(r2), "=r"(r3)
               : "r"(address));
}

// D = A (16x16 bf16, row) * B (16x8 bf16, col) + D (16x8 f32).
__device__ __forceinline__ void mma_16816(float (&d)[4], const uint32_t (&a)[4], uint32_t b0, uint32_t b1) {
  asm volatile(
      "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, "
      "{%0, %1, %2, %3};\n"
      : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}

// 2^x on the SFU (ex2.approx: 2 ulp, and 2^-inf = 0).
__device__ __forceinline__ float fast_exp2(float x) {
  float y;
  asm("ex2.approx.ftz.f32 %0, %1;" : "=f"(y) : "f"(x));
  return y;
}

__device__ __forceinline__ uint32_t pack_bf16(float lo, float hi) {
  const __nv_bfloat162 v = __floats2bfloat162_rn(lo, hi);
  return *reinterpret_cast<const uint32_t*>(&v);
}

// Q fragments of one token's group of q heads (rows past `group` are zero),
// loaded as they are (32-bit loads, nothing waits on them yet) ...
__device__ __forceinline__ void load_q_raw(uint32_t (&qa)[kD / 16][4], const bf16* q0, int group, int lane) {
  const int g = lane >> 2, tq = lane & 3;
#pragma unroll
  for (int ks = 0; ks < kD / 16; ++ks)
#pragma unroll
    for (int r = 0; r < 4; ++r) {
      const int row = g + (r & 1) * 8, col = ks * 16 + tq * 2 + (r >> 1) * 8;
      qa[ks][r] = row < group ? *reinterpret_cast<const uint32_t*>(q0 + row * kD + col) : 0u;
    }
}

// ... then pre-scaled by scale * log2(e), so the softmax runs in base 2.
__device__ __forceinline__ void scale_q(uint32_t (&qa)[kD / 16][4], float q_scale) {
#pragma unroll
  for (int ks = 0; ks < kD / 16; ++ks)
#pragma unroll
    for (int r = 0; r < 4; ++r) {
      const float2 v = __bfloat1622float2(*reinterpret_cast<const __nv_bfloat162*>(&qa[ks][r]));
      qa[ks][r] = pack_bf16(v.x * q_scale, v.y * q_scale);
    }
}

// A warp's running attention state for its 16 rows: O in mma accumulator
// layout, the running max of rows g and g + 8, and this thread's part of
// their sums.
struct RowState {
  float o[kD / 8][4];
  float m[2], l[2];
  __device__ void init() {
#pragma unroll
    for (int i = 0; i < kD / 8; ++i) o[i][0] = o[i][1] = o[i][2] = o[i][3] = 0.0f;
    m[0] = m[1] = -FLT_MAX;
    l[0] = l[1] = 0.0f;
  }
};

// Shared-memory address of (row, dim col) in a chunk's K or V tile: rows of
// kRowBytes (cp.async), or kTma's two 128-byte swizzled boxes of kN rows
// (dims 0-63, then 64-127; 16-byte piece c of row r at c ^ (r % 8)).
template <int kN, bool kTma>
__device__ __forceinline__ uint32_t tile_address(const unsigned char* tile, int row, int col) {
  if constexpr (kTma) {
    return smem_address(tile + (col >> 6) * (kN * 128) + row * 128 + ((((col & 63) >> 3) ^ (row & 7)) << 4));
  } else {
    return smem_address(tile + row * kRowBytes + col * 2);
  }
}

// Folds one chunk of kN positions (K and V tiles in shared memory, laid out
// as tile_address says) into `state`; positions outside [begin, end) are masked.
template <int kN, bool kTma = false>
__device__ __forceinline__ void attend_chunk(RowState& state, const uint32_t (&qa)[kD / 16][4],
                                             const unsigned char* k_tile, const unsigned char* v_tile,
                                             int chunk_start, int begin, int end, int lane) {
  const int tq = lane & 3;
  // S = Q K^T; with one 16-position group the k steps rotate over
  // kChains accumulators (MMA chains of 8 / kChains), summed at the end.
  constexpr int kChains = kN == 16 ? 4 : 1;
  float s[kChains][kN / 8][4];
#pragma unroll
  for (int c = 0; c < kChains; ++c)
#pragma unroll
    for (int nt = 0; nt < kN / 8; ++nt) s[c][nt][0] = s[c][nt][1] = s[c][nt][2] = s[c][nt][3] = 0.0f;
#pragma unroll
  for (int ks = 0; ks < kD / 16; ++ks) {
#pragma unroll
    for (int pg = 0; pg < kN / 16; ++pg) {
      // x4: matrices (positions +0-7, dims ks*16+0..7), (+0-7, +8..15), (+8-15, +0..7), (+8-15, +8..15).
      const int mat = lane >> 3, row = pg * 16 + (lane & 7) + (mat >> 1) * 8, col = ks * 16 + (mat & 1) * 8;
      uint32_t b0, b1, b2, b3;
      ldmatrix_x4(tile_address<kN, kTma>(k_tile, row, col), b0, b1, b2, b3);
      mma_16816(s[ks % kChains][2 * pg], qa[ks], b0, b1);
      mma_16816(s[ks % kChains][2 * pg + 1], qa[ks], b2, b3);
    }
  }
#pragma unroll
  for (int c = 1; c < kChains; ++c)
#pragma unroll
    for (int nt = 0; nt < kN / 8; ++nt)
#pragma unroll
      for (int r = 0; r < 4; ++r) s[0][nt][r] += s[c][nt][r];
  if (chunk_start < begin || chunk_start + kN > end) {  // warp-uniform: only a split's edges are masked
#pragma unroll
    for (int nt = 0; nt < kN / 8; ++nt)
#pragma unroll
      for (int r = 0; r < 4; ++r) {
        const int position = chunk_start + nt * 8 + tq * 2 + (r & 1);
        if (position < begin || position >= end) s[0][nt][r] = -INFINITY;
      }
  }
  // Online softmax for rows g (r = 0, 1) and g + 8 (r = 2, 3), in base 2.
  float corr[2];
#pragma unroll
  for (int h = 0; h < 2; ++h) {
    float row_max = -FLT_MAX;
#pragma unroll
    for (int nt = 0; nt < kN / 8; ++nt) row_max = fmaxf(row_max, fmaxf(s[0][nt][2 * h], s[0][nt][2 * h + 1]));
    row_max = fmaxf(row_max, __shfl_xor_sync(0xffffffffu, row_max, 1));
    row_max = fmaxf(row_max, __shfl_xor_sync(0xffffffffu, row_max, 2));
    const float new_max = fmaxf(state.m[h], row_max);
    corr[h] = fast_exp2(state.m[h] - new_max);
    state.m[h] = new_max;
    float sum = 0.0f;
#pragma unroll
    for (int nt = 0; nt < kN / 8; ++nt)
#pragma unroll
      for (int c = 0; c < 2; ++c) {
        float& v = s[0][nt][2 * h + c];
        // A masked -inf gives 0; new_max is finite (every chunk has a visible position).
        v = fast_exp2(v - new_max);
        sum += v;
      }
    state.l[h] = state.l[h] * corr[h] + sum;
  }
  // Once the row maxima settle most chunks leave them alone: skip the rescale then.
  if (__any_sync(0xffffffffu, corr[0] != 1.0f || corr[1] != 1.0f)) {
#pragma unroll
    for (int i = 0; i < kD / 8; ++i) {
      state.o[i][0] *= corr[0], state.o[i][1] *= corr[0], state.o[i][2] *= corr[1], state.o[i][3] *= corr[1];
    }
  }
  // O += P V, 16 positions at a time; P's A fragment comes straight from the S accumulators.
#pragma unroll
  for (int pg = 0; pg < kN / 16; ++pg) {
    const uint32_t pa[4] = {pack_bf16(s[0][2 * pg][0], s[0][2 * pg][1]),
                            pack_bf16(s[0][2 * pg][2], s[0][2 * pg][3]),
                            pack_bf16(s[0][2 * pg + 1][0], s[0][2 * pg + 1][1]),
                            pack_bf16(s[0][2 * pg + 1][2], s[0][2 * pg + 1][3])};
#pragma unroll
    for (int dt = 0; dt < kD / 16; ++dt) {
      // x4.trans: (positions +0-7, dims dt*16+0..7), (+8-15, +0..7), (+0-7, +8..15), (+8-15, +8..15).
      const int mat = lane >> 3, row = pg * 16 + (lane & 7) + (mat & 1) * 8, col = dt * 16 + (mat >> 1) * 8;
      uint32_t b0, b1, b2, b3;
      ldmatrix_x4_trans(tile_address<kN, kTma>(v_tile, row, col), b0, b1, b2, b3);
      mma_16816(state.o[dt * 2], pa, b0, b1);
      mma_16816(state.o[dt * 2 + 1], pa, b2, b3);
    }
  }
}

// Copies piece `piece` (0 .. kN * 16 - 1) of a kN-position chunk's K and V
// rows into shared memory (K rows, then V rows at kN * kRowBytes; 16 pieces
// of 16 bytes per row); pieces past `end` are zero.
template <int kN>
__device__ __forceinline__ void copy_chunk_piece(const PagedAttentionParams& p, const int32_t* pages,
                                                 int kv_head, int chunk, int end, int piece,
                                                 unsigned char* tile) {
  const int row = piece >> 4, part = piece & 15;
  const int position = chunk * kN + row;
  const bool valid = position < end;
  const int64_t offset =
      valid
          ? ((static_cast<int64_t>(pages[position / p.page_size]) * p.num_kv_heads + kv_head) * p.page_size +
             position % p.page_size) *
                    kD +
                part * 8
          : 0;
  const uint32_t dst = smem_address(tile + row * kRowBytes + part * 16);
  cp_async16(dst, p.k_pages + offset, valid);
  cp_async16(dst + kN * kRowBytes, p.v_pages + offset, valid);
}

}  // namespace moe::ops::cuda::mma_attention
