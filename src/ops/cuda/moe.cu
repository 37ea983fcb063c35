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
// for any token distribution and runs on any architecture; on Hopper the
// wgmma/TMA kernel of grouped_gemm_wgmma.cu takes its place.
#include <mma.h>

#include <algorithm>
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

// The permutation's prefix sums, in warp 0 (the caller's), 32 experts per
// pass: each expert's first row into first[] and, with write_offsets, the
// expert and tile offsets. (A serial loop in one thread, reading each count
// and writing both offsets to global memory, had taken most of the
// single-block kernel's 6-9 us at decode sizes; ncu on an H200.)
__device__ void scan_expert_counts(const MoePermuteParams& p, const int32_t* counts, int32_t* first,
                                   bool write_offsets) {
  const int lane = threadIdx.x;
  int32_t rows = 0, tiles = 0;  // before this pass's experts
  for (int base = 0; base < p.num_experts; base += 32) {
    const int e = base + lane;
    const int32_t count = e < p.num_experts ? counts[e] : 0;
    int32_t row_sum = count, tile_sum = (count + p.tile_rows - 1) / p.tile_rows;  // inclusive scans
    for (int offset = 1; offset < 32; offset <<= 1) {
      const int32_t r = __shfl_up_sync(0xffffffffu, row_sum, offset),
                    t = __shfl_up_sync(0xffffffffu, tile_sum, offset);
      if (lane >= offset) row_sum += r, tile_sum += t;
    }
    if (e < p.num_experts) {
      const int32_t tile_count = (count + p.tile_rows - 1) / p.tile_rows;
      first[e] = rows + row_sum - count;
      if (write_offsets) p.expert_offsets[e] = rows + row_sum - count, p.tile_offsets[e] = tiles + tile_sum - tile_count;
    }
    rows += __shfl_sync(0xffffffffu, row_sum, 31);
    tiles += __shfl_sync(0xffffffffu, tile_sum, 31);
  }
  if (lane == 0 && write_offsets) p.expert_offsets[p.num_experts] = rows, p.tile_offsets[p.num_experts] = tiles;
}

// The pair's expert among this rank's (outside [0, num_experts): another rank's).
__device__ __forceinline__ int local_expert(const MoePermuteParams& p, int i) {
  return p.expert_ids[i] - p.first_expert;
}

// Pairs [begin, end) to their rows: cursor[e] is the next free row of expert e.
__device__ __forceinline__ void scatter_pairs(const MoePermuteParams& p, int begin, int end, int32_t* cursor) {
  for (int i = begin + threadIdx.x; i < end; i += blockDim.x) {
    const int e = local_expert(p, i);
    if (e < 0 || e >= p.num_experts) {
      p.row_of[i] = -1;
      continue;
    }
    const int row = atomicAdd(&cursor[e], 1);
    p.sorted_token[row] = i / p.k;
    p.row_of[i] = row;
  }
}

// Decode sizes, one block: counts, prefix sums and the scatter of (token,
// slot) pairs.
__global__ void moe_permute_kernel(MoePermuteParams p) {
  extern __shared__ int32_t shared[];
  int32_t* counts = shared;                     // [num_experts]
  int32_t* cursor = shared + p.num_experts;     // [num_experts]
  const int pairs = p.num_tokens * p.k;
  for (int e = threadIdx.x; e < p.num_experts; e += blockDim.x) counts[e] = 0;
  __syncthreads();
  for (int i = threadIdx.x; i < pairs; i += blockDim.x) {
    const int e = local_expert(p, i);
    if (e >= 0 && e < p.num_experts) atomicAdd(&counts[e], 1);
  }
  __syncthreads();
  if (threadIdx.x < 32) scan_expert_counts(p, counts, cursor, true);
  __syncthreads();
  scatter_pairs(p, 0, pairs, cursor);
}

// Prefill sizes, two kernels over the same chunks of pairs (a block each):
// the chunk's counts per expert into block_counts, then in each block the
// prefix sums over experts (every block computes them; block 0 writes the
// offsets) and the chunk's rows after those of the chunks before it. One
// block of 1024 threads took 60 us at 4096 tokens x top-8 (H200, ncu),
// its shared-memory atomics on 128 counters serialised.
__device__ __forceinline__ int chunk_begin(const MoePermuteParams& p, int block) {
  const int pairs = p.num_tokens * p.k, chunk = (pairs + gridDim.x - 1) / gridDim.x;
  return min(pairs, block * chunk);
}

__global__ void moe_permute_count_kernel(MoePermuteParams p) {
  extern __shared__ int32_t counts[];  // [num_experts]
  for (int e = threadIdx.x; e < p.num_experts; e += blockDim.x) counts[e] = 0;
  __syncthreads();
  const int end = chunk_begin(p, blockIdx.x + 1);
  for (int i = chunk_begin(p, blockIdx.x) + threadIdx.x; i < end; i += blockDim.x) {
    const int e = local_expert(p, i);
    if (e >= 0 && e < p.num_experts) atomicAdd(&counts[e], 1);
  }
  __syncthreads();
  for (int e = threadIdx.x; e < p.num_experts; e += blockDim.x)
    p.block_counts[static_cast<int64_t>(blockIdx.x) * p.num_experts + e] = counts[e];
}

__global__ void moe_permute_scatter_kernel(MoePermuteParams p) {
  extern __shared__ int32_t shared[];
  int32_t* counts = shared;                  // [num_experts]: all chunks'
  int32_t* before = shared + p.num_experts;  // [num_experts]: the chunks' before this one
  int32_t* first = shared + 2 * p.num_experts;
  for (int e = threadIdx.x; e < p.num_experts; e += blockDim.x) {
    int32_t total = 0, earlier = 0;
    for (int b = 0; b < static_cast<int>(gridDim.x); ++b) {
      const int32_t count = p.block_counts[static_cast<int64_t>(b) * p.num_experts + e];
      total += count;
      if (b < static_cast<int>(blockIdx.x)) earlier += count;
    }
    counts[e] = total, before[e] = earlier;
  }
  __syncthreads();
  if (threadIdx.x < 32) scan_expert_counts(p, counts, first, blockIdx.x == 0);
  __syncthreads();
  for (int e = threadIdx.x; e < p.num_experts; e += blockDim.x) before[e] += first[e];  // the chunk's first rows
  __syncthreads();
  scatter_pairs(p, chunk_begin(p, blockIdx.x), chunk_begin(p, blockIdx.x + 1), before);
}

constexpr int kTileM = kGroupedGemmTileRows, kTileN = 64, kTileK = 128, kPad = 8, kStages = 2;
constexpr int kLd = kTileK + kPad;  // shared-memory row of a tile, in bf16 (80 bytes: conflict-free ldmatrix)
constexpr int kATileBytes = kTileM * kLd * 2, kBTileBytes = kTileN * kLd * 2;
constexpr int kStageBytes = kATileBytes + 2 * kBTileBytes;
constexpr int kEpilogueLd = kTileN + 4;
constexpr int kSmemBytes = kStages * kStageBytes > kTileM * kEpilogueLd * 4 ? kStages * kStageBytes : kTileM * kEpilogueLd * 4;
constexpr int kThreads = 128;

// 16-byte asynchronous copy global -> shared; zero-fills when !valid.
__device__ __forceinline__ void cp_async16(void* smem, const void* gmem, bool valid) {
  const unsigned addr = static_cast<unsigned>(__cvta_generic_to_shared(smem));
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(addr), "l"(gmem), "r"(valid ? 16 : 0));
}
__device__ __forceinline__ void cp_async_commit() { asm volatile("cp.async.commit_group;\n" ::); }
template <int kPending>
__device__ __forceinline__ void cp_async_wait() {
  asm volatile("cp.async.wait_group %0;\n" ::"n"(kPending));
}

// Pipeline: kStages shared-memory stages of (A tile, gate B tile, up B tile),
// filled by cp.async kStages - 1 K-steps ahead of the tensor cores. Each weight
// row is read 256 bytes at a time (kTileK = 128), which the DRAM pages favour;
// measured on an H200 at decode sizes: K-step 32 x 4 stages 2.0 ms, 64 x 3
// 1.64 ms, 64 x 4 1.64 ms, 128 x 2 1.60 ms, 128 x 3 (one CTA per SM) 2.0 ms.
template <bool kGateUp>
__global__ void __launch_bounds__(kThreads) grouped_gemm_kernel(GroupedGemmParams p) {
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
  const int n_rows = min(kTileN, p.N - n0);
  constexpr int num_b = kGateUp ? 2 : 1;
  const bf16* w = p.w + static_cast<int64_t>(e) * (kGateUp ? 2 * p.N : p.N) * p.K;

  extern __shared__ __align__(128) unsigned char smem[];
  auto a_stage = [&](int s) { return reinterpret_cast<bf16*>(smem + s * kStageBytes); };
  auto b_stage = [&](int s, int h) { return reinterpret_cast<bf16*>(smem + s * kStageBytes + kATileBytes + h * kBTileBytes); };

  // Each thread copies the same 2 chunks of 8 elements of each tile every K-step.
  constexpr int kChunksPerRow = kTileK / 8, kPerThread = kTileM * kChunksPerRow / kThreads;
  const bf16* a_src[kPerThread];
  const bf16* b_src[2][kPerThread];
  int chunk_row[kPerThread], chunk_col[kPerThread];
#pragma unroll
  for (int i = 0; i < kPerThread; ++i) {
    const int c = threadIdx.x + i * kThreads;
    chunk_row[i] = c / kChunksPerRow;
    chunk_col[i] = (c % kChunksPerRow) * 8;
    const int r = chunk_row[i];
    const int a_row = r < rows ? (kGateUp ? p.sorted_token[row0 + r] : row0 + r) : -1;
    a_src[i] = a_row >= 0 ? p.a + static_cast<int64_t>(a_row) * p.K : nullptr;
#pragma unroll
    for (int h = 0; h < num_b; ++h) b_src[h][i] = r < n_rows ? w + static_cast<int64_t>(h * p.N + n0 + r) * p.K : nullptr;
  }
  auto load_stage = [&](int stage, int k_tile) {
    const int k0 = k_tile * kTileK;
#pragma unroll
    for (int i = 0; i < kPerThread; ++i) {
      const int col = k0 + chunk_col[i];
      const bool in_k = col < p.K;
      cp_async16(a_stage(stage) + chunk_row[i] * kLd + chunk_col[i], a_src[i] && in_k ? a_src[i] + col : p.w,
                 a_src[i] && in_k);
#pragma unroll
      for (int h = 0; h < num_b; ++h)
        cp_async16(b_stage(stage, h) + chunk_row[i] * kLd + chunk_col[i], b_src[h][i] && in_k ? b_src[h][i] + col : p.w,
                   b_src[h][i] && in_k);
    }
  };

  const int warp = threadIdx.x >> 5, warp_m = warp / 2, warp_n = warp % 2;  // 2x2 warps of 32x32
  wmma::fragment<wmma::accumulator, 16, 16, 16, float> acc[num_b][2][2];
#pragma unroll
  for (int h = 0; h < num_b; ++h)
#pragma unroll
    for (int i = 0; i < 2; ++i)
#pragma unroll
      for (int j = 0; j < 2; ++j) wmma::fill_fragment(acc[h][i][j], 0.0f);

  const int num_k_tiles = (p.K + kTileK - 1) / kTileK;
#pragma unroll
  for (int s = 0; s < kStages - 1; ++s) {
    if (s < num_k_tiles) load_stage(s, s);
    cp_async_commit();
  }
  for (int kt = 0; kt < num_k_tiles; ++kt) {
    cp_async_wait<kStages - 2>();
    __syncthreads();  // stage kt is in; every warp is done with the stage refilled next
    if (kt + kStages - 1 < num_k_tiles) load_stage((kt + kStages - 1) % kStages, kt + kStages - 1);
    cp_async_commit();
    const int stage = kt % kStages;
#pragma unroll
    for (int kk = 0; kk < kTileK; kk += 16) {
      wmma::fragment<wmma::matrix_a, 16, 16, 16, bf16, wmma::row_major> a_frag[2];
#pragma unroll
      for (int i = 0; i < 2; ++i)
        wmma::load_matrix_sync(a_frag[i], a_stage(stage) + (warp_m * 32 + i * 16) * kLd + kk, kLd);
#pragma unroll
      for (int h = 0; h < num_b; ++h) {
#pragma unroll
        for (int j = 0; j < 2; ++j) {
          wmma::fragment<wmma::matrix_b, 16, 16, 16, bf16, wmma::col_major> b_frag;
          wmma::load_matrix_sync(b_frag, b_stage(stage, h) + (warp_n * 32 + j * 16) * kLd + kk, kLd);
#pragma unroll
          for (int i = 0; i < 2; ++i) wmma::mma_sync(acc[h][i][j], a_frag[i], b_frag, acc[h][i][j]);
        }
      }
    }
  }
  cp_async_wait<0>();
  __syncthreads();

  // Epilogue through shared memory (reusing the pipeline's), one accumulator
  // set at a time: the gate values wait in registers while up is staged.
  float (*c_tile)[kEpilogueLd] = reinterpret_cast<float (*)[kEpilogueLd]>(smem);
  constexpr int kOutPerThread = kTileM * kTileN / kThreads;
  float gate[kOutPerThread];
#pragma unroll
  for (int h = 0; h < num_b; ++h) {
#pragma unroll
    for (int i = 0; i < 2; ++i)
#pragma unroll
      for (int j = 0; j < 2; ++j)
        wmma::store_matrix_sync(&c_tile[warp_m * 32 + i * 16][warp_n * 32 + j * 16], acc[h][i][j], kEpilogueLd,
                                wmma::mem_row_major);
    __syncthreads();
#pragma unroll
    for (int v = 0; v < kOutPerThread; ++v) {
      const int idx = threadIdx.x + v * kThreads, r = idx / kTileN, c = idx % kTileN;
      if (h == 0 && kGateUp) {
        gate[v] = c_tile[r][c];
        continue;
      }
      if (r >= rows || c >= n_rows) continue;
      const int64_t out_index = static_cast<int64_t>(row0 + r) * p.N + n0 + c;
      if (kGateUp) {
        const float g = gate[v], u = c_tile[r][c];
        static_cast<bf16*>(p.out)[out_index] = __float2bfloat16(g / (1.0f + expf(-g)) * u);
      } else if (p.bf16_out) {
        static_cast<bf16*>(p.out)[out_index] = __float2bfloat16(c_tile[r][c]);
      } else {
        static_cast<float*>(p.out)[out_index] = c_tile[r][c];
      }
    }
    __syncthreads();
  }
}

// hidden % 4 == 0: block (token, 1024 columns), a float4 per thread, so a
// decode step's few tokens still fill the GPU (measured on an H200 at 64
// tokens x top-8 x 4096: 21 us for the kernel below, one block per token).
constexpr int kUnpermuteThreads = 256;

// Four consecutive values of a row, f32 or bf16 (MoeUnpermuteParams::bf16_rows).
__device__ __forceinline__ float4 load_row4(const float* row, int i) {
  return reinterpret_cast<const float4*>(row)[i];
}
__device__ __forceinline__ float4 load_row4(const bf16* row, int i) {
  const uint2 raw = reinterpret_cast<const uint2*>(row)[i];
  const float2 lo = __bfloat1622float2(*reinterpret_cast<const __nv_bfloat162*>(&raw.x));
  const float2 hi = __bfloat1622float2(*reinterpret_cast<const __nv_bfloat162*>(&raw.y));
  return make_float4(lo.x, lo.y, hi.x, hi.y);
}

template <typename Row>
__global__ void __launch_bounds__(kUnpermuteThreads) moe_unpermute_vec_kernel(MoeUnpermuteParams p) {
  const int t = blockIdx.x, i = blockIdx.y * kUnpermuteThreads + threadIdx.x, n = p.hidden / 4;
  if (i >= n) return;
  const Row* rows = static_cast<const Row*>(p.rows);
  float4 sum = make_float4(0.0f, 0.0f, 0.0f, 0.0f);
#pragma unroll 8
  for (int j = 0; j < p.k; ++j) {
    const int32_t row = p.row_of[t * p.k + j];
    if (row < 0) continue;
    const float w = p.weights[t * p.k + j];
    const float4 r = load_row4(rows + static_cast<int64_t>(row) * p.hidden, i);
    sum.x += w * r.x, sum.y += w * r.y, sum.z += w * r.z, sum.w += w * r.w;
  }
  reinterpret_cast<float4*>(p.out + static_cast<int64_t>(t) * p.hidden)[i] = sum;
}

template <typename Row>
__global__ void moe_unpermute_kernel(MoeUnpermuteParams p) {
  const int t = blockIdx.x;
  const Row* rows = static_cast<const Row*>(p.rows);
  for (int i = threadIdx.x; i < p.hidden; i += blockDim.x) {
    float sum = 0.0f;
    for (int j = 0; j < p.k; ++j) {
      const int32_t row = p.row_of[t * p.k + j];
      if (row >= 0)
        sum += p.weights[t * p.k + j] * static_cast<float>(rows[static_cast<int64_t>(row) * p.hidden + i]);
    }
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

int moe_permute_blocks(int pairs) {
  constexpr int kPairsPerBlock = 1024, kMaxBlocks = 256;
  return pairs <= 4096 ? 1 : std::min((pairs + kPairsPerBlock - 1) / kPairsPerBlock, kMaxBlocks);
}

cudaError_t moe_permute(const MoePermuteParams& p, cudaStream_t stream) {
  const int blocks = moe_permute_blocks(p.num_tokens * p.k);
  const size_t experts_bytes = p.num_experts * sizeof(int32_t);
  if (blocks == 1 || p.block_counts == nullptr) {
    moe_permute_kernel<<<1, 1024, 2 * experts_bytes, stream>>>(p);
    return cudaGetLastError();
  }
  moe_permute_count_kernel<<<blocks, 256, experts_bytes, stream>>>(p);
  moe_permute_scatter_kernel<<<blocks, 256, 3 * experts_bytes, stream>>>(p);
  return cudaGetLastError();
}

cudaError_t grouped_gemm(const GroupedGemmParams& p, cudaStream_t stream) {
  return hopper_kernels_available() ? wgmma_grouped_gemm(p, stream) : mma_grouped_gemm(p, stream);
}

cudaError_t mma_grouped_gemm(const GroupedGemmParams& p, cudaStream_t stream) {
  if (p.K % 8 != 0) return cudaErrorInvalidValue;
  if (p.max_tiles == 0) return cudaSuccess;
  const dim3 grid((p.N + kTileN - 1) / kTileN, p.max_tiles);
  auto kernel = p.gate_up ? grouped_gemm_kernel<true> : grouped_gemm_kernel<false>;
  // More than 48 KB of dynamic shared memory needs an opt-in (idempotent).
  cudaError_t error = cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, kSmemBytes);
  if (error != cudaSuccess) return error;
  kernel<<<grid, kThreads, kSmemBytes, stream>>>(p);
  return cudaGetLastError();
}

cudaError_t moe_unpermute(const MoeUnpermuteParams& p, cudaStream_t stream) {
  if (p.num_tokens == 0) return cudaSuccess;
  if (p.hidden % 4 == 0) {
    const dim3 grid(p.num_tokens, (p.hidden / 4 + kUnpermuteThreads - 1) / kUnpermuteThreads);
    if (p.bf16_rows) {
      moe_unpermute_vec_kernel<bf16><<<grid, kUnpermuteThreads, 0, stream>>>(p);
    } else {
      moe_unpermute_vec_kernel<float><<<grid, kUnpermuteThreads, 0, stream>>>(p);
    }
  } else if (p.bf16_rows) {
    moe_unpermute_kernel<bf16><<<p.num_tokens, 256, 0, stream>>>(p);
  } else {
    moe_unpermute_kernel<float><<<p.num_tokens, 256, 0, stream>>>(p);
  }
  return cudaGetLastError();
}

}  // namespace moe::ops::cuda
