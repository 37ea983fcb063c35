// The layer boundary in one kernel: all-reduce of the bf16 partial sums, add
// to the f32 residual stream, RMSNorm, bf16 output for the next layer.
//
// One-shot (decode-sized batches): every rank copies its delta rows into its
// symmetric data half, one barrier, then every rank does every row: sum the N
// copies in rank order (f32), residual += sum, normalise. Floor as the
// one-shot all-reduce: (N - 1) * rows * hidden * 2 bytes / 395 GB/s plus one
// barrier; the norm adds one pass over the row in shared memory, so the goal
// is to stay within ~10% of the plain all-reduce at hidden 4096.
//
// Two-shot (prefill-sized batches): rows are split over the ranks; rank r
// reduces, adds and normalises its rows and publishes the new residual (f32)
// and normed (bf16) rows in its data half; after a second barrier every rank
// copies the other ranks' rows. Traffic per rank: the reduce-scatter reads
// (N - 1) / N of the bf16 rows, the gather (N - 1) / N of 6 bytes per element:
// floor ~ (N - 1) / N * rows * hidden * 8 bytes / 395 GB/s.
//
// Rows belong to block row % gridDim on every rank; one block per row at a
// time, 256 threads, the reduced row kept in shared memory (hidden <= 12288).
// The CPU twin: comm/cpu (all_reduce_sum + ops::cpu::add_rms_norm).
#include "comm/cuda/kernels.h"
#include "comm/cuda/sync.cuh"

namespace moe::comm::cuda {
namespace {

constexpr int kThreads = 256;
constexpr int kMaxHidden = 12288;

__device__ float block_sum(float v, float* scratch) {
#pragma unroll
  for (int offset = 16; offset > 0; offset >>= 1) v += __shfl_xor_sync(0xffffffffu, v, offset);
  __syncthreads();
  if ((threadIdx.x & 31) == 0) scratch[threadIdx.x >> 5] = v;
  __syncthreads();
  float total = 0.0f;
  for (int w = 0; w < (blockDim.x >> 5); ++w) total += scratch[w];
  return total;
}

// Sums row `row` of every rank's delta copy, adds it to the residual and
// writes the normalised row. `sum` is shared memory [hidden].
__device__ void reduce_norm_row(const FusedAllReduceNormParams& p, uint32_t launch, int row, float* sum,
                                float* scratch) {
  const SymmetricView& v = p.sym;
  const int vectors = p.hidden / 8;
  const size_t row_offset = static_cast<size_t>(row) * p.hidden;
  float* residual = p.residual + row_offset;
  float sum_squares = 0.0f;
  for (int i = threadIdx.x; i < vectors; i += blockDim.x) {
    float acc[8] = {};
    for (int r = 0; r < v.world; ++r) add_to(acc, load_peer(data_half(v, r, launch) + 2 * (row_offset + 8 * i)));
#pragma unroll
    for (int j = 0; j < 8; ++j) {
      const float x = residual[8 * i + j] + acc[j];
      residual[8 * i + j] = x;
      sum[8 * i + j] = x;
      sum_squares += x * x;
    }
  }
  const float inv_rms = rsqrtf(block_sum(sum_squares, scratch) / static_cast<float>(p.hidden) + p.eps);
  for (int i = threadIdx.x; i < p.hidden; i += blockDim.x)
    p.out[row_offset + i] = __float2bfloat16(__bfloat162float(p.weight[i]) * (sum[i] * inv_rms));
  __syncthreads();  // the row is complete for every thread; `sum` may be reused
}

// [begin, end) of the rows rank r owns in the two-shot split.
__device__ void rows_of(int num_tokens, int world, int r, int& begin, int& end) {
  const int each = (num_tokens + world - 1) / world;
  begin = min(num_tokens, r * each);
  end = min(num_tokens, begin + each);
}

__global__ void __launch_bounds__(kThreads) fused_kernel(FusedAllReduceNormParams p) {
  extern __shared__ float sum[];  // [hidden]
  __shared__ float scratch[32];
  const SymmetricView& v = p.sym;
  const uint32_t launch = launch_index(v, kSetAllReduce);
  uint32_t seq = v.counters[kSetAllReduce].barrier[blockIdx.x];
  const int vectors = p.hidden / 8;
  // Data half layout: delta bf16 [n, hidden] | residual f32 [n, hidden] | out bf16 [n, hidden].
  const size_t elements = static_cast<size_t>(p.num_tokens) * p.hidden;
  char* mine = data_half(v, v.rank, launch);
  for (int row = blockIdx.x; row < p.num_tokens; row += gridDim.x)
    for (int i = threadIdx.x; i < vectors; i += blockDim.x) {
      const size_t at = static_cast<size_t>(row) * p.hidden + 8 * i;
      *reinterpret_cast<uint4*>(mine + 2 * at) = *reinterpret_cast<const uint4*>(p.delta + at);
    }
  block_barrier(v, kSetAllReduce, blockIdx.x, ++seq);

  int begin = 0, end = p.num_tokens;
  if (p.two_shot) rows_of(p.num_tokens, v.world, v.rank, begin, end);
  for (int row = blockIdx.x; row < p.num_tokens; row += gridDim.x) {
    if (row < begin || row >= end) continue;
    reduce_norm_row(p, launch, row, sum, scratch);
    if (!p.two_shot) continue;
    const size_t at = static_cast<size_t>(row) * p.hidden;
    float* res_out = reinterpret_cast<float*>(mine + 2 * elements) + at;
    bf16* norm_out = reinterpret_cast<bf16*>(mine + 6 * elements) + at;
    for (int i = threadIdx.x; i < p.hidden; i += blockDim.x) {
      res_out[i] = p.residual[at + i];
      norm_out[i] = p.out[at + i];
    }
  }
  if (p.two_shot) {
    block_barrier(v, kSetAllReduce, blockIdx.x, ++seq);
    for (int row = blockIdx.x; row < p.num_tokens; row += gridDim.x) {
      if (row >= begin && row < end) continue;
      const int owner = min(v.world - 1, row / ((p.num_tokens + v.world - 1) / v.world));
      const char* theirs = data_half(v, owner, launch);
      const size_t at = static_cast<size_t>(row) * p.hidden;
      for (int i = threadIdx.x; i < vectors; i += blockDim.x) {
        const uint4* res = reinterpret_cast<const uint4*>(theirs + 2 * elements + 4 * (at + 8 * i));
        reinterpret_cast<uint4*>(p.residual + at + 8 * i)[0] = __ldcg(res);
        reinterpret_cast<uint4*>(p.residual + at + 8 * i)[1] = __ldcg(res + 1);
        reinterpret_cast<uint4*>(p.out + at)[i] = load_peer(theirs + 6 * elements + 2 * (at + 8 * i)).raw;
      }
    }
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
       reinterpret_cast<uintptr_t>(p.out)) % 16 != 0)
    return cudaErrorMisalignedAddress;
  if (p.num_tokens == 0) return cudaSuccess;
  const int grid = p.num_tokens < kMaxBlocks ? p.num_tokens : kMaxBlocks;
  fused_kernel<<<grid, kThreads, p.hidden * sizeof(float), stream>>>(p);
  return cudaGetLastError();
}

}  // namespace moe::comm::cuda
