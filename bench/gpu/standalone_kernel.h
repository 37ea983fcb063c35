// For the bench programs that compile one kernel file of the library into
// themselves (attention_trace, prefill_gemm_trace) with its trace points: the
// two library functions such a file calls, defined here for a recent GPU,
// and a check that exits on a CUDA error. Include it once per program, after
// the kernel file.
#pragma once

#include <cuda_runtime.h>

#include <cstdio>
#include <cstdlib>

namespace moe::ops::cuda {
int multiprocessor_count() {
  int device = 0, count = 0;
  cudaGetDevice(&device);
  cudaDeviceGetAttribute(&count, cudaDevAttrMultiProcessorCount, device);
  return count;
}
bool hopper_kernels_available() {
  return true;
}
}  // namespace moe::ops::cuda

#define CK(x)                                              \
  do {                                                     \
    cudaError_t ck = (x);                                  \
    if (ck != cudaSuccess) {                               \
      std::printf("%s: %s\n", #x, cudaGetErrorString(ck)); \
      std::exit(1);                                        \
    }                                                      \
  } while (0)
