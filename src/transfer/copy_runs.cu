// See copy_runs.h.
#include "transfer/copy_runs.h"

namespace moe::transfer::cuda {
namespace {

constexpr int kThreads = 256;
constexpr int kMaxBlocks = 2048;
constexpr int kUnroll = 4;  // loads in flight per thread before the stores

__global__ void copy_runs_kernel(const CopyRun* runs, int num_runs) {
  for (int r = blockIdx.x; r < num_runs; r += gridDim.x) {
    const CopyRun run = runs[r];
    const uint64_t n = run.length_bytes;
    const bool aligned =
        ((reinterpret_cast<uintptr_t>(run.src) | reinterpret_cast<uintptr_t>(run.dst) | n) & 15) == 0;
    if (aligned) {
      const uint4* src = reinterpret_cast<const uint4*>(run.src);
      uint4* dst = reinterpret_cast<uint4*>(run.dst);
      const uint64_t num_vectors = n / 16;
      uint64_t i = threadIdx.x;
      for (; i + (kUnroll - 1) * kThreads < num_vectors; i += kUnroll * kThreads) {
        uint4 v[kUnroll];
#pragma unroll
        for (int u = 0; u < kUnroll; ++u) v[u] = src[i + u * kThreads];
#pragma unroll
        for (int u = 0; u < kUnroll; ++u) dst[i + u * kThreads] = v[u];
      }
      for (; i < num_vectors; i += kThreads) dst[i] = src[i];
    } else {
      for (uint64_t i = threadIdx.x; i < n; i += kThreads) run.dst[i] = run.src[i];
    }
  }
}

}  // namespace

cudaError_t launch_copy_runs(const CopyRun* runs, int num_runs, cudaStream_t stream) {
  if (num_runs <= 0) return cudaSuccess;
  const int num_blocks = num_runs < kMaxBlocks ? num_runs : kMaxBlocks;
  copy_runs_kernel<<<num_blocks, kThreads, 0, stream>>>(runs, num_runs);
  return cudaGetLastError();
}

}  // namespace moe::transfer::cuda
