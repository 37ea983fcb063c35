// Paged prefill attention on the tensor cores with mma.sync, for GPUs
// without Hopper's wgmma (prefill_attention picks attention_wgmma.cu's kernel
// where it runs), head_dim 128 and up to 16 q heads per kv head; and the
// token groups both prefill kernels take.
#include <cstdint>
#include <span>
#include <vector>

#include "ops/cuda/attention_mma.cuh"

namespace moe::ops::cuda {
namespace {

using namespace mma_attention;

// Measured at 6k tokens on an H200: 16-position chunks 3.77 ms, 32 with two
// blocks per SM 3.52, 64 with one block per SM 3.72; longest groups first: 3.31.
constexpr int kPrefillWarps = kMmaPrefillGroupTokens, kPrefillChunk = 32;
constexpr int kPrefillStageBytes = 2 * kPrefillChunk * kRowBytes;  // K and V rows

struct MmaPrefillParams {
  PagedAttentionParams p;
  const int32_t* group_start;  // [num_groups + 1]: first token of each group of <= kPrefillWarps tokens
};

// Prefill: block = (group of up to 8 consecutive tokens of one sequence, kv
// head); warp w owns token w of the group. The block's threads copy each
// 32-position K/V chunk into shared memory once (double-buffered cp.async)
// and every warp whose token can see the chunk folds it in: 8x less K/V
// traffic than one block per token.
__global__ void __launch_bounds__(kPrefillWarps * 32, 2) mma_prefill_kernel(MmaPrefillParams args) {
  const PagedAttentionParams& p = args.p;
  // Later groups see longer prefixes: start them first, so the short ones fill the tail.
  const int group_index = gridDim.x - 1 - blockIdx.x;
  const int t0 = args.group_start[group_index], t1 = args.group_start[group_index + 1];
  const int kv_head = blockIdx.y, lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  const int t = t0 + warp;
  const bool active = t < t1;
  const int group = p.num_q_heads / p.num_kv_heads;
  const int last_position = p.positions[t1 - 1];  // a group's tokens are in position order
  const int pos = active ? p.positions[t] : -1;
  const int32_t* pages = p.page_table + static_cast<int64_t>(p.token_seq[t0]) * p.max_pages_per_seq;
  extern __shared__ __align__(128) unsigned char smem[];

  uint32_t qa[kD / 16][4];
  if (active) {
    load_q_raw(qa, p.q + (static_cast<int64_t>(t) * p.num_q_heads + kv_head * group) * kD, group, lane);
    scale_q(qa, p.scale * 1.4426950408889634f);
  }
  RowState state;
  state.init();
  const int last_chunk = last_position / kPrefillChunk;
  auto issue = [&](int chunk, int stage) {
    for (int piece = threadIdx.x; piece < kPrefillChunk * 16; piece += blockDim.x)
      copy_chunk_piece<kPrefillChunk>(p, pages, kv_head, chunk, last_position + 1, piece,
                                      smem + stage * kPrefillStageBytes);
    asm volatile("cp.async.commit_group;\n" ::);
  };
  issue(0, 0);
  for (int chunk = 0; chunk <= last_chunk; ++chunk) {
    const int stage = chunk & 1;
    if (chunk < last_chunk) {
      issue(chunk + 1, stage ^ 1);
      asm volatile("cp.async.wait_group 1;\n" ::);
    } else {
      asm volatile("cp.async.wait_group 0;\n" ::);
    }
    __syncthreads();
    if (active && chunk * kPrefillChunk <= pos) {
      const unsigned char* k_tile = smem + stage * kPrefillStageBytes;
      attend_chunk<kPrefillChunk>(state, qa, k_tile, k_tile + kPrefillChunk * kRowBytes,
                                  chunk * kPrefillChunk, 0, pos + 1, lane);
    }
    __syncthreads();  // the stage refilled next is no longer read
  }
  if (!active) return;
  const int g = lane >> 2, tq = lane & 3;
#pragma unroll
  for (int h = 0; h < 2; ++h) {
    state.l[h] += __shfl_xor_sync(0xffffffffu, state.l[h], 1);
    state.l[h] += __shfl_xor_sync(0xffffffffu, state.l[h], 2);
  }
  bf16* out = p.out + (static_cast<int64_t>(t) * p.num_q_heads + kv_head * group) * kD;
#pragma unroll
  for (int dt = 0; dt < kD / 8; ++dt)
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      const int row = g + h * 8;
      if (row >= group) continue;
      const float inv = 1.0f / state.l[h];
      *reinterpret_cast<__nv_bfloat162*>(out + row * kD + dt * 8 + tq * 2) =
          __floats2bfloat162_rn(state.o[dt][2 * h] * inv, state.o[dt][2 * h + 1] * inv);
    }
}

}  // namespace

std::vector<int32_t> prefill_token_groups(std::span<const int32_t> query_start, int group_tokens) {
  std::vector<int32_t> starts;
  for (size_t seq = 0; seq + 1 < query_start.size(); ++seq)
    for (int32_t t = query_start[seq]; t < query_start[seq + 1]; t += group_tokens) starts.push_back(t);
  starts.push_back(query_start.empty() ? 0 : query_start.back());
  return starts;
}

int prefill_group_tokens(int num_q_heads, int num_kv_heads) {
  return hopper_kernels_available() ? wgmma_prefill_group_tokens(num_q_heads, num_kv_heads)
                                    : kMmaPrefillGroupTokens;
}

cudaError_t prefill_attention(const PagedAttentionParams& p, const int32_t* group_start, int num_groups,
                              cudaStream_t stream) {
  return hopper_kernels_available() ? wgmma_prefill_attention(p, group_start, num_groups, stream)
                                    : mma_prefill_attention(p, group_start, num_groups, stream);
}

bool prefill_attention_quantizes() {
  return hopper_kernels_available();
}

cudaError_t mma_prefill_attention(const PagedAttentionParams& p, const int32_t* group_start, int num_groups,
                                  cudaStream_t stream) {
  if (!mma_attention_supported(p) || p.out_fp8 != nullptr) return cudaErrorInvalidValue;
  if (num_groups == 0) return cudaSuccess;
  constexpr int kSmem = 2 * kPrefillStageBytes;
  cudaError_t error =
      cudaFuncSetAttribute(mma_prefill_kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, kSmem);
  if (error != cudaSuccess) return error;
  mma_prefill_kernel<<<dim3(num_groups, p.num_kv_heads), kPrefillWarps * 32, kSmem, stream>>>(
      MmaPrefillParams{p, group_start});
  return cudaGetLastError();
}

}  // namespace moe::ops::cuda
