// The layer boundary in one kernel: all-reduce of the bf16 partial sums, add
// to the f32 residual stream, RMSNorm, bf16 output for the next layer.
//
// One-shot (decode-sized batches): every rank copies its delta rows into its
// symmetric data half, one barrier, then every rank does every row: sum the N
// copies in rank order (f32), residual += sum, normalise. Floor as the
// one-shot all-reduce: (N - 1) * rows * hidden * 2 bytes / 395 GB/s plus one
// barrier; the norm adds a second pass over the row just written (from L1/L2),
// so the goal is to stay within ~10% of the plain all-reduce at hidden 4096.
//
// Two-shot (prefill-sized batches): rows are split over the ranks; rank r
// reduces, adds and normalises its rows and publishes the new residual (f32)
// and normed (bf16) rows in its data half; after a second barrier every rank
// copies the other ranks' rows. Traffic per rank: the reduce-scatter reads
// (N - 1) / N of the bf16 rows, the gather (N - 1) / N of 6 bytes per element:
// floor ~ (N - 1) / N * rows * hidden * 8 bytes / 395 GB/s.
//
// Rows go to blocks in groups: block b owns the groups g with g % gridDim ==
// b on every rank (so its barrier covers what it reads). Up to 8 rows per
// block: groups of one row, the whole block on it; more: groups of 8 rows, a
// warp per row, so a block keeps 8 rows' loads in flight. Every
// thread issues its vectors' loads from all ranks (and the residual's) before
// the first add; the normalised row is written from the residual it just
// stored. The CPU twin: comm/cpu (all_reduce_sum + ops::cpu::add_rms_norm).
#include "comm/cuda/kernels.h"
#include "comm/cuda/sync.cuh"

namespace moe::comm::cuda {
namespace {

constexpr int kThreads = 256;
constexpr int kMaxHidden = 12288;
constexpr int kWarpRowsGroup = kThreads / 32;
constexpr int kRowUnroll = 2;  // vectors per thread whose loads are in flight together

__device__ float warp_sum(float v) {
#pragma unroll
  for (int offset = 16; offset > 0; offset >>= 1) v += __shfl_xor_sync(0xffffffffu, v, offset);
  return v;
}

__device__ float block_sum(float v, float* scratch) {
  v = warp_sum(v);
  __syncthreads();
  if ((threadIdx.x & 31) == 0) scratch[threadIdx.x >> 5] = v;
  __syncthreads();
  float total = 0.0f;
  for (int w = 0; w < (blockDim.x >> 5); ++w) total += scratch[w];
  return total;
}

// Sums row `row` of every rank's delta copy, adds it to the residual and
// writes the normalised row; `member` of `group_size` threads work on it (a
// warp, or the whole block when kBlockRow).
template <bool kBlockRow>
__device__ void reduce_norm_row(const FusedAllReduceNormParams& p, uint32_t launch, int row, int member,
                                int group_size, float* scratch) {
  const SymmetricView& v = p.sym;
  const int vectors = p.hidden / 8;
  const size_t row_offset = static_cast<size_t>(row) * p.hidden;
  float4* residual = reinterpret_cast<float4*>(p.residual + row_offset);
  float sum_squares = 0.0f;
  for (int i0 = member; i0 < vectors; i0 += kRowUnroll * group_size) {
    float acc[kRowUnroll][8];
    float4 res[kRowUnroll][2];
#pragma unroll
    for (int u = 0; u < kRowUnroll; ++u) {
      const int i = i0 + u * group_size;
      if (i >= vectors) continue;
      res[u][0] = residual[2 * i];
      res[u][1] = residual[2 * i + 1];
      sum_over_ranks(v, launch, 2 * (row_offset + 8 * i), acc[u]);
    }
#pragma unroll
    for (int u = 0; u < kRowUnroll; ++u) {
      const int i = i0 + u * group_size;
      if (i >= vectors) continue;
      const float4 x0 = make_float4(res[u][0].x + acc[u][0], res[u][0].y + acc[u][1], res[u][0].z + acc[u][2],
                                    res[u][0].w + acc[u][3]);
      const float4 x1 = make_float4(res[u][1].x + acc[u][4], res[u][1].y + acc[u][5], res[u][1].z + acc[u][6],
                                    res[u][1].w + acc[u][7]);
      residual[2 * i] = x0;
      residual[2 * i + 1] = x1;
      sum_squares += x0.x * x0.x + x0.y * x0.y + x0.z * x0.z + x0.w * x0.w + x1.x * x1.x + x1.y * x1.y +
                     x1.z * x1.z + x1.w * x1.w;
    }
  }
  const float total = kBlockRow ? block_sum(sum_squares, scratch) : warp_sum(sum_squares);
  const float inv_rms = rsqrtf(total / static_cast<float>(p.hidden) + p.eps);
  const uint4* weight = reinterpret_cast<const uint4*>(p.weight);
  uint4* out = reinterpret_cast<uint4*>(p.out + row_offset);
  for (int i = member; i < vectors; i += group_size) {  // this thread's own residual writes, read back
    const float4 x0 = residual[2 * i], x1 = residual[2 * i + 1];
    Vec8 w{weight[i]};
    float y[8] = {x0.x, x0.y, x0.z, x0.w, x1.x, x1.y, x1.z, x1.w};
#pragma unroll
    for (int k = 0; k < 4; ++k) {
      const float2 wk = pair_of(w, k);
      y[2 * k] = wk.x * (y[2 * k] * inv_rms);
      y[2 * k + 1] = wk.y * (y[2 * k + 1] * inv_rms);
    }
    out[i] = to_vec(y).raw;
  }
}

// [begin, end) of the rows rank r owns in the two-shot split.
__device__ void rows_of(int num_tokens, int world, int r, int& begin, int& end) {
  const int each = (num_tokens + world - 1) / world;
  begin = min(num_tokens, r * each);
  end = min(num_tokens, begin + each);
}

__global__ void __launch_bounds__(kThreads) fused_kernel(FusedAllReduceNormParams p) {
  __shared__ float scratch[32];
  const SymmetricView& v = p.sym;
  const uint32_t launch = launch_index(v, kSetAllReduce);
  uint32_t seq = v.counters[kSetAllReduce].barrier[blockIdx.x];
  const int vectors = p.hidden / 8;
  // Groups of one row (a block per row) up to 8 rows per block, else of 8 (a
  // warp per row). Two H200s, hidden 4096: 128 rows took 34.9 us a warp per
  // row against 18.9 for the first version's block per row; 2048 rows 251 us
  // a warp per row against 323.
  const bool block_rows = p.num_tokens <= kWarpRowsGroup * static_cast<int>(gridDim.x);
  const int group_rows = block_rows ? 1 : kWarpRowsGroup;
  auto for_my_rows = [&](auto&& body) {  // body(row) for this block's rows, every thread
    for (int g = blockIdx.x; g * group_rows < p.num_tokens; g += gridDim.x)
      for (int row = g * group_rows; row < min(p.num_tokens, (g + 1) * group_rows); ++row) body(row);
  };
  // Data half layout: delta bf16 [n, hidden] | residual f32 [n, hidden] | out bf16 [n, hidden].
  const size_t elements = static_cast<size_t>(p.num_tokens) * p.hidden;
  char* mine = data_half(v, v.rank, launch);
  for_my_rows([&](int row) {
    for (int i = threadIdx.x; i < vectors; i += blockDim.x) {
      const size_t at = static_cast<size_t>(row) * p.hidden + 8 * i;
      *reinterpret_cast<uint4*>(mine + 2 * at) = *reinterpret_cast<const uint4*>(p.delta + at);
    }
  });
  block_barrier(v, kSetAllReduce, blockIdx.x, ++seq);

  int begin = 0, end = p.num_tokens;
  if (p.two_shot) rows_of(p.num_tokens, v.world, v.rank, begin, end);
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
  for (int g = blockIdx.x; g * group_rows < p.num_tokens; g += gridDim.x) {
    const int row = block_rows ? g : g * group_rows + warp;
    if (row >= p.num_tokens || row < begin || row >= end) continue;  // uniform per block (block rows) or warp
    if (block_rows) {
      reduce_norm_row<true>(p, launch, row, threadIdx.x, blockDim.x, scratch);
    } else {
      reduce_norm_row<false>(p, launch, row, lane, 32, scratch);
    }
  }
  if (p.two_shot) {
    // Publish the rows this rank reduced (residual f32, normed bf16), meet, copy the others'.
    __syncthreads();
    for_my_rows([&](int row) {
      if (row < begin || row >= end) return;
      const size_t at = static_cast<size_t>(row) * p.hidden;
      float4* res_out = reinterpret_cast<float4*>(mine + 2 * elements) + at / 4;
      uint4* norm_out = reinterpret_cast<uint4*>(mine + 6 * elements) + at / 8;
      for (int i = threadIdx.x; i < vectors; i += blockDim.x) {
        res_out[2 * i] = reinterpret_cast<const float4*>(p.residual + at)[2 * i];
        res_out[2 * i + 1] = reinterpret_cast<const float4*>(p.residual + at)[2 * i + 1];
        norm_out[i] = reinterpret_cast<const uint4*>(p.out + at)[i];
      }
    });
    block_barrier(v, kSetAllReduce, blockIdx.x, ++seq);
    for_my_rows([&](int row) {
      if (row >= begin && row < end) return;
      const int owner = min(v.world - 1, row / ((p.num_tokens + v.world - 1) / v.world));
      const char* theirs = data_half(v, owner, launch);
      const size_t at = static_cast<size_t>(row) * p.hidden;
      for (int i = threadIdx.x; i < vectors; i += blockDim.x) {
        const uint4* res = reinterpret_cast<const uint4*>(theirs + 2 * elements + 4 * (at + 8 * i));
        const uint4 r0 = __ldcg(res), r1 = __ldcg(res + 1);
        const Vec8 normed = load_peer(theirs + 6 * elements + 2 * (at + 8 * i));
        reinterpret_cast<uint4*>(p.residual + at + 8 * i)[0] = r0;
        reinterpret_cast<uint4*>(p.residual + at + 8 * i)[1] = r1;
        reinterpret_cast<uint4*>(p.out + at)[i] = normed.raw;
      }
    });
  }
  finish_launch(v, kSetAllReduce, launch, seq);
}

}  // namespace

cudaError_t fused_all_reduce_add_rms_norm(const FusedAllReduceNormParams& p, cudaStream_t stream) {
  if (p.sym.world < 1 || p.sym.world > kMaxRanks || p.hidden % 8 != 0 || p.hidden <= 0 || p.hidden > kMaxHidden ||
      p.num_tokens < 0)
    return cudaErrorInvalidValue;
  const size_t bytes = static_cast<size_t>(p.num_tokens) * p.hidden * (p.two_shot ? 8 : 2);
  if (bytes > p.sym.data_bytes / 2 / 256 * 256) return cudaErrorInvalidValue;
  if ((reinterpret_cast<uintptr_t>(p.delta) | reinterpret_cast<uintptr_t>(p.residual) |
       reinterpret_cast<uintptr_t>(p.out) | reinterpret_cast<uintptr_t>(p.weight)) % 16 != 0)
    return cudaErrorMisalignedAddress;
  if (p.num_tokens == 0) return cudaSuccess;
  const int grid = p.num_tokens < kMaxBlocks ? p.num_tokens : kMaxBlocks;
  fused_kernel<<<grid, kThreads, 0, stream>>>(p);
  return cudaGetLastError();
}

}  // namespace moe::comm::cuda
