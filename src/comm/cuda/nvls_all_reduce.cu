// NVLS all-reduce: the NVSwitch reduces and multicasts (NVLink SHARP).
//
// Every rank copies its input into its data half (unicast) and the ranks meet;
// then rank r, for its part (1/N of the vectors), issues
// multimem.ld_reduce on the multicast address (the switch returns the sum of
// all ranks' copies, accumulated in f32) and multimem.st of the result (the
// switch writes it into every rank's copy); after a second barrier every rank
// reads the whole result from its own memory. Per rank only bytes / N go out
// and bytes / N come back per step through the switch, so the floor is about
// bytes / N / 395 GB/s per direction plus two barriers; it pays at many ranks
// and large messages.
//
// Off by default and refused on hosts that disable multicast (nvls.h); this
// file only has to compile everywhere. The < 8 trailing elements are reduced
// one-shot over unicast by block 0. Needs sm_90 or newer (traps elsewhere).
#include "comm/cuda/kernels.h"
#include "comm/cuda/sync.cuh"

namespace moe::comm::cuda {
namespace {

constexpr int kThreads = 512;

__device__ __forceinline__ Vec8 multimem_ld_reduce(const void* address) {
  Vec8 v;
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("multimem.ld_reduce.relaxed.sys.global.add.acc::f32.v4.bf16x2 {%0, %1, %2, %3}, [%4];"
               : "=r"(v.raw.x), "=r"(v.raw.y), "=r"(v.raw.z), "=r"(v.raw.w)
               : "l"(address)
               : "memory");
#else
  v.raw = make_uint4(0, 0, 0, 0);
  __trap();
#endif
  return v;
}

__device__ __forceinline__ void multimem_store(void* address, const Vec8& v) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("multimem.st.relaxed.sys.global.v4.f32 [%0], {%1, %2, %3, %4};" ::"l"(address), "r"(v.raw.x),
               "r"(v.raw.y), "r"(v.raw.z), "r"(v.raw.w)
               : "memory");
#else
  __trap();
#endif
}

__global__ void __launch_bounds__(kThreads) nvls_kernel(NvlsAllReduceParams q) {
  const AllReduceParams& p = q.base;
  const SymmetricView& v = p.sym;
  const uint32_t launch = launch_index(v, kSetAllReduce);
  uint32_t seq = v.counters[kSetAllReduce].barrier[blockIdx.x];
  char* mine = data_half(v, v.rank, launch);
  // The same half, seen through the multicast mapping.
  char* multicast = q.multicast + (data_half(v, v.rank, launch) - v.base[v.rank]);
  const int64_t vectors = p.n / 8, stride = static_cast<int64_t>(gridDim.x) * blockDim.x;
  const int64_t first = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  const int64_t tail_begin = vectors * 8, tail = p.n - tail_begin;
  for (int64_t i = first; i < vectors; i += stride)
    reinterpret_cast<uint4*>(mine)[i] = reinterpret_cast<const uint4*>(p.input)[i];
  if (blockIdx.x == 0 && threadIdx.x < tail)
    reinterpret_cast<bf16*>(mine)[tail_begin + threadIdx.x] = p.input[tail_begin + threadIdx.x];
  block_barrier(v, kSetAllReduce, blockIdx.x, ++seq);

  const int64_t part = (vectors + v.world - 1) / v.world;
  for (int64_t i = first; i < vectors; i += stride) {
    if (i / part != v.rank) continue;
    multimem_store(multicast + 16 * i, multimem_ld_reduce(multicast + 16 * i));
  }
  if (blockIdx.x == 0 && threadIdx.x < tail) {
    float acc = 0.0f;
    for (int r = 0; r < v.world; ++r)
      acc += __bfloat162float(__ldcg(reinterpret_cast<const bf16*>(data_half(v, r, launch)) + tail_begin + threadIdx.x));
    p.output[tail_begin + threadIdx.x] = __float2bfloat16(acc);
  }
  block_barrier(v, kSetAllReduce, blockIdx.x, ++seq);

  for (int64_t i = first; i < vectors; i += stride)
    reinterpret_cast<uint4*>(p.output)[i] = __ldcg(reinterpret_cast<const uint4*>(mine) + i);
  finish_launch(v, kSetAllReduce, launch, seq);
}

}  // namespace

cudaError_t all_reduce_nvls(const NvlsAllReduceParams& q, cudaStream_t stream) {
  const AllReduceParams& p = q.base;
  if (q.multicast == nullptr || p.sym.world < 1 || p.sym.world > kMaxRanks || p.n < 0 ||
      p.n > all_reduce_max_elements(p.sym))
    return cudaErrorInvalidValue;
  if ((reinterpret_cast<uintptr_t>(p.input) | reinterpret_cast<uintptr_t>(p.output)) % 16 != 0)
    return cudaErrorMisalignedAddress;
  if (p.n == 0) return cudaSuccess;
  const int64_t blocks = (p.n / 8 + kThreads - 1) / kThreads;
  const int grid = static_cast<int>(blocks < 1 ? 1 : (blocks > kMaxBlocks ? kMaxBlocks : blocks));
  nvls_kernel<<<grid, kThreads, 0, stream>>>(q);
  return cudaGetLastError();
}

}  // namespace moe::comm::cuda
