// MoE on the GPU: routing, permutation by expert, grouped GEMMs, weighted
// un-permutation. Nothing here synchronises with the host: per-expert counts
// live on the device and the grouped GEMM's grid is sized by an upper bound
// (every CTA past the real tile count exits), so the layer can be captured in
// a CUDA graph.
//
// Grouped GEMM: tensor cores through WMMA (bf16 16x16x16, f32 accumulate),
// 64x64 output tiles per CTA of 4 warps, K in steps of 32 through shared
// memory. The gate/up variant computes the gate and up tiles of the same
// columns together and applies SiLU-multiply in its epilogue. It is correct
// for any token distribution; it is not yet the wgmma/TMA kernel that reaches
// the bandwidth floor at decode sizes (see docs/performance.md).
#include <mma.h>

#include <cfloat>

#include "ops/cuda/common.cuh"
#include "ops/cuda/kernels.h"

namespace moe::ops::cuda {
namespace {

constexpr int kMaxExpertsPerLane = 8;  // num_experts <= 256

// One warp per token.
__global__ void route_topk_kernel(RouteTopkParams p) {
  const int warp = (blockIdx.x * blockDim.x + threadIdx.x) >> 5, lane = threadIdx.x & 31;
  if (warp >= p.num_tokens) return;
  const float* logits = p.logits + static_cast<int64_t>(warp) * p.num_experts;
  float prob[kMaxExpertsPerLane];
  float max_logit = -FLT_MAX;
#pragma unroll
  for (int i = 0; i < kMaxExpertsPerLane; ++i) {
    const int e = lane + 32 * i;
    prob[i] = e < p.num_experts ? logits[e] : -FLT_MAX;
    max_logit = fmaxf(max_logit, prob[i]);
  }
  max_logit = warp_max(max_logit);
  float sum = 0.0f;
#pragma unroll
  for (int i = 0; i < kMaxExpertsPerLane; ++i) {
    const int e = lane + 32 * i;
    prob[i] = e < p.num_experts ? expf(prob[i] - max_logit) : 0.0f;
    sum += prob[i];
  }
  sum = warp_sum(sum);
#pragma unroll
  for (int i = 0; i < kMaxExpertsPerLane; ++i) prob[i] = (lane + 32 * i < p.num_experts) ? prob[i] / sum : -1.0f;
  float chosen_sum = 0.0f;
  for (int j = 0; j < p.k; ++j) {
    // Warp argmax, lowest expert id on ties; the winner is removed.
    float best = -2.0f;
    int best_e = 0x7fffffff;
#pragma unroll
    for (int i = 0; i < kMaxExpertsPerLane; ++i)
      if (prob[i] > best) best = prob[i], best_e = lane + 32 * i;
    for (int offset = 16; offset > 0; offset >>= 1) {
      const float v = __shfl_xor_sync(0xffffffffu, best, offset);
      const int e = __shfl_xor_sync(0xffffffffu, best_e, offset);
      if (v > best || (v == best && e < best_e)) best = v, best_e = e;
    }
#pragma unroll
    for (int i = 0; i < kMaxExpertsPerLane; ++i)
      if (lane + 32 * i == best_e) prob[i] = -1.0f;
    if (lane == 0) {
      p.expert_ids[warp * p.k + j] = best_e;
      p.weights[warp * p.k + j] = best;
    }
    chosen_sum += best;
  }
  __syncwarp();
  if (p.renormalize && lane < p.k) p.weights[warp * p.k + lane] /= chosen_sum;
}

// One block: counts, prefix sums and the scatter of (token, slot) pairs.
__global__ void moe_permute_kernel(MoePermuteParams p) {
  extern __shared__ int32_t shared[];
  int32_t* counts = shared;                  // [num_experts]
  int32_t* cursor = shared + p.num_experts;  // [num_experts]
  const int pairs = p.num_tokens * p.k;
  for (int e = threadIdx.x; e < p.num_experts; e += blockDim.x) counts[e] = 0, cursor[e] = 0;
  __syncthreads();
  for (int i = threadIdx.x; i < pairs; i += blockDim.x) atomicAdd(&counts[p.expert_ids[i]], 1);
  __syncthreads();
  if (threadIdx.x == 0) {
    int32_t rows = 0, tiles = 0;
    for (int e = 0; e < p.num_experts; ++e) {
      p.expert_offsets[e] = rows;
      p.tile_offsets[e] = tiles;
      rows += counts[e];
      tiles += (counts[e] + p.tile_rows - 1) / p.tile_rows;
    }
    p.expert_offsets[p.num_experts] = rows;
    p.tile_offsets[p.num_experts] = tiles;
  }
  __syncthreads();
  for (int i = threadIdx.x; i < pairs; i += blockDim.x) {
    const int e = p.expert_ids[i];
    const int row = p.expert_offsets[e] + atomicAdd(&cursor[e], 1);
    p.sorted_token[row] = i / p.k;
    p.row_of[i] = row;
  }
}

constexpr int kTileM = kGroupedGemmTileRows, kTileN = 64, kTileK = 32, kPad = 8;

// Loads rows [0, kTileM or kTileN) x [k0, k0 + kTileK) of a bf16 matrix into
// shared memory, zero-filling rows past `num_rows`. row_index maps a tile row
// to a source row. 16-byte loads (K is a multiple of 8).
template <int kRows, typename RowIndex>
__device__ void load_tile(bf16 (*tile)[kTileK + kPad], const bf16* src, int K, int k0, int num_rows, RowIndex row_index) {
  constexpr int kChunks = kRows * kTileK / 8;
  for (int c = threadIdx.x; c < kChunks; c += blockDim.x) {
    const int r = c / (kTileK / 8), col = (c % (kTileK / 8)) * 8;
    uint4 value = make_uint4(0, 0, 0, 0);
    if (r < num_rows && k0 + col < K)
      value = *reinterpret_cast<const uint4*>(src + static_cast<int64_t>(row_index(r)) * K + k0 + col);
    *reinterpret_cast<uint4*>(&tile[r][col]) = value;
  }
}

__global__ void __launch_bounds__(128) grouped_gemm_kernel(GroupedGemmParams p) {
  using namespace nvcuda;
  const int tile = blockIdx.y;
  const int total_tiles = p.tile_offsets[p.num_experts];
  if (tile >= total_tiles) return;
  // The expert owning this row tile: the last e with tile_offsets[e] <= tile.
  int lo = 0, hi = p.num_experts - 1;
  while (lo < hi) {
    const int mid = (lo + hi + 1) / 2;
    if (p.tile_offsets[mid] <= tile) lo = mid; else hi = mid - 1;
  }
  const int e = lo;
  const int row0 = p.expert_offsets[e] + (tile - p.tile_offsets[e]) * kTileM;
  const int rows = min(kTileM, p.expert_offsets[e + 1] - row0);
  const int n0 = blockIdx.x * kTileN;
  const int n_total = p.gate_up ? 2 * p.N : p.N;
  const bf16* w = p.w + static_cast<int64_t>(e) * n_total * p.K;

  __shared__ __align__(16) bf16 a_tile[kTileM][kTileK + kPad];
  __shared__ __align__(16) bf16 b_tile[2][kTileN][kTileK + kPad];
  const int warp = threadIdx.x >> 5, warp_m = warp / 2, warp_n = warp % 2;  // 2x2 warps of 32x32
  wmma::fragment<wmma::accumulator, 16, 16, 16, float> acc[2][2][2];
#pragma unroll
  for (int h = 0; h < 2; ++h)
#pragma unroll
    for (int i = 0; i < 2; ++i)
#pragma unroll
      for (int j = 0; j < 2; ++j) wmma::fill_fragment(acc[h][i][j], 0.0f);
  const int num_b = p.gate_up ? 2 : 1;
  const int n_rows = min(kTileN, p.N - n0);
  for (int k0 = 0; k0 < p.K; k0 += kTileK) {
    if (p.gate_up) {
      load_tile<kTileM>(a_tile, p.a, p.K, k0, rows, [&](int r) { return p.sorted_token[row0 + r]; });
    } else {
      load_tile<kTileM>(a_tile, p.a, p.K, k0, rows, [&](int r) { return row0 + r; });
    }
    for (int h = 0; h < num_b; ++h)
      load_tile<kTileN>(b_tile[h], w, p.K, k0, n_rows, [&](int r) { return h * p.N + n0 + r; });
    __syncthreads();
#pragma unroll
    for (int kk = 0; kk < kTileK; kk += 16) {
      wmma::fragment<wmma::matrix_a, 16, 16, 16, bf16, wmma::row_major> a_frag[2];
#pragma unroll
      for (int i = 0; i < 2; ++i) wmma::load_matrix_sync(a_frag[i], &a_tile[warp_m * 32 + i * 16][kk], kTileK + kPad);
      for (int h = 0; h < num_b; ++h) {
#pragma unroll
        for (int j = 0; j < 2; ++j) {
          wmma::fragment<wmma::matrix_b, 16, 16, 16, bf16, wmma::col_major> b_frag;
          wmma::load_matrix_sync(b_frag, &b_tile[h][warp_n * 32 + j * 16][kk], kTileK + kPad);
#pragma unroll
          for (int i = 0; i < 2; ++i) wmma::mma_sync(acc[h][i][j], a_frag[i], b_frag, acc[h][i][j]);
        }
      }
    }
    __syncthreads();
  }
  // Epilogue through shared memory, one accumulator set at a time (the gate
  // values wait in registers while the up tile is staged).
  __shared__ float c_tile[kTileM][kTileN + 4];
  constexpr int kPerThread = kTileM * kTileN / 128;
  float gate[kPerThread];
  for (int h = 0; h < num_b; ++h) {
#pragma unroll
    for (int i = 0; i < 2; ++i)
#pragma unroll
      for (int j = 0; j < 2; ++j)
        wmma::store_matrix_sync(&c_tile[warp_m * 32 + i * 16][warp_n * 32 + j * 16], acc[h][i][j], kTileN + 4,
                                wmma::mem_row_major);
    __syncthreads();
#pragma unroll
    for (int v = 0; v < kPerThread; ++v) {
      const int idx = threadIdx.x + v * 128, r = idx / kTileN, c = idx % kTileN;
      if (h == 0 && p.gate_up) {
        gate[v] = c_tile[r][c];
        continue;
      }
      if (r >= rows || c >= n_rows) continue;
      const int64_t out_index = static_cast<int64_t>(row0 + r) * p.N + n0 + c;
      if (p.gate_up) {
        const float g = gate[v], u = c_tile[r][c];
        static_cast<bf16*>(p.out)[out_index] = __float2bfloat16(g / (1.0f + expf(-g)) * u);
      } else {
        static_cast<float*>(p.out)[out_index] = c_tile[r][c];
      }
    }
    __syncthreads();
  }
}

__global__ void moe_unpermute_kernel(MoeUnpermuteParams p) {
  const int t = blockIdx.x;
  for (int i = threadIdx.x; i < p.hidden; i += blockDim.x) {
    float sum = 0.0f;
    for (int j = 0; j < p.k; ++j)
      sum += p.weights[t * p.k + j] * p.rows[static_cast<int64_t>(p.row_of[t * p.k + j]) * p.hidden + i];
    p.out[static_cast<int64_t>(t) * p.hidden + i] = sum;
  }
}

}  // namespace

cudaError_t route_topk(const RouteTopkParams& p, cudaStream_t stream) {
  if (p.num_experts > 32 * kMaxExpertsPerLane || p.k < 1 || p.k > p.num_experts || p.k > 32) return cudaErrorInvalidValue;
  if (p.num_tokens == 0) return cudaSuccess;
  constexpr int kThreads = 256;
  route_topk_kernel<<<(p.num_tokens * 32 + kThreads - 1) / kThreads, kThreads, 0, stream>>>(p);
  return cudaGetLastError();
}

cudaError_t moe_permute(const MoePermuteParams& p, cudaStream_t stream) {
  moe_permute_kernel<<<1, 1024, 2 * p.num_experts * sizeof(int32_t), stream>>>(p);
  return cudaGetLastError();
}

cudaError_t grouped_gemm(const GroupedGemmParams& p, cudaStream_t stream) {
  if (p.K % 8 != 0) return cudaErrorInvalidValue;
  if (p.max_tiles == 0) return cudaSuccess;
  grouped_gemm_kernel<<<dim3((p.N + kTileN - 1) / kTileN, p.max_tiles), 128, 0, stream>>>(p);
  return cudaGetLastError();
}

cudaError_t moe_unpermute(const MoeUnpermuteParams& p, cudaStream_t stream) {
  if (p.num_tokens == 0) return cudaSuccess;
  moe_unpermute_kernel<<<p.num_tokens, 256, 0, stream>>>(p);
  return cudaGetLastError();
}

}  // namespace moe::ops::cuda
