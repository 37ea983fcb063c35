// All-reduce of bf16 over symmetric memory on NVLink: one-shot and two-shot.
//
// One-shot: every rank copies its input into its half of the symmetric data
// area, the ranks meet (one barrier), then every rank reads all N copies and
// sums them in rank order into its output. Per rank (N - 1) * bytes cross
// NVLink inbound, so its floor is (N - 1) * bytes / 395 GB/s (H200 p2p) plus
// the barrier's round trip (~2-3 us): at 2 ranks, 256 KB costs ~0.7 us of
// transfer, so small messages are latency-bound and one barrier is what
// matters.
//
// Two-shot: after the same copy and barrier, rank r sums part r (1/N of the
// message) of every rank's copy in place (reduce-scatter), the ranks meet
// again, and every rank gathers part p from rank p (all-gather). Per rank
// 2 (N - 1) / N * bytes cross NVLink: at 2 ranks the same bytes as one-shot,
// at 8 ranks 1.75 vs 7 bytes per byte of message; the floor is
// 2 (N - 1) / N * bytes / 395 GB/s, about 170 us for 64 MB at N = 2 (~390 GB/s
// algorithm bandwidth), against NCCL's 262 GB/s measured there.
//
// Work split: vector i (8 bf16, 16 bytes) belongs to block (i / blockDim) %
// gridDim on every rank, so a block only reads what the same block of each
// peer wrote and a per-block barrier suffices. The < 8 trailing elements
// belong to block 0 and are reduced one-shot. The grid is a function of n
// only, identical on every rank.
#include "comm/cuda/kernels.h"
#include "comm/cuda/sync.cuh"

namespace moe::comm::cuda {
namespace {

constexpr int kThreads = 512;
// Vectors per thread in flight in the one-shot sum: with 64 blocks, one at a
// time (x 2 ranks x 16 bytes) kept ~1 MB in flight, ~215 GB/s at 64 MB on two
// H200s against NCCL's 264.
constexpr int kUnroll = 4;

int grid_for(int64_t n) {
  const int64_t vectors = n / 8;
  const int64_t blocks = (vectors + kThreads - 1) / kThreads;
  return static_cast<int>(blocks < 1 ? 1 : (blocks > kMaxBlocks ? kMaxBlocks : blocks));
}

// Copies this block's vectors (and, block 0, the tail) of input into `mine`.
__device__ void copy_in(const AllReduceParams& p, bf16* mine) {
  const int64_t vectors = p.n / 8, stride = static_cast<int64_t>(gridDim.x) * blockDim.x;
  const uint4* src = reinterpret_cast<const uint4*>(p.input);
  uint4* dst = reinterpret_cast<uint4*>(mine);
  for (int64_t i = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; i < vectors; i += stride)
    dst[i] = src[i];
  const int64_t tail = p.n - vectors * 8;
  if (blockIdx.x == 0 && threadIdx.x < tail) mine[vectors * 8 + threadIdx.x] = p.input[vectors * 8 + threadIdx.x];
}

// Block 0: the trailing elements, summed one-shot over every rank's copy.
__device__ void reduce_tail(const AllReduceParams& p, uint32_t launch) {
  const int64_t start = p.n / 8 * 8;
  if (blockIdx.x != 0 || threadIdx.x >= p.n - start) return;
  float acc = 0.0f;
  for (int r = 0; r < p.sym.world; ++r)
    acc += __bfloat162float(__ldcg(reinterpret_cast<const bf16*>(data_half(p.sym, r, launch)) + start + threadIdx.x));
  p.output[start + threadIdx.x] = __float2bfloat16(acc);
}

__global__ void __launch_bounds__(kThreads) one_shot_kernel(AllReduceParams p) {
  const SymmetricView& v = p.sym;
  const uint32_t launch = launch_index(v, kSetAllReduce);
  uint32_t seq = v.counters[kSetAllReduce].barrier[blockIdx.x];
  copy_in(p, reinterpret_cast<bf16*>(data_half(v, v.rank, launch)));
  block_barrier(v, kSetAllReduce, blockIdx.x, ++seq);

  const int64_t vectors = p.n / 8, stride = static_cast<int64_t>(gridDim.x) * blockDim.x;
  const int64_t first = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  for (int64_t i = first; i < vectors; i += kUnroll * stride) {
    float acc[kUnroll][8];
#pragma unroll
    for (int u = 0; u < kUnroll; ++u)
      if (i + u * stride < vectors) sum_over_ranks(v, launch, 16 * (i + u * stride), acc[u]);
#pragma unroll
    for (int u = 0; u < kUnroll; ++u)
      if (i + u * stride < vectors) reinterpret_cast<uint4*>(p.output)[i + u * stride] = to_vec(acc[u]).raw;
  }
  reduce_tail(p, launch);
  finish_launch(v, kSetAllReduce, launch, seq);
}

__global__ void __launch_bounds__(kThreads) two_shot_kernel(AllReduceParams p) {
  const SymmetricView& v = p.sym;
  const uint32_t launch = launch_index(v, kSetAllReduce);
  uint32_t seq = v.counters[kSetAllReduce].barrier[blockIdx.x];
  char* mine = data_half(v, v.rank, launch);
  copy_in(p, reinterpret_cast<bf16*>(mine));
  block_barrier(v, kSetAllReduce, blockIdx.x, ++seq);

  // Part r of the vectors: [r * part, (r + 1) * part).
  const int64_t vectors = p.n / 8, stride = static_cast<int64_t>(gridDim.x) * blockDim.x;
  const int64_t part = (vectors + v.world - 1) / v.world;
  const int64_t first = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  for (int64_t i = first; i < vectors; i += stride) {
    if (i / part != v.rank) continue;
    float acc[8];
    sum_over_ranks(v, launch, 16 * i, acc);
    reinterpret_cast<uint4*>(mine)[i] = to_vec(acc).raw;
  }
  reduce_tail(p, launch);
  block_barrier(v, kSetAllReduce, blockIdx.x, ++seq);

  for (int64_t i = first; i < vectors; i += stride)
    reinterpret_cast<uint4*>(p.output)[i] = load_peer(data_half(v, static_cast<int>(i / part), launch) + 16 * i).raw;
  finish_launch(v, kSetAllReduce, launch, seq);
}

cudaError_t check(const AllReduceParams& p) {
  if (p.sym.world < 1 || p.sym.world > kMaxRanks || p.n < 0 || p.n > all_reduce_max_elements(p.sym))
    return cudaErrorInvalidValue;
  if ((reinterpret_cast<uintptr_t>(p.input) | reinterpret_cast<uintptr_t>(p.output)) % 16 != 0)
    return cudaErrorMisalignedAddress;
  return cudaSuccess;
}

}  // namespace

int64_t all_reduce_max_elements(const SymmetricView& sym) {
  return static_cast<int64_t>(sym.data_bytes / 2 / 256 * 256 / sizeof(bf16));
}

cudaError_t all_reduce_one_shot(const AllReduceParams& p, cudaStream_t stream) {
  if (const cudaError_t e = check(p); e != cudaSuccess) return e;
  if (p.n == 0) return cudaSuccess;
  one_shot_kernel<<<grid_for(p.n), kThreads, 0, stream>>>(p);
  return cudaGetLastError();
}

cudaError_t all_reduce_two_shot(const AllReduceParams& p, cudaStream_t stream) {
  if (const cudaError_t e = check(p); e != cudaSuccess) return e;
  if (p.n == 0) return cudaSuccess;
  two_shot_kernel<<<grid_for(p.n), kThreads, 0, stream>>>(p);
  return cudaGetLastError();
}

size_t two_shot_min_bytes(int world) { return world <= 2 ? size_t{8} << 20 : size_t{256} << 10; }

cudaError_t all_reduce_auto(const AllReduceParams& p, cudaStream_t stream) {
  const int64_t chunk = all_reduce_max_elements(p.sym) / 8 * 8;  // keeps every chunk 16-byte aligned
  if (chunk <= 0) return cudaErrorInvalidValue;
  const bool two_shot = static_cast<size_t>(p.n) * sizeof(bf16) >= two_shot_min_bytes(p.sym.world);
  for (int64_t begin = 0; begin < p.n; begin += chunk) {
    AllReduceParams part = p;
    part.input = p.input + begin;
    part.output = p.output + begin;
    part.n = p.n - begin < chunk ? p.n - begin : chunk;
    const cudaError_t e = two_shot ? all_reduce_two_shot(part, stream) : all_reduce_one_shot(part, stream);
    if (e != cudaSuccess) return e;
  }
  return cudaSuccess;
}

}  // namespace moe::comm::cuda
