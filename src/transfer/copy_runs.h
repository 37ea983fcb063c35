// One kernel for many small copies: a CUDA IPC batch of KV runs (4-16 KB
// each, hundreds per layer) costs one table upload and one launch instead of
// one cudaMemcpyAsync per run (~3 us each, which held paged KV layers to
// 1.5-6 GB/s). Pointers must be valid on the launching device: its own memory,
// or a peer's mapped through peer access or cudaIpcOpenMemHandle.
//
// Roofline: pure data movement, bound by the NVLink write bandwidth (or HBM
// for local copies); a block per run, 16-byte vector copies when source,
// destination and length are 16-byte aligned (KV runs are), bytes otherwise.
//
// Launchers return cudaError_t; any thread may call them with its own stream.
#pragma once

#include <cuda_runtime.h>

#include <cstdint>

namespace moe::transfer::cuda {

struct CopyRun {
  const uint8_t* src = nullptr;
  uint8_t* dst = nullptr;
  uint64_t length_bytes = 0;
};

// runs: [num_runs] in device memory, read by the kernel in stream order.
cudaError_t launch_copy_runs(const CopyRun* runs, int num_runs, cudaStream_t stream);

}  // namespace moe::transfer::cuda
