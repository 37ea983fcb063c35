// Where the FP8 prefill grouped GEMM's time goes (ops/cuda/grouped_gemm_prefill.cu,
// compiled into this program with its MOE_PREFILL_GEMM_TRACE phase clocks), and
// what rate the tensor cores give its MMA pattern with nothing else running.
//   prefill_gemm_trace [ROWS_PER_EXPERT]    (default 375, Qwen3-235B's MoE shapes;
//                                           MOE_TRACE_NO_MMA_RATE=1: part 1 only)
// 1. Both GEMMs of a layer as the model runs them (gate_up writing E4M3 rows
//    and scales, down bf16 rows), even routing, timed back to back; then one
//    traced launch of each: per warpgroup the share of its cycles in each
//    phase (means over the CTAs) and the SM clock.
// 2. mma_rate: every SM's consumer warpgroups multiplying one stage of
//    shared memory over and over -- as the kernel does per stage (two
//    consumers, per half four m64n128k32 MMAs, wait, 64-FFMA promotion) and in
//    variants (no promotion, one consumer, n256 / n192 MMAs, rows in
//    registers, FFMAs beside the MMAs, three consumers of 64 x 128) --
//    reported as the share of the tensor cores' FP8 peak per clock (4096
//    MACs per SM and cycle, from the SM's own cycle count) and as TFLOP/s
//    over the whole GPU at whatever clock it held.
// 3. (Printed after 1.) The floor the stages' data sets: the kernel's launches
//    with its consumers freeing each stage as soon as it lands (the trace
//    build's g_prefill_trace_no_math), so only its copies take time; the
//    kernel's time against theirs.
// Built with the GPU targets (bench/CMakeLists.txt); run on the GPU machine.
#include <algorithm>
#include <cstdio>
#include <random>
#include <vector>

#include "bench/gpu/standalone_kernel.h"
#include "ops/cuda/grouped_gemm_prefill.cu"
using namespace moe::ops::cuda;

namespace trace_tool {

// MMA shapes the kernel does not use, measured only: d[64 x N, f32] (+)=
// A[64 x 32] * B[32 x N], FP8 E4M3, B (and A for _ss) from shared memory.
[[maybe_unused]] __device__ __forceinline__ void wgmma_m64n256k32_e4m3_ss(float (&d)[128], uint64_t desc_a,
                                                                          uint64_t desc_b, int accumulate) {
#if MOE_SM90A_DEVICE
  asm volatile(
      "{\n.reg .pred p;\nsetp.ne.b32 p, %130, 0;\n"
      "wgmma.mma_async.sync.aligned.m64n256k32.f32.e4m3.e4m3 {%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, "
      "%11, %12, %13, %14, %15, %16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, "
      "%31, %32, %33, %34, %35, %36, %37, %38, %39, %40, %41, %42, %43, %44, %45, %46, %47, %48, %49, %50, "
      "%51, %52, %53, %54, %55, %56, %57, %58, %59, %60, %61, %62, %63, %64, %65, %66, %67, %68, %69, %70, "
      "%71, %72, %73, %74, %75, %76, %77, %78, %79, %80, %81, %82, %83, %84, %85, %86, %87, %88, %89, %90, "
      "%91, %92, %93, %94, %95, %96, %97, %98, %99, %100, %101, %102, %103, %104, %105, %106, %107, %108, "
      "%109, %110, %111, %112, %113, %114, %115, %116, %117, %118, %119, %120, %121, %122, %123, %124, %125, "
      "%126, %127}, %128, %129, p, 1, 1;\n}\n"
      : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]),
        "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15]),
        "+f"(d[16]), "+f"(d[17]), "+f"(d[18]), "+f"(d[19]), "+f"(d[20]), "+f"(d[21]), "+f"(d[22]),
        "+f"(d[23]), "+f"(d[24]), "+f"(d[25]), "+f"(d[26]), "+f"(d[27]), "+f"(d[28]), "+f"(d[29]),
        "+f"(d[30]), "+f"(d[31]), "+f"(d[32]), "+f"(d[33]), "+f"(d[34]), "+f"(d[35]), "+f"(d[36]),
        "+f"(d[37]), "+f"(d[38]), "+f"(d[39]), "+f"(d[40]), "+f"(d[41]), "+f"(d[42]), "+f"(d[43]),
        "+f"(d[44]), "+f"(d[45]), "+f"(d[46]), "+f"(d[47]), "+f"(d[48]), "+f"(d[49]), "+f"(d[50]),
        "+f"(d[51]), "+f"(d[52]), "+f"(d[53]), "+f"(d[54]), "+f"(d[55]), "+f"(d[56]), "+f"(d[57]),
        "+f"(d[58]), "+f"(d[59]), "+f"(d[60]), "+f"(d[61]), "+f"(d[62]), "+f"(d[63]), "+f"(d[64]),
        "+f"(d[65]), "+f"(d[66]), "+f"(d[67]), "+f"(d[68]), "+f"(d[69]), "+f"(d[70]), "+f"(d[71]),
        "+f"(d[72]), "+f"(d[73]), "+f"(d[74]), "+f"(d[75]), "+f"(d[76]), "+f"(d[77]), "+f"(d[78]),
        "+f"(d[79]), "+f"(d[80]), "+f"(d[81]), "+f"(d[82]), "+f"(d[83]), "+f"(d[84]), "+f"(d[85]),
        "+f"(d[86]), "+f"(d[87]), "+f"(d[88]), "+f"(d[89]), "+f"(d[90]), "+f"(d[91]), "+f"(d[92]),
        "+f"(d[93]), "+f"(d[94]), "+f"(d[95]), "+f"(d[96]), "+f"(d[97]), "+f"(d[98]), "+f"(d[99]),
        "+f"(d[100]), "+f"(d[101]), "+f"(d[102]), "+f"(d[103]), "+f"(d[104]), "+f"(d[105]), "+f"(d[106]),
        "+f"(d[107]), "+f"(d[108]), "+f"(d[109]), "+f"(d[110]), "+f"(d[111]), "+f"(d[112]), "+f"(d[113]),
        "+f"(d[114]), "+f"(d[115]), "+f"(d[116]), "+f"(d[117]), "+f"(d[118]), "+f"(d[119]), "+f"(d[120]),
        "+f"(d[121]), "+f"(d[122]), "+f"(d[123]), "+f"(d[124]), "+f"(d[125]), "+f"(d[126]), "+f"(d[127])
      : "l"(desc_a), "l"(desc_b), "r"(accumulate));
#endif
}
[[maybe_unused]] __device__ __forceinline__ void wgmma_m64n192k32_e4m3_ss(float (&d)[96], uint64_t desc_a,
                                                                          uint64_t desc_b, int accumulate) {
#if MOE_SM90A_DEVICE
  asm volatile(
      "{\n.reg .pred p;\nsetp.ne.b32 p, %98, 0;\n"
      "wgmma.mma_async.sync.aligned.m64n192k32.f32.e4m3.e4m3 {%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, "
      "%11, %12, %13, %14, %15, %16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, "
      "%31, %32, %33, %34, %35, %36, %37, %38, %39, %40, %41, %42, %43, %44, %45, %46, %47, %48, %49, %50, "
      "%51, %52, %53, %54, %55, %56, %57, %58, %59, %60, %61, %62, %63, %64, %65, %66, %67, %68, %69, %70, "
      "%71, %72, %73, %74, %75, %76, %77, %78, %79, %80, %81, %82, %83, %84, %85, %86, %87, %88, %89, %90, "
      "%91, %92, %93, %94, %95}, %96, %97, p, 1, 1;\n}\n"
      : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]),
        "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15]),
        "+f"(d[16]), "+f"(d[17]), "+f"(d[18]), "+f"(d[19]), "+f"(d[20]), "+f"(d[21]), "+f"(d[22]),
        "+f"(d[23]), "+f"(d[24]), "+f"(d[25]), "+f"(d[26]), "+f"(d[27]), "+f"(d[28]), "+f"(d[29]),
        "+f"(d[30]), "+f"(d[31]), "+f"(d[32]), "+f"(d[33]), "+f"(d[34]), "+f"(d[35]), "+f"(d[36]),
        "+f"(d[37]), "+f"(d[38]), "+f"(d[39]), "+f"(d[40]), "+f"(d[41]), "+f"(d[42]), "+f"(d[43]),
        "+f"(d[44]), "+f"(d[45]), "+f"(d[46]), "+f"(d[47]), "+f"(d[48]), "+f"(d[49]), "+f"(d[50]),
        "+f"(d[51]), "+f"(d[52]), "+f"(d[53]), "+f"(d[54]), "+f"(d[55]), "+f"(d[56]), "+f"(d[57]),
        "+f"(d[58]), "+f"(d[59]), "+f"(d[60]), "+f"(d[61]), "+f"(d[62]), "+f"(d[63]), "+f"(d[64]),
        "+f"(d[65]), "+f"(d[66]), "+f"(d[67]), "+f"(d[68]), "+f"(d[69]), "+f"(d[70]), "+f"(d[71]),
        "+f"(d[72]), "+f"(d[73]), "+f"(d[74]), "+f"(d[75]), "+f"(d[76]), "+f"(d[77]), "+f"(d[78]),
        "+f"(d[79]), "+f"(d[80]), "+f"(d[81]), "+f"(d[82]), "+f"(d[83]), "+f"(d[84]), "+f"(d[85]),
        "+f"(d[86]), "+f"(d[87]), "+f"(d[88]), "+f"(d[89]), "+f"(d[90]), "+f"(d[91]), "+f"(d[92]),
        "+f"(d[93]), "+f"(d[94]), "+f"(d[95])
      : "l"(desc_a), "l"(desc_b), "r"(accumulate));
#endif
}
[[maybe_unused]] __device__ __forceinline__ void wgmma_m64n128k32_e4m3_rs(float (&d)[64],
                                                                          const uint32_t (&a)[4],
                                                                          uint64_t desc_b, int accumulate) {
#if MOE_SM90A_DEVICE
  asm volatile(
      "{\n.reg .pred p;\nsetp.ne.b32 p, %69, 0;\n"
      "wgmma.mma_async.sync.aligned.m64n128k32.f32.e4m3.e4m3 {%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, "
      "%11, %12, %13, %14, %15, %16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, "
      "%31, %32, %33, %34, %35, %36, %37, %38, %39, %40, %41, %42, %43, %44, %45, %46, %47, %48, %49, %50, "
      "%51, %52, %53, %54, %55, %56, %57, %58, %59, %60, %61, %62, %63}, {%64, %65, %66, %67}, %68, p, 1, "
      "1;\n}\n"
      : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]),
        "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15]),
        "+f"(d[16]), "+f"(d[17]), "+f"(d[18]), "+f"(d[19]), "+f"(d[20]), "+f"(d[21]), "+f"(d[22]),
        "+f"(d[23]), "+f"(d[24]), "+f"(d[25]), "+f"(d[26]), "+f"(d[27]), "+f"(d[28]), "+f"(d[29]),
        "+f"(d[30]), "+f"(d[31]), "+f"(d[32]), "+f"(d[33]), "+f"(d[34]), "+f"(d[35]), "+f"(d[36]),
        "+f"(d[37]), "+f"(d[38]), "+f"(d[39]), "+f"(d[40]), "+f"(d[41]), "+f"(d[42]), "+f"(d[43]),
        "+f"(d[44]), "+f"(d[45]), "+f"(d[46]), "+f"(d[47]), "+f"(d[48]), "+f"(d[49]), "+f"(d[50]),
        "+f"(d[51]), "+f"(d[52]), "+f"(d[53]), "+f"(d[54]), "+f"(d[55]), "+f"(d[56]), "+f"(d[57]),
        "+f"(d[58]), "+f"(d[59]), "+f"(d[60]), "+f"(d[61]), "+f"(d[62]), "+f"(d[63])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(desc_b), "r"(accumulate));
#endif
}

[[maybe_unused]] __device__ __forceinline__ void wgmma_m64n64k32_e4m3_ss(float (&d)[32], uint64_t desc_a,
                                                                         uint64_t desc_b, int accumulate) {
#if MOE_SM90A_DEVICE
  asm volatile(
      "{\n.reg .pred p;\nsetp.ne.b32 p, %34, 0;\n"
      "wgmma.mma_async.sync.aligned.m64n64k32.f32.e4m3.e4m3 {%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, "
      "%11, %12, %13, %14, %15, %16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, "
      "%31}, %32, %33, p, 1, 1;\n}\n"
      : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]),
        "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15]),
        "+f"(d[16]), "+f"(d[17]), "+f"(d[18]), "+f"(d[19]), "+f"(d[20]), "+f"(d[21]), "+f"(d[22]),
        "+f"(d[23]), "+f"(d[24]), "+f"(d[25]), "+f"(d[26]), "+f"(d[27]), "+f"(d[28]), "+f"(d[29]),
        "+f"(d[30]), "+f"(d[31])
      : "l"(desc_a), "l"(desc_b), "r"(accumulate));
#endif
}
[[maybe_unused]] __device__ __forceinline__ void wgmma_m64n64k32_e4m3_rs(float (&d)[32],
                                                                         const uint32_t (&a)[4],
                                                                         uint64_t desc_b, int accumulate) {
#if MOE_SM90A_DEVICE
  asm volatile(
      "{\n.reg .pred p;\nsetp.ne.b32 p, %37, 0;\n"
      "wgmma.mma_async.sync.aligned.m64n64k32.f32.e4m3.e4m3 {%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, "
      "%11, %12, %13, %14, %15, %16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, "
      "%31}, {%32, %33, %34, %35}, %36, p, 1, 1;\n}\n"
      : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]),
        "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15]),
        "+f"(d[16]), "+f"(d[17]), "+f"(d[18]), "+f"(d[19]), "+f"(d[20]), "+f"(d[21]), "+f"(d[22]),
        "+f"(d[23]), "+f"(d[24]), "+f"(d[25]), "+f"(d[26]), "+f"(d[27]), "+f"(d[28]), "+f"(d[29]),
        "+f"(d[30]), "+f"(d[31])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(desc_b), "r"(accumulate));
#endif
}
// One-dimensional bulk copy (the copy engine) of `bytes` into shared memory, completing on `bar`.
[[maybe_unused]] __device__ __forceinline__ void bulk_copy(uint32_t dst, const void* src, uint32_t bytes,
                                                           uint32_t bar) {
#if MOE_SM90A_DEVICE
  asm volatile(
      "cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1], %2, [%3];\n" ::"r"(dst),
      "l"(src), "r"(bytes), "r"(bar)
      : "memory");
#endif
}

// Finite E4M3 bytes in [-1.875, 1.875] (never the NaN codes 0x7f / 0xff).
__global__ void fill_e4m3(uint8_t* p, size_t n, uint32_t seed) {
  for (size_t i = blockIdx.x * size_t{blockDim.x} + threadIdx.x; i < n; i += size_t{gridDim.x} * blockDim.x) {
    uint32_t h = static_cast<uint32_t>(i) * 2654435761u ^ seed;
    h ^= h >> 15, h *= 2246822519u, h ^= h >> 13;
    p[i] = static_cast<uint8_t>((h & 0x3f) | ((h >> 8) & 0x80));
  }
}
__global__ void fill_scales(float* p, size_t n, uint32_t seed) {
  for (size_t i = blockIdx.x * size_t{blockDim.x} + threadIdx.x; i < n; i += size_t{gridDim.x} * blockDim.x) {
    uint32_t h = static_cast<uint32_t>(i) * 2654435761u ^ seed;
    h ^= h >> 15, h *= 2246822519u;
    p[i] = 0.01f + 0.01f * static_cast<float>(h >> 8) / 16777216.0f;
  }
}

// Variants of mma_rate_kernel: what each consumer warpgroup does per round
// with 64 rows x 256 weight rows (kN192Promote: 192) x 128 K (one scale block):
enum Variant {
  kAsKernel,       // per half (n128): 4 MMAs, wait, 64-FFMA promotion (the prefill kernel's pattern)
  kOneConsumer,    // as the kernel, consumer 1 idle
  kNoPromotion,    // the same MMAs and waits, no promotion
  kN256,           // one m64n256 batch per round, wait, no promotion (the register budget's missing shape)
  kN192Promote,    // one m64n192 batch, wait, 96-FFMA promotion (fits the registers: 96 + 96)
  kRs128Promote,   // as the kernel with the rows in registers (RS MMAs; 16 registers loaded per round)
  kMmaBesideFfma,  // consumer 0: the MMAs and waits alone; consumer 1: as many FFMAs, on registers of its own
  kOwnPromote,     // as the kernel, but the promotion's FFMAs read no MMA result (acc = acc * s + s)
  kThreeN128,      // three consumers (384 threads), each 64 x 128: one n128 batch, wait, 64-FFMA promotion
  kTwoN128,        // the same with two consumers
  kN64NoPromotion,    // two consumers, per quarter (n64) four MMAs and a wait, no promotion
  kTwoPartialsN64,    // two consumers of 64 x 256, the stage by quarters (n64) into two partials taking
                      // turns: a quarter's MMAs run while the one before is promoted (wait_group 1)
  kTwoPartialsN128,   // the same by halves (n128; one 64 x 128 sum for both, the registers allow no more)
  kRsTwoPartialsN64,  // kTwoPartialsN64 with the rows in registers (loaded once per round, 16 registers)
};
// A variant + kWithCopies: a third warpgroup meanwhile copies 48 KB at a time
// into shared memory of its own with the copy engine (from L2), as the
// kernel's producer fills its stages: the MMAs' shared-memory reads then share
// the shared memory's bandwidth with those writes.
constexpr int kWithCopies = 100;
// A variant + kWithIdleWarpgroup: the third warpgroup hands its registers
// down and leaves (the CTA's shape and register split as kWithCopies, no copies).
constexpr int kWithIdleWarpgroup = 200;
// Columns each MMA-issuing consumer multiplies per round (of 128 K).
constexpr int variant_columns(int v) {
  return v == kN192Promote ? 192 : v == kThreeN128 || v == kTwoN128 ? 128 : 256;
}
constexpr int variant_threads(int v) {
  return v >= kWithCopies ? 384 : v == kThreeN128 ? 384 : 256;
}
constexpr int variant_mma_consumers(int v) {
  return v == kThreeN128 ? 3 : v == kOneConsumer || v == kMmaBesideFfma ? 1 : 2;
}

template <int kVariantCopies>
__global__ void __launch_bounds__(variant_threads(kVariantCopies), 1)
    mma_rate_kernel(const uint8_t* src, int rounds, float* sink, unsigned long long* cycles,
                    const uint8_t* copy_src) {
#if MOE_SM90A_DEVICE
  constexpr int kVariant = kVariantCopies % kWithCopies;
  constexpr bool kThird = kVariantCopies >= kWithCopies,
                 kCopies = kThird && kVariantCopies < kWithIdleWarpgroup;
  extern __shared__ unsigned char smem_raw[];
  const uint32_t smem = (smem_u32(smem_raw) + 1023) & ~1023u;
  uint8_t* base = smem_raw + (smem - smem_u32(smem_raw));
  constexpr int kBytes = 128 * 128 + 256 * 128;  // a stage: 128 rows, 256 weight rows, 128 bytes each
  for (int i = threadIdx.x * 16; i < kBytes; i += blockDim.x * 16)
    *reinterpret_cast<uint4*>(base + i) = *reinterpret_cast<const uint4*>(src + blockIdx.x * 4096 + i);
  constexpr int kCopyBase = 49152, kCopyBytes = 49152;  // the copier's region, then its barrier and a flag
  const uint32_t copy_bar = smem + kCopyBase + kCopyBytes;
  volatile int* done = reinterpret_cast<volatile int*>(base + kCopyBase + kCopyBytes + 8);
  if (kCopies && threadIdx.x == 0) {
    mbarrier_init(copy_bar, 1);
    *done = 0;
    fence_mbarrier_init_cluster();
  }
  fence_proxy_async_shared();
  __syncthreads();
  const int consumer = __shfl_sync(0xffffffffu, threadIdx.x / 128, 0);
  if constexpr (kThird) {
    if (consumer == 2) {  // the copier
      setmaxnreg_dec<40>();
      if (kCopies && threadIdx.x % 128 == 0) {
        uint32_t phase = 0;
        const uint8_t* from = copy_src + static_cast<size_t>(blockIdx.x) * kCopyBytes;
        while (*done == 0) {
          mbarrier_arrive_expect_tx(copy_bar, kCopyBytes);
          for (int i = 0; i < 3; ++i)
            bulk_copy(smem + kCopyBase + i * 16384, from + i * 16384, 16384, copy_bar);
          mbarrier_wait(copy_bar, phase);
          phase ^= 1;
        }
      }
      return;
    }
    setmaxnreg_inc<232>();
  }
  if (kVariant == kOneConsumer && consumer == 1) return;
  const uint64_t a_desc = sw128_descriptor(smem + consumer * 64 * 128, 16, 1024);
  const uint64_t b_desc = sw128_descriptor(smem + 128 * 128, 16, 1024);
  const float s = 1.0f + 1e-7f * static_cast<float>(threadIdx.x);
  float check = 0.0f;
  const unsigned long long t0 = clock64();
  if constexpr (kVariant == kThreeN128 || kVariant == kTwoN128) {
    float acc[64], part[64];
#pragma unroll
    for (int i = 0; i < 64; ++i) acc[i] = 0.0f;
    for (int r = 0; r < rounds; ++r) {
      wgmma_fence();
#pragma unroll
      for (int kk = 0; kk < 4; ++kk)
        wgmma_m64n128k32_e4m3_ss(part, advance_descriptor(a_desc, kk * 32),
                                 advance_descriptor(b_desc, (r & 1) * 128 * 128 + kk * 32), kk > 0);
      wgmma_commit_group();
      wgmma_wait_group<0>();
#pragma unroll
      for (int i = 0; i < 64; ++i) acc[i] += part[i] * s;
    }
#pragma unroll
    for (int i = 0; i < 64; ++i) check += acc[i];
  } else if constexpr (kVariant == kMmaBesideFfma) {
    float acc[128];
#pragma unroll
    for (int i = 0; i < 128; ++i) acc[i] = static_cast<float>(i);
    float(&part)[64] = *reinterpret_cast<float(*)[64]>(&acc[0]);
    if (consumer == 0) {
      for (int r = 0; r < rounds; ++r) {
#pragma unroll
        for (int half = 0; half < 2; ++half) {
          wgmma_fence();
#pragma unroll
          for (int kk = 0; kk < 4; ++kk)
            wgmma_m64n128k32_e4m3_ss(part, advance_descriptor(a_desc, kk * 32),
                                     advance_descriptor(b_desc, half * 128 * 128 + kk * 32), 1);
          wgmma_commit_group();
          wgmma_wait_group<0>();
          check += part[half * 63];
        }
      }
    } else {
      for (int r = 0; r < rounds; ++r) {
#pragma unroll
        for (int i = 0; i < 128; ++i) acc[i] = acc[i] * s + 1e-3f;
      }
#pragma unroll
      for (int i = 0; i < 128; ++i) check += acc[i];
    }
  } else if constexpr (kVariant == kN64NoPromotion) {
    float part[32];
#pragma unroll
    for (int i = 0; i < 32; ++i) part[i] = 0.0f;
    for (int r = 0; r < rounds; ++r) {
#pragma unroll
      for (int quarter = 0; quarter < 4; ++quarter) {
        wgmma_fence();
#pragma unroll
        for (int kk = 0; kk < 4; ++kk)
          wgmma_m64n64k32_e4m3_ss(part, advance_descriptor(a_desc, kk * 32),
                                  advance_descriptor(b_desc, quarter * 64 * 128 + kk * 32), 1);
        wgmma_commit_group();
        wgmma_wait_group<0>();
        check += part[quarter * 7];
      }
    }
  } else if constexpr (kVariant == kTwoPartialsN64 || kVariant == kRsTwoPartialsN64) {
    constexpr bool kRs = kVariant == kRsTwoPartialsN64;
    float acc[128], p0[32], p1[32];
#pragma unroll
    for (int i = 0; i < 128; ++i) acc[i] = 0.0f;
    const uint32_t* a_words = reinterpret_cast<const uint32_t*>(base + consumer * 64 * 128);
    // Quarters 0, 2 into p0 and 1, 3 into p1; a quarter's promotion under
    // the next one's MMAs. Drained at the end of the round: with a group in
    // flight across the loop's back edge ptxas serialises every wgmma (C7514).
    for (int r = 0; r < rounds; ++r) {
      uint32_t a[4][4];  // kRs: the rows, 16 bytes per thread and k32 slice, as ldmatrix would load them
      if constexpr (kRs) {
#pragma unroll
        for (int kk = 0; kk < 4; ++kk) {
          const uint4 v =
              *reinterpret_cast<const uint4*>(a_words + ((threadIdx.x % 128) * 4 + kk * 512 + 4 * r) % 2048);
          a[kk][0] = v.x, a[kk][1] = v.y, a[kk][2] = v.z, a[kk][3] = v.w;
        }
      }
      auto issue = [&](float(&d)[32], int quarter) {
        wgmma_fence();
#pragma unroll
        for (int kk = 0; kk < 4; ++kk) {
          const uint64_t b = advance_descriptor(b_desc, quarter * 64 * 128 + kk * 32);
          if constexpr (kRs) {
            wgmma_m64n64k32_e4m3_rs(d, a[kk], b, kk > 0);
          } else {
            wgmma_m64n64k32_e4m3_ss(d, advance_descriptor(a_desc, kk * 32), b, kk > 0);
          }
        }
        wgmma_commit_group();
      };
      auto promote = [&](int quarter, const float(&d)[32]) {
#pragma unroll
        for (int i = 0; i < 32; ++i) acc[32 * quarter + i] += d[i] * s;
      };
      issue(p0, 0);
      issue(p1, 1);
      wgmma_wait_group<1>();
      promote(0, p0);
      issue(p0, 2);
      wgmma_wait_group<1>();
      promote(1, p1);
      issue(p1, 3);
      wgmma_wait_group<1>();
      promote(2, p0);
      wgmma_wait_group<0>();
      promote(3, p1);
    }
#pragma unroll
    for (int i = 0; i < 128; ++i) check += acc[i];
  } else if constexpr (kVariant == kTwoPartialsN128) {
    float acc[64], p0[64], p1[64];
#pragma unroll
    for (int i = 0; i < 64; ++i) acc[i] = 0.0f;
    auto issue = [&](float(&d)[64], int half) {
      wgmma_fence();
#pragma unroll
      for (int kk = 0; kk < 4; ++kk)
        wgmma_m64n128k32_e4m3_ss(d, advance_descriptor(a_desc, kk * 32),
                                 advance_descriptor(b_desc, half * 128 * 128 + kk * 32), kk > 0);
      wgmma_commit_group();
    };
    for (int r = 0; r < rounds; ++r) {
      issue(p0, 0);
      issue(p1, 1);
      wgmma_wait_group<1>();
#pragma unroll
      for (int i = 0; i < 64; ++i) acc[i] += p0[i] * s;
      wgmma_wait_group<0>();
#pragma unroll
      for (int i = 0; i < 64; ++i) acc[i] += p1[i] * s;
    }
#pragma unroll
    for (int i = 0; i < 64; ++i) check += acc[i];
  } else if constexpr (kVariant == kN256 || kVariant == kNoPromotion) {
    float acc[128];
#pragma unroll
    for (int i = 0; i < 128; ++i) acc[i] = 0.0f;
    float(&part)[64] = *reinterpret_cast<float(*)[64]>(&acc[0]);
    for (int r = 0; r < rounds; ++r) {
      if constexpr (kVariant == kN256) {
        wgmma_fence();
#pragma unroll
        for (int kk = 0; kk < 4; ++kk)
          wgmma_m64n256k32_e4m3_ss(acc, advance_descriptor(a_desc, kk * 32),
                                   advance_descriptor(b_desc, kk * 32), 1);
        wgmma_commit_group();
        wgmma_wait_group<0>();
        check += acc[0];
      } else {
#pragma unroll
        for (int half = 0; half < 2; ++half) {
          wgmma_fence();
#pragma unroll
          for (int kk = 0; kk < 4; ++kk)
            wgmma_m64n128k32_e4m3_ss(part, advance_descriptor(a_desc, kk * 32),
                                     advance_descriptor(b_desc, half * 128 * 128 + kk * 32), 1);
          wgmma_commit_group();
          wgmma_wait_group<0>();
          check += part[half * 63];
        }
      }
    }
  } else if constexpr (kVariant == kN192Promote) {
    float acc[96], part[96];
#pragma unroll
    for (int i = 0; i < 96; ++i) acc[i] = 0.0f;
    for (int r = 0; r < rounds; ++r) {
      wgmma_fence();
#pragma unroll
      for (int kk = 0; kk < 4; ++kk)
        wgmma_m64n192k32_e4m3_ss(part, advance_descriptor(a_desc, kk * 32),
                                 advance_descriptor(b_desc, kk * 32), kk > 0);
      wgmma_commit_group();
      wgmma_wait_group<0>();
#pragma unroll
      for (int i = 0; i < 96; ++i) acc[i] += part[i] * s;
    }
#pragma unroll
    for (int i = 0; i < 96; ++i) check += acc[i];
  } else {
    float acc[128], part[64];
#pragma unroll
    for (int i = 0; i < 128; ++i) acc[i] = 0.0f;
    const uint32_t* a_words = reinterpret_cast<const uint32_t*>(base + consumer * 64 * 128);
    for (int r = 0; r < rounds; ++r) {
      uint32_t a[4][4];
      if constexpr (kVariant ==
                    kRs128Promote) {  // 16 bytes of rows per thread and k32 slice, as ldmatrix would
#pragma unroll
        for (int kk = 0; kk < 4; ++kk) {
          const uint4 v =
              *reinterpret_cast<const uint4*>(a_words + ((threadIdx.x % 128) * 4 + kk * 512 + 4 * r) % 2048);
          a[kk][0] = v.x, a[kk][1] = v.y, a[kk][2] = v.z, a[kk][3] = v.w;
        }
      }
#pragma unroll
      for (int half = 0; half < 2; ++half) {
        wgmma_fence();
#pragma unroll
        for (int kk = 0; kk < 4; ++kk) {
          if constexpr (kVariant == kRs128Promote) {
            wgmma_m64n128k32_e4m3_rs(part, a[kk], advance_descriptor(b_desc, half * 128 * 128 + kk * 32),
                                     kk > 0);
          } else {
            wgmma_m64n128k32_e4m3_ss(part, advance_descriptor(a_desc, kk * 32),
                                     advance_descriptor(b_desc, half * 128 * 128 + kk * 32), kk > 0);
          }
        }
        wgmma_commit_group();
        wgmma_wait_group<0>();
        if constexpr (kVariant == kOwnPromote) {
          check += part[half * 63];
#pragma unroll
          for (int i = 0; i < 64; ++i) acc[64 * half + i] = acc[64 * half + i] * s + s;
        } else {
#pragma unroll
          for (int i = 0; i < 64; ++i) acc[64 * half + i] += part[i] * s;
        }
      }
    }
#pragma unroll
    for (int i = 0; i < 128; ++i) check += acc[i];
  }
  const unsigned long long t1 = clock64();
  if (kCopies && threadIdx.x == 0) *done = 1;
  sink[blockIdx.x * blockDim.x + threadIdx.x] = check;
  if (threadIdx.x % 128 == 0) cycles[blockIdx.x * 4 + consumer] = t1 - t0;
#endif
}

template <int kVariantCopies>
void mma_rate(const char* name, const uint8_t* src, float* sink, unsigned long long* cycles, int sms,
              const uint8_t* copy_src) {
  constexpr int kVariant = kVariantCopies % kWithCopies;
  const int rounds = 4096,
            smem = 48 * 1024 + 1024 + (kVariantCopies >= kWithCopies ? 49152 + 64 : 0);  // + the copier's
  CK(cudaFuncSetAttribute(mma_rate_kernel<kVariantCopies>, cudaFuncAttributeMaxDynamicSharedMemorySize,
                          smem));
  cudaEvent_t e0, e1;
  cudaEventCreate(&e0);
  cudaEventCreate(&e1);
  std::vector<float> ms;
  for (int rep = 0; rep < 7; ++rep) {
    cudaEventRecord(e0);
    mma_rate_kernel<kVariantCopies>
        <<<sms, variant_threads(kVariantCopies), smem>>>(src, rounds, sink, cycles, copy_src);
    cudaEventRecord(e1);
    CK(cudaEventSynchronize(e1));
    float t;
    cudaEventElapsedTime(&t, e0, e1);
    ms.push_back(t);
  }
  CK(cudaGetLastError());
  std::sort(ms.begin(), ms.end());
  std::vector<unsigned long long> c(4 * sms);
  CK(cudaMemcpy(c.data(), cycles, c.size() * 8, cudaMemcpyDeviceToHost));
  std::vector<unsigned long long> c0;
  for (int b = 0; b < sms; ++b) c0.push_back(c[4 * b]);
  std::sort(c0.begin(), c0.end());
  float first = 0.0f;
  CK(cudaMemcpy(&first, sink, 4, cudaMemcpyDeviceToHost));
  const double macs_per_sm =
      double(rounds) * variant_mma_consumers(kVariant) * 64 * variant_columns(kVariant) * 128;
  const double ideal = macs_per_sm / 4096.0;
  const double flops = 2.0 * macs_per_sm * sms;
  std::printf(
      "  %-46s %6.1f%% of the tensor peak per SM (median CTA %llu cycles for %.0f ideal); %7.1f TFLOP/s, "
      "%.3f ms, GPU clock %.2f GHz (check %g)\n",
      name, 100.0 * ideal / double(c0[sms / 2]), c0[sms / 2], ideal, flops / (ms[3] * 1e9), ms[3],
      double(c0[sms / 2]) / (ms[3] * 1e6), first);
}

}  // namespace trace_tool
using namespace trace_tool;

int main(int argc, char** argv) {
  const int per_expert = argc > 1 ? std::atoi(argv[1]) : 375;
  const int E = 128, H = 4096, I = 1536, pairs = E * per_expert;
  const int sms = multiprocessor_count();
  std::printf("prefill_gemm_trace: %d experts, hidden %d, moe_intermediate %d, %d rows per expert, %d SMs\n",
              E, H, I, per_expert, sms);
  auto alloc = [](size_t bytes) {
    void* p;
    CK(cudaMalloc(&p, bytes));
    return p;
  };
  auto* x_q = static_cast<uint8_t*>(alloc(size_t(pairs) * H));
  auto* x_s = static_cast<float*>(alloc(size_t(pairs) * H / 128 * 4));
  auto* w13 = static_cast<uint8_t*>(alloc(size_t(E) * 2 * I * H));
  auto* s13 = static_cast<float*>(alloc(size_t(E) * (2 * I / 128) * (H / 128) * 4));
  auto* act_q = static_cast<uint8_t*>(alloc(size_t(pairs) * I));
  auto* act_s = static_cast<float*>(alloc(size_t(pairs) * I / 128 * 4));
  auto* w2 = static_cast<uint8_t*>(alloc(size_t(E) * H * I));
  auto* s2 = static_cast<float*>(alloc(size_t(E) * (H / 128) * (I / 128) * 4));
  auto* out = static_cast<uint16_t*>(alloc(size_t(pairs) * H * 2));
  fill_e4m3<<<1024, 256>>>(x_q, size_t(pairs) * H, 1);
  fill_e4m3<<<1024, 256>>>(w13, size_t(E) * 2 * I * H, 2);
  fill_e4m3<<<1024, 256>>>(w2, size_t(E) * H * I, 3);
  fill_scales<<<256, 256>>>(x_s, size_t(pairs) * H / 128, 4);
  fill_scales<<<256, 256>>>(s13, size_t(E) * (2 * I / 128) * (H / 128), 5);
  fill_scales<<<256, 256>>>(s2, size_t(E) * (H / 128) * (I / 128), 6);
  std::vector<int32_t> offsets(E + 1), tiles(E + 1);
  for (int e = 0; e <= E; ++e) {
    offsets[e] = e * per_expert;
    tiles[e] = e * ((per_expert + kPrefillGemmTileRows - 1) / kPrefillGemmTileRows);
  }
  auto* d_offsets = static_cast<int32_t*>(alloc((E + 1) * 4));
  auto* d_tiles = static_cast<int32_t*>(alloc((E + 1) * 4));
  CK(cudaMemcpy(d_offsets, offsets.data(), (E + 1) * 4, cudaMemcpyHostToDevice));
  CK(cudaMemcpy(d_tiles, tiles.data(), (E + 1) * 4, cudaMemcpyHostToDevice));
  const int max_tiles = tiles[E];
  Fp8GroupedGemmParams gate_up{x_q, x_s, nullptr, w13,       s13,  d_offsets, d_tiles, act_q,
                               I,   H,   E,       max_tiles, true, 1,         pairs};
  gate_up.out_scales = act_s;  // E4M3 rows for down, as the model runs it
  Fp8GroupedGemmParams down{act_q, act_s, nullptr, w2,        s2,    d_offsets, d_tiles, out,
                            H,     I,     E,       max_tiles, false, 1,         pairs,   true};
  const double flops_gate_up = 2.0 * pairs * H * 2.0 * I, flops_down = 2.0 * pairs * I * H;
  for (int i = 0; i < 10; ++i) {
    CK(fp8_grouped_gemm_prefill(gate_up, nullptr));
    CK(fp8_grouped_gemm_prefill(down, nullptr));
  }
  CK(cudaDeviceSynchronize());
  cudaEvent_t e[3];
  for (auto& x : e) cudaEventCreate(&x);
  std::vector<float> t_gate_up, t_down;
  for (int rep = 0; rep < 21; ++rep) {
    cudaEventRecord(e[0]);
    fp8_grouped_gemm_prefill(gate_up, nullptr);
    cudaEventRecord(e[1]);
    fp8_grouped_gemm_prefill(down, nullptr);
    cudaEventRecord(e[2]);
    CK(cudaEventSynchronize(e[2]));
    float a, b;
    cudaEventElapsedTime(&a, e[0], e[1]);
    cudaEventElapsedTime(&b, e[1], e[2]);
    t_gate_up.push_back(a), t_down.push_back(b);
  }
  std::sort(t_gate_up.begin(), t_gate_up.end());
  std::sort(t_down.begin(), t_down.end());
  const float gu = t_gate_up[10], dn = t_down[10];
  std::printf(
      "timed back to back (medians of 21): gate_up %.3f ms (%.0f TFLOP/s), down %.3f ms (%.0f TFLOP/s), "
      "both %.3f ms (%.0f TFLOP/s)\n",
      gu, flops_gate_up / (gu * 1e9), dn, flops_down / (dn * 1e9), gu + dn,
      (flops_gate_up + flops_down) / ((gu + dn) * 1e9));
#ifdef MOE_PREFILL_GEMM_TRACE
  const char* producer_phases[] = {"wait for a free stage", "issue copies"};
  const char* consumer_phases[] = {
      "issue half 0 (+ scales)", "wait half 0 MMAs", "promote half 0", "issue half 1",
      "wait next stage",         "wait half 1 MMAs", "promote half 1", "epilogue",
      "wait first stage"};
  // One traced launch (after another, as in a layer): per warpgroup its
  // phases' shares; returns the consumers' mean cycles per CTA.
  auto traced = [&](const Fp8GroupedGemmParams& params, const char* name, bool phases) {
    for (int pass = 0; pass < 2; ++pass) CK(fp8_grouped_gemm_prefill(params, nullptr));
    CK(cudaDeviceSynchronize());
    static unsigned long long tr[2048][3][kTraceSlots];
    CK(cudaMemcpyFromSymbol(tr, g_prefill_trace, sizeof tr));
    const int ctas = sms;  // one CTA per SM, alone or in pairs
    std::printf("%s (traced launch):\n", name);
    double consumer_cycles = 0;
    for (int wg = 0; wg < 3; ++wg) {
      double total = 0, ns = 0, share[kTracePhases] = {};
      for (int b = 0; b < ctas; ++b) {
        total += tr[b][wg][kTracePhases], ns += tr[b][wg][kTracePhases + 1];
        for (int i = 0; i < kTracePhases; ++i) share[i] += tr[b][wg][i];
      }
      if (wg == 1) consumer_cycles = total / ctas;
      std::printf("  warpgroup %d: %.0f cycles per CTA, %.3f GHz%s", wg, total / ctas, total / ns,
                  phases ? ";" : "\n");
      const int count = !phases ? 0 : wg == 0 ? 2 : kTracePhases;
      for (int i = 0; i < count; ++i)
        std::printf(" %s %.1f%%%s", (wg == 0 ? producer_phases : consumer_phases)[i], 100.0 * share[i] / total,
                    i + 1 < count ? "," : "\n");
    }
    return consumer_cycles;
  };
  const double kernel_cycles[2] = {traced(gate_up, "gate_up", true), traced(down, "down", true)};
  // 3. The floor the stages' data sets: the same launches with the consumers
  // freeing each stage as soon as it lands (no MMAs, promotions nor stores),
  // so only the copies into shared memory -- the producer's TMA boxes and
  // scales, in the kernel's order, ring and L2 traffic -- take time. Bytes: a
  // stage brings 128 bytes of each of 128 rows and 256 weight rows (the
  // pairs' multicasts count once per CTA they land in).
  const int one = 1, zero = 0;
  CK(cudaMemcpyToSymbol(g_prefill_trace_no_math, &one, sizeof one));
  std::printf("data delivery alone (the kernel's copies, consumers freeing each stage at once):\n");
  for (int which = 0; which < 2; ++which) {
    const Fp8GroupedGemmParams& params = which == 0 ? gate_up : down;
    for (int i = 0; i < 5; ++i) CK(fp8_grouped_gemm_prefill(params, nullptr));
    std::vector<float> t;
    for (int rep = 0; rep < 21; ++rep) {
      cudaEventRecord(e[0]);
      fp8_grouped_gemm_prefill(params, nullptr);
      cudaEventRecord(e[1]);
      CK(cudaEventSynchronize(e[1]));
      float ms;
      cudaEventElapsedTime(&ms, e[0], e[1]);
      t.push_back(ms);
    }
    std::sort(t.begin(), t.end());
    const int tiles_per_expert = (per_expert + kPrefillGemmTileRows - 1) / kPrefillGemmTileRows;
    const double items = double(E) * tiles_per_expert * (which == 0 ? I / 128 : H / 256);
    const double stages = items * (which == 0 ? H : I) / 128;
    const double bytes = stages * (128 + 256) * 128;
    const double cycles =
        traced(params, which == 0 ? "  gate_up, delivery alone" : "  down, delivery alone", false);
    const float full = which == 0 ? gu : dn;
    // In time, not cycles: the copies alone run the SM clock faster (less
    // power) and their pace does not follow it (H200, 2026-12-04).
    std::printf(
        "  %s: %.3f ms, %.2f TB/s of stage bytes (%.1f bytes per SM cycle); the kernel %.3f ms (%.2f TB/s): "
        "at %.1f%% of its data's pace (cycles per CTA %.0f against %.0f alone)\n",
        which == 0 ? "gate_up" : "down", t[10], bytes / (t[10] * 1e9), bytes / sms / cycles, full,
        bytes / (full * 1e9), 100.0 * t[10] / full, kernel_cycles[which], cycles);
  }
  CK(cudaMemcpyToSymbol(g_prefill_trace_no_math, &zero, sizeof zero));
#endif
  if (std::getenv("MOE_TRACE_NO_MMA_RATE") != nullptr) return 0;  // the GEMMs only
  // The tensor cores' rate for the kernel's MMA pattern, from shared memory alone.
  auto* src = static_cast<uint8_t*>(alloc(size_t(sms) * 4096 + 49152));
  fill_e4m3<<<256, 256>>>(src, size_t(sms) * 4096 + 49152, 7);
  auto* sink = static_cast<float*>(alloc(size_t(sms) * 384 * 4));
  auto* cycles = static_cast<unsigned long long*>(alloc(size_t(sms) * 4 * 8));
  auto* copy_src = static_cast<uint8_t*>(alloc(size_t(sms) * 49152));
  fill_e4m3<<<256, 256>>>(copy_src, size_t(sms) * 49152, 8);
  std::printf("mma_rate (every SM, 4096 rounds of one 128-deep stage per consumer):\n");
  mma_rate<kAsKernel>("n128 halves, wait, promote (the kernel's)", src, sink, cycles, sms, copy_src);
  mma_rate<kOneConsumer>("the kernel's, one consumer", src, sink, cycles, sms, copy_src);
  mma_rate<kNoPromotion>("n128 halves, wait, no promotion", src, sink, cycles, sms, copy_src);
  mma_rate<kN256>("n256 batch, wait, no promotion", src, sink, cycles, sms, copy_src);
  mma_rate<kN192Promote>("n192 batch, wait, promote", src, sink, cycles, sms, copy_src);
  mma_rate<kRs128Promote>("the kernel's with the rows in registers (RS)", src, sink, cycles, sms, copy_src);
  mma_rate<kMmaBesideFfma>("MMAs alone, FFMAs in the other warpgroup", src, sink, cycles, sms, copy_src);
  mma_rate<kOwnPromote>("the kernel's, FFMAs reading no MMA result", src, sink, cycles, sms, copy_src);
  mma_rate<kTwoN128>("two consumers of 64 x 128 (n128, promote)", src, sink, cycles, sms, copy_src);
  mma_rate<kThreeN128>("three consumers of 64 x 128 (n128, promote)", src, sink, cycles, sms, copy_src);
  mma_rate<kN64NoPromotion>("n64 quarters, wait, no promotion", src, sink, cycles, sms, copy_src);
  mma_rate<kTwoPartialsN64>("n64 quarters into two partials taking turns", src, sink, cycles, sms, copy_src);
  mma_rate<kTwoPartialsN128>("n128 halves into two partials taking turns", src, sink, cycles, sms, copy_src);
  mma_rate<kRsTwoPartialsN64>("n64 quarters, two partials, rows in registers", src, sink, cycles, sms,
                              copy_src);
  std::printf(" the same while a copier writes 48 KB at a time into shared memory (copy engine, from L2):\n");
  mma_rate<kWithCopies + kNoPromotion>("n128 halves, wait, no promotion", src, sink, cycles, sms, copy_src);
  mma_rate<kWithCopies + kAsKernel>("n128 halves, wait, promote (the kernel's)", src, sink, cycles, sms,
                                    copy_src);
  mma_rate<kWithCopies + kTwoPartialsN64>("n64 quarters into two partials taking turns", src, sink, cycles,
                                          sms, copy_src);
  mma_rate<kWithCopies + kRsTwoPartialsN64>("n64 quarters, two partials, rows in registers", src, sink,
                                            cycles, sms, copy_src);
  std::printf(" with a third warpgroup that hands its registers down and leaves (no copies):\n");
  mma_rate<kWithIdleWarpgroup + kAsKernel>("n128 halves, wait, promote (the kernel's)", src, sink, cycles,
                                           sms, copy_src);
  mma_rate<kWithIdleWarpgroup + kTwoPartialsN64>("n64 quarters into two partials taking turns", src, sink,
                                                 cycles, sms, copy_src);
  return 0;
}
