// The L2 read bandwidth of the device, a floor for kernels whose operands come
// back from L2 many times (the prefill grouped GEMMs re-read every expert's
// weights for each row tile and every activation row for each column tile).
// Every SM streams a 24 MB buffer (resident in the 60 MB L2 after a first
// pass) with 16-byte loads; the sum is written so the loads stay.
#include <cuda_runtime.h>

#include <algorithm>
#include <vector>

#include "bench/gpu/l2_bench.h"

namespace moe {
namespace {

__global__ void l2_read_kernel(const int4* data, int64_t count, int passes, int* sink) {
  int acc = 0;
  for (int pass = 0; pass < passes; ++pass)
    for (int64_t i = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; i < count;
         i += static_cast<int64_t>(gridDim.x) * blockDim.x) {
      int64_t j = i + pass * 4099;  // a different thread reads each line on each pass
      if (j >= count) j -= count;
      const int4 v = __ldcg(data + j);
      acc ^= v.x ^ v.y ^ v.z ^ v.w;
    }
  if (acc == 0x7fffffff) *sink = acc;
}

}  // namespace

double l2_read_bandwidth_gbs() {
  const int64_t bytes = int64_t{24} << 20, count = bytes / 16;
  int4* data = nullptr;
  int* sink = nullptr;
  if (cudaMalloc(&data, bytes) != cudaSuccess || cudaMalloc(&sink, sizeof(int)) != cudaSuccess) return 0;
  cudaMemset(data, 1, bytes);
  int device = 0, sms = 0;
  cudaGetDevice(&device);
  cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, device);
  const int passes = 20;
  l2_read_kernel<<<sms * 4, 512>>>(data, count, 1, sink);  // warm: the buffer lands in L2
  cudaEvent_t start, stop;
  cudaEventCreate(&start);
  cudaEventCreate(&stop);
  std::vector<float> ms;
  for (int r = 0; r < 7; ++r) {
    cudaEventRecord(start);
    l2_read_kernel<<<sms * 4, 512>>>(data, count, passes, sink);
    cudaEventRecord(stop);
    cudaEventSynchronize(stop);
    float t = 0;
    cudaEventElapsedTime(&t, start, stop);
    ms.push_back(t);
  }
  std::sort(ms.begin(), ms.end());
  cudaEventDestroy(start);
  cudaEventDestroy(stop);
  cudaFree(data);
  cudaFree(sink);
  return static_cast<double>(bytes) * passes / (ms[ms.size() / 2] * 1e6);
}

}  // namespace moe
