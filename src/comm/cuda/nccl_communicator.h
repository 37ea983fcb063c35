// NCCL as the fallback all-reduce (--all-reduce nccl) and the baseline the
// benchmarks compare against. libnccl is loaded with dlopen at run time
// (libnccl.so.2, searched on the usual library path), never linked: the same
// binary starts where NCCL is missing (the wrapper then reports Unavailable)
// and, built with MOE_STATIC_RUNTIME, uses whatever NCCL the GPU machine has
// (for example PyTorch's, via LD_LIBRARY_PATH). Compiled when nccl.h is found.
//
// Threads: one thread per rank; all_reduce may be called from that thread on
// any stream of the rank's device.
#pragma once

#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <memory>

#include "comm/bootstrap.h"
#include "core/status.h"

namespace moe::comm::cuda {

class NcclCommunicator {
 public:
  // Whether libnccl can be loaded here (and its version, e.g. "2.28.3").
  static Expected<std::string> library_version();
  // Collective: rank 0 draws the unique id and the bootstrap broadcasts it.
  static Expected<std::unique_ptr<NcclCommunicator>> create(TcpBootstrap& bootstrap, int device);
  ~NcclCommunicator();
  NcclCommunicator(const NcclCommunicator&) = delete;
  NcclCommunicator& operator=(const NcclCommunicator&) = delete;

  // output[n] = sum over ranks of input[n] (bf16; in place allowed).
  Status all_reduce(const __nv_bfloat16* input, __nv_bfloat16* output, int64_t n, cudaStream_t stream);

 private:
  NcclCommunicator() = default;
  void* comm_ = nullptr;  // ncclComm_t
};

}  // namespace moe::comm::cuda
