// Phase clocks of the prefill grouped GEMM (grouped_gemm_prefill.cu) for
// bench/gpu/prefill_gemm_trace. Everything here compiles to nothing unless
// MOE_PREFILL_GEMM_TRACE is defined (the trace tool's own build of the
// kernel), so the library's kernels carry no instrumentation.
#pragma once

#include <cstdint>

namespace moe::ops::cuda {

// Cycle counts of the kernel's phases for bench/gpu/prefill_gemm_trace,
// compiled in only with MOE_PREFILL_GEMM_TRACE: per CTA and warpgroup
// (0: the producer, 1 and 2: the consumers), the %clock cycles spent in each
// of up to kTracePhases phases (the marks below say which), then the warpgroup's
// cycles and %globaltimer nanoseconds from its start to its end. Every
// thread keeps the sums (no divergence around the MMAs); thread 0 of each
// warpgroup stores them.
#ifdef MOE_PREFILL_GEMM_TRACE
inline constexpr int kTracePhases = 9, kTraceSlots = kTracePhases + 2;
__device__ unsigned long long g_prefill_trace[2048][3][kTraceSlots];
struct PhaseClock {
  uint32_t start = now(), last = start, sum[kTracePhases] = {};
  uint64_t start_ns = global_ns();
  static __device__ __forceinline__ uint32_t now() {
    uint32_t t;
    asm volatile("mov.u32 %0, %%clock;" : "=r"(t)::"memory");
    return t;
  }
  static __device__ __forceinline__ uint64_t global_ns() {
    uint64_t t;
    asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t)::"memory");
    return t;
  }
  __device__ __forceinline__ void mark(int phase) {
    const uint32_t t = now();
    sum[phase] += t - last;
    last = t;
  }
  __device__ __forceinline__ void store() const {
    if (threadIdx.x % 128 != 0 || blockIdx.x >= 2048) return;
    unsigned long long* out = g_prefill_trace[blockIdx.x][threadIdx.x / 128];
    for (int i = 0; i < kTracePhases; ++i) out[i] = sum[i];
    out[kTracePhases] = now() - start;
    out[kTracePhases + 1] = global_ns() - start_ns;
  }
};
// 1: the FP8 consumers free each stage as soon as it lands -- no MMAs,
// promotions nor stores --, so the kernel times its stages' data delivery
// alone (prefill_gemm_trace's floor); set by the tool, trace builds only.
__device__ int g_prefill_trace_no_math;
__device__ __forceinline__ bool trace_no_math() { return g_prefill_trace_no_math != 0; }
#else
template <int = 0>
__device__ __forceinline__ bool trace_no_math() {
  return false;
}
// (Templates: never instantiated where the device code compiles out, so no unused warning.)
struct PhaseClock {
  template <int = 0>
  __device__ __forceinline__ void mark(int) {}
  template <int = 0>
  __device__ __forceinline__ void store() const {}
};
#endif

}  // namespace moe::ops::cuda
