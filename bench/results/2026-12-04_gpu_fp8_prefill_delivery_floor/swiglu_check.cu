// Exhaustive: every float gate (up = 1 and up = 3.7), the old swiglu (__expf) against the new (ex2.approx.ftz).
#include <cstdio>
#include <cuda_runtime.h>
__device__ __forceinline__ float old_swiglu(float g, float u) { return __fdividef(g, 1.0f + __expf(-g)) * u; }
__device__ __forceinline__ float new_swiglu(float g, float u) {
  float e;
  asm("ex2.approx.ftz.f32 %0, %1;" : "=f"(e) : "f"(g * -1.4426950408889634f));
  return __fdividef(g, 1.0f + e) * u;
}
__global__ void check(unsigned long long* diffs, unsigned* example) {
  for (unsigned long long i = blockIdx.x * (unsigned long long)blockDim.x + threadIdx.x; i < (1ull << 32);
       i += (unsigned long long)gridDim.x * blockDim.x) {
    const float g = __uint_as_float((unsigned)i);
    for (float u : {1.0f, 3.7f}) {
      const float a = old_swiglu(g, u), b = new_swiglu(g, u);
      const bool same = __float_as_uint(a) == __float_as_uint(b) || (a != a && b != b);
      if (!same) { atomicAdd(diffs, 1ull); atomicExch(example, (unsigned)i); }
    }
  }
}
int main() {
  unsigned long long* d; unsigned* ex;
  cudaMalloc(&d, 8); cudaMalloc(&ex, 4); cudaMemset(d, 0, 8); cudaMemset(ex, 0, 4);
  check<<<132 * 8, 256>>>(d, ex);
  unsigned long long h = 0; unsigned e = 0;
  cudaMemcpy(&h, d, 8, cudaMemcpyDeviceToHost); cudaMemcpy(&e, ex, 4, cudaMemcpyDeviceToHost);
  std::printf("swiglu old vs new over all 2^32 gates x 2 ups: %llu differing (example gate bits 0x%08x, %g); %s\n", h, e,
              *reinterpret_cast<float*>(&e), cudaGetErrorString(cudaGetLastError()));
  return 0;
}
