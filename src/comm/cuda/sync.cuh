// Device helpers of the comm kernels: flags in symmetric memory with
// release/acquire at system scope, the per-block cross-rank barrier, the
// launch counter shared by a launch's blocks, 16-byte bf16 vectors.
#pragma once

#include <cuda_bf16.h>

#include "comm/cuda/kernels.h"

namespace moe::comm::cuda {

__device__ __forceinline__ void store_release(uint32_t* flag, uint32_t value) {
  asm volatile("st.release.sys.global.u32 [%0], %1;" ::"l"(flag), "r"(value) : "memory");
}

__device__ __forceinline__ uint32_t load_acquire(const uint32_t* flag) {
  uint32_t value;
  asm volatile("ld.acquire.sys.global.u32 %0, [%1];" : "=r"(value) : "l"(flag) : "memory");
  return value;
}

// Flag [set][block][writer] in rank r's signal area.
__device__ __forceinline__ uint32_t* flag_of(const SymmetricView& v, int r, int set, int block, int writer) {
  return reinterpret_cast<uint32_t*>(v.base[r]) + (set * kMaxBlocks + block) * kMaxRanks + writer;
}

// A wait reads the host's abort word only once it has lasted this long (~25
// us): a read over PCIe on every spin would slow every collective.
constexpr unsigned long long kAbortCheckCycles = 50'000;

// Spins until *flag has reached `value` (wrap-safe); gives up when the view's
// abort word is set, traps after its timeout_cycles.
__device__ __forceinline__ void wait_flag(const SymmetricView& v, const uint32_t* flag, uint32_t value) {
  const unsigned long long start = clock64();
  while (static_cast<int32_t>(load_acquire(flag) - value) < 0) {
    const unsigned long long waited = clock64() - start;
    if (waited > kAbortCheckCycles && v.abort != nullptr && *v.abort != 0) return;
    if (v.timeout_cycles != 0 && waited > v.timeout_cycles) __trap();
  }
}

// Block `block` of every rank meets here with sequence number `seq`. Writes
// made by the block before are visible to the peers' same block after.
__device__ __forceinline__ void block_barrier(const SymmetricView& v, int set, int block, uint32_t seq) {
  __syncthreads();
  if (threadIdx.x < v.world) {
    __threadfence_system();
    store_release(flag_of(v, threadIdx.x, set, block, v.rank), seq);
    wait_flag(v, flag_of(v, v.rank, set, block, threadIdx.x), seq);
  }
  __syncthreads();
}

// Every block of a launch reads the set's launch count at its start; the last
// block to finish advances it (after all blocks have read it).
__device__ __forceinline__ uint32_t launch_index(const SymmetricView& v, int set) {
  return *reinterpret_cast<volatile uint32_t*>(&v.counters[set].launch);
}

__device__ __forceinline__ void finish_launch(const SymmetricView& v, int set, uint32_t launch, uint32_t last_seq) {
  __syncthreads();
  if (threadIdx.x == 0) {
    DeviceCounters& c = v.counters[set];
    c.barrier[blockIdx.x] = last_seq;
    __threadfence();
    if (atomicAdd(&c.done, 1u) == gridDim.x - 1) {
      c.done = 0;
      *reinterpret_cast<volatile uint32_t*>(&c.launch) = launch + 1;
      __threadfence();
    }
  }
}

// The data half a launch uses in rank r's allocation.
__device__ __forceinline__ char* data_half(const SymmetricView& v, int r, uint32_t launch) {
  const size_t half = v.data_bytes / 2 / 256 * 256;
  return v.base[r] + kSignalBytes + (launch & 1u) * half;
}

// 8 bf16 in 16 bytes (four bf16x2 words).
struct Vec8 {
  uint4 raw;
};

__device__ __forceinline__ float2 pair_of(const Vec8& v, int i) {
  const uint32_t word = i == 0 ? v.raw.x : i == 1 ? v.raw.y : i == 2 ? v.raw.z : v.raw.w;
  __nv_bfloat162 h;
  memcpy(&h, &word, sizeof word);
  return __bfloat1622float2(h);
}

__device__ __forceinline__ uint32_t pack_pair(float a, float b) {
  const __nv_bfloat162 h = __floats2bfloat162_rn(a, b);
  uint32_t word;
  memcpy(&word, &h, sizeof word);
  return word;
}

__device__ __forceinline__ void add_to(float (&acc)[8], const Vec8& v) {
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    const float2 f = pair_of(v, i);
    acc[2 * i] += f.x;
    acc[2 * i + 1] += f.y;
  }
}

__device__ __forceinline__ Vec8 to_vec(const float (&acc)[8]) {
  Vec8 v;
  v.raw = make_uint4(pack_pair(acc[0], acc[1]), pack_pair(acc[2], acc[3]), pack_pair(acc[4], acc[5]),
                     pack_pair(acc[6], acc[7]));
  return v;
}

// A peer's data, read around L1 (it was written by another GPU).
__device__ __forceinline__ Vec8 load_peer(const void* p) {
  Vec8 v;
  v.raw = __ldcg(reinterpret_cast<const uint4*>(p));
  return v;
}

// The rank-ordered f32 sum of vector `i` (16 bytes at `offset` bytes into
// each rank's data half), every rank's load issued before the first add so
// the peers' NVLink round trips overlap.
__device__ __forceinline__ void sum_over_ranks(const SymmetricView& v, uint32_t launch, size_t offset, float (&acc)[8]) {
  Vec8 in[kMaxRanks];
#pragma unroll
  for (int r = 0; r < kMaxRanks; ++r)
    if (r < v.world) in[r] = load_peer(data_half(v, r, launch) + offset);
#pragma unroll
  for (int j = 0; j < 8; ++j) acc[j] = 0.0f;
#pragma unroll
  for (int r = 0; r < kMaxRanks; ++r)
    if (r < v.world) add_to(acc, in[r]);
}

}  // namespace moe::comm::cuda
