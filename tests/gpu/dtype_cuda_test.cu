// Our CPU conversions (core/dtype.h) against CUDA's own converters, bit for bit.
//
// A kernel converts each input float with cuda_fp8.h / cuda_fp4.h /
// cuda_bf16.h / cuda_fp16.h intrinsics, another decodes every code of every
// format to float on the GPU; the host compares with our functions. Inputs:
// every float whose low 16 bits are one of {0, 1, 0x7fff, 0x8000, 0x8001,
// 0xffff} (so every bf16 value, every tie of bf16, fp8 and e2m1 rounding and a
// float ulp either side), the same for f16's 13 dropped bits over f16's
// exponent range, zeros, infinities, NaNs, float subnormals, and random floats.
//
// Where CUDA deliberately differs from our contract, only what should agree is
// compared:
//  - NaN results: CUDA returns canonical NaNs (e.g. 0x7f for e4m3 whatever the
//    sign, 0x7fff for bf16/f16), we keep the sign and payload bits. Both must
//    be NaN; the bits are not compared.
//  - e8m0 of a negative number: CUDA scales |x|; our float_to_e8m0_ceil takes
//    an amax (>= 0) and maps anything <= 2^-127 to code 0. Negative inputs are
//    skipped.
//  - e8m0 with __NV_SATFINITE: we have no saturating e8m0; expected = ours with
//    255 clamped to 254 for non-NaN inputs.
// The test skips itself when no GPU is present (CI compiles it, the lead runs
// it on an H200).

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_fp4.h>
#include <cuda_fp8.h>
#include <cuda_runtime.h>
#include <gtest/gtest.h>

#include <cmath>
#include <cstdint>
#include <limits>
#include <random>
#include <string>
#include <vector>

#include "core/dtype.h"

namespace moe {
namespace {

// --- Device side ---------------------------------------------------------------

struct Encoded {  // one input float through every CUDA converter
  uint8_t e4m3_sat, e4m3_nosat, e5m2_sat, e5m2_nosat;
  uint8_t e8m0_sat, e8m0_nosat;  // ceil (cudaRoundPosInf)
  uint8_t e2m1;                  // low nibble
  uint16_t bf16, f16;
};

struct Decoded {  // one code through every CUDA decoder (only the code's low bits used where narrower)
  float f16, bf16, e4m3, e5m2, e8m0, e2m1;
};

__global__ void encode_kernel(const float* in, Encoded* out, int64_t n) {
  for (int64_t i = blockIdx.x * int64_t{blockDim.x} + threadIdx.x; i < n; i += int64_t{gridDim.x} * blockDim.x) {
    const float x = in[i];
    Encoded r;
    r.e4m3_sat = __nv_cvt_float_to_fp8(x, __NV_SATFINITE, __NV_E4M3);
    r.e4m3_nosat = __nv_cvt_float_to_fp8(x, __NV_NOSAT, __NV_E4M3);
    r.e5m2_sat = __nv_cvt_float_to_fp8(x, __NV_SATFINITE, __NV_E5M2);
    r.e5m2_nosat = __nv_cvt_float_to_fp8(x, __NV_NOSAT, __NV_E5M2);
    r.e8m0_sat = __nv_cvt_float_to_e8m0(x, __NV_SATFINITE, cudaRoundPosInf);
    r.e8m0_nosat = __nv_cvt_float_to_e8m0(x, __NV_NOSAT, cudaRoundPosInf);
    r.e2m1 = static_cast<uint8_t>(__nv_cvt_float_to_fp4(x, __NV_E2M1, cudaRoundNearest) & 0xf);
    r.bf16 = __bfloat16_as_ushort(__float2bfloat16_rn(x));
    r.f16 = __half_as_ushort(__float2half_rn(x));
    out[i] = r;
  }
}

__global__ void decode_kernel(Decoded* out) {
  const int code = blockIdx.x * blockDim.x + threadIdx.x;
  if (code >= 65536) return;
  const auto byte = static_cast<__nv_fp8_storage_t>(code & 0xff);
  Decoded r;
  r.f16 = __half2float(__ushort_as_half(static_cast<unsigned short>(code)));
  r.bf16 = __bfloat162float(__ushort_as_bfloat16(static_cast<unsigned short>(code)));
  r.e4m3 = __half2float(__half(__nv_cvt_fp8_to_halfraw(byte, __NV_E4M3)));
  r.e5m2 = __half2float(__half(__nv_cvt_fp8_to_halfraw(byte, __NV_E5M2)));
  r.e8m0 = __bfloat162float(__nv_bfloat16(__nv_cvt_e8m0_to_bf16raw(byte)));
  r.e2m1 = __half2float(__half(__nv_cvt_fp4_to_halfraw(static_cast<__nv_fp4_storage_t>(code & 0xf), __NV_E2M1)));
  out[code] = r;
}

// --- Host side -------------------------------------------------------------------

#define ASSERT_CUDA(expr)                                                   \
  do {                                                                      \
    const cudaError_t err_ = (expr);                                        \
    ASSERT_EQ(err_, cudaSuccess) << #expr << ": " << cudaGetErrorString(err_); \
  } while (0)

template <typename T>
class DeviceArray {
 public:
  explicit DeviceArray(size_t count) : count_(count) {
    if (cudaMalloc(&ptr_, count * sizeof(T)) != cudaSuccess) ptr_ = nullptr;
  }
  ~DeviceArray() { cudaFree(ptr_); }
  DeviceArray(const DeviceArray&) = delete;
  DeviceArray& operator=(const DeviceArray&) = delete;
  T* get() const { return ptr_; }
  size_t num_bytes() const { return count_ * sizeof(T); }

 private:
  T* ptr_ = nullptr;
  size_t count_;
};

class DtypeCuda : public testing::Test {
 protected:
  void SetUp() override {
    int count = 0;
    const cudaError_t err = cudaGetDeviceCount(&count);
    if (err != cudaSuccess || count == 0) {
      GTEST_SKIP() << "no CUDA device (" << cudaGetErrorString(err) << ", count " << count << ")";
    }
  }
};

std::vector<float> test_inputs() {
  std::vector<uint32_t> bits;
  for (uint32_t high = 0; high < 0x10000; ++high)
    for (uint32_t low : {0x0000u, 0x0001u, 0x7fffu, 0x8000u, 0x8001u, 0xffffu}) bits.push_back(high << 16 | low);
  // f16 drops 13 mantissa bits: its ties and their neighbours, for float
  // exponents from below f16's smallest subnormal (2^-24) to past its overflow.
  for (uint32_t sign = 0; sign < 2; ++sign)
    for (uint32_t exponent = 127 - 27; exponent <= 127 + 17; ++exponent)
      for (uint32_t mantissa_top = 0; mantissa_top < 1024; ++mantissa_top)
        for (uint32_t low : {0x0000u, 0x0001u, 0x0fffu, 0x1000u, 0x1001u, 0x1fffu})
          bits.push_back(sign << 31 | exponent << 23 | mantissa_top << 13 | low);
  for (uint32_t special : {0x00000001u, 0x00000003u, 0x00400000u, 0x007fffffu, 0x7f7fffffu, 0x7f800000u,
                           0x7f800001u, 0x7fa00000u, 0x7fc00000u, 0x7fffffffu}) {
    bits.push_back(special);
    bits.push_back(special | 0x80000000u);
  }
  std::mt19937_64 rng(2024);
  std::uniform_int_distribution<uint32_t> exponent(127 - 40, 127 + 40);
  for (int i = 0; i < (1 << 20); ++i) {
    const auto r = static_cast<uint32_t>(rng());
    bits.push_back(r);
    bits.push_back((r & 0x807fffffu) | exponent(rng) << 23);
  }
  std::vector<float> xs(bits.size());
  for (size_t i = 0; i < bits.size(); ++i) xs[i] = bits_to_float(bits[i]);
  return xs;
}

// Compares one converter over all inputs; `want_of` gives our expected code,
// or -1 to skip the input. For a NaN input, `is_nan` (when given) says whether
// a code means NaN, and both codes need only be NaN.
template <typename Got, typename Want>
void compare(const char* what, const std::vector<float>& xs, const std::vector<Encoded>& results, Got got_of,
             Want want_of, bool (*is_nan)(int code)) {
  int failures = 0;
  int64_t compared = 0;
  for (size_t i = 0; i < xs.size(); ++i) {
    const float x = xs[i];
    const int want = want_of(x);
    if (want < 0) continue;
    ++compared;
    const int got = got_of(results[i]);
    const bool ok = std::isnan(x) && is_nan != nullptr ? is_nan(got) && is_nan(want) : got == want;
    if (!ok && ++failures <= 10) {
      ADD_FAILURE() << what << "(" << std::hexfloat << x << " bits 0x" << std::hex << float_to_bits(x)
                    << "): CUDA 0x" << got << ", ours 0x" << want;
    }
  }
  EXPECT_EQ(failures, 0) << what << " over " << compared << " inputs";
}

TEST_F(DtypeCuda, EncodeMatchesCudaConverters) {
  const std::vector<float> xs = test_inputs();
  DeviceArray<float> d_in(xs.size());
  DeviceArray<Encoded> d_out(xs.size());
  ASSERT_NE(d_in.get(), nullptr);
  ASSERT_NE(d_out.get(), nullptr);
  ASSERT_CUDA(cudaMemcpy(d_in.get(), xs.data(), d_in.num_bytes(), cudaMemcpyHostToDevice));
  encode_kernel<<<1024, 256>>>(d_in.get(), d_out.get(), static_cast<int64_t>(xs.size()));
  ASSERT_CUDA(cudaGetLastError());
  ASSERT_CUDA(cudaDeviceSynchronize());
  std::vector<Encoded> results(xs.size());
  ASSERT_CUDA(cudaMemcpy(results.data(), d_out.get(), d_out.num_bytes(), cudaMemcpyDeviceToHost));

  using NaNTest = bool (*)(int);
  constexpr NaNTest kBitForBit = nullptr;
  const NaNTest e4m3_nan = [](int c) { return std::isnan(e4m3_to_float(static_cast<uint8_t>(c))); };
  const NaNTest e5m2_nan = [](int c) { return std::isnan(e5m2_to_float(static_cast<uint8_t>(c))); };
  const NaNTest bf16_nan = [](int c) { return std::isnan(bf16_to_float(static_cast<uint16_t>(c))); };
  const NaNTest f16_nan = [](int c) { return std::isnan(f16_to_float(static_cast<uint16_t>(c))); };

  compare("e4m3 __NV_SATFINITE", xs, results, [](const Encoded& r) { return int{r.e4m3_sat}; },
          [](float x) { return int{float_to_e4m3(x, Overflow::kSaturate)}; }, e4m3_nan);
  compare("e4m3 __NV_NOSAT", xs, results, [](const Encoded& r) { return int{r.e4m3_nosat}; },
          [](float x) { return int{float_to_e4m3(x, Overflow::kNonFinite)}; }, e4m3_nan);
  compare("e5m2 __NV_SATFINITE", xs, results, [](const Encoded& r) { return int{r.e5m2_sat}; },
          [](float x) { return int{float_to_e5m2(x, Overflow::kSaturate)}; }, e5m2_nan);
  compare("e5m2 __NV_NOSAT", xs, results, [](const Encoded& r) { return int{r.e5m2_nosat}; },
          [](float x) { return int{float_to_e5m2(x, Overflow::kNonFinite)}; }, e5m2_nan);
  compare("__float2bfloat16_rn", xs, results, [](const Encoded& r) { return int{r.bf16}; },
          [](float x) { return int{float_to_bf16(x)}; }, bf16_nan);
  compare("__float2half_rn", xs, results, [](const Encoded& r) { return int{r.f16}; },
          [](float x) { return int{float_to_f16(x)}; }, f16_nan);
  // e2m1 has no NaN: both give +6 for any NaN, so every input is compared bit for bit.
  compare("__nv_cvt_float_to_fp4 e2m1", xs, results, [](const Encoded& r) { return int{r.e2m1}; },
          [](float x) { return int{float_to_e2m1(x)}; }, kBitForBit);
  // e8m0 encodes NaN as 0xff on both sides: compared bit for bit too.
  compare("__nv_cvt_float_to_e8m0 rp __NV_NOSAT", xs, results, [](const Encoded& r) { return int{r.e8m0_nosat}; },
          [](float x) { return x < 0 ? -1 : int{float_to_e8m0_ceil(x)}; }, kBitForBit);
  compare("__nv_cvt_float_to_e8m0 rp __NV_SATFINITE", xs, results,
          [](const Encoded& r) { return int{r.e8m0_sat}; },
          [](float x) {
            if (x < 0) return -1;
            const int ours = float_to_e8m0_ceil(x);
            return ours == 255 && !std::isnan(x) ? 254 : ours;
          },
          kBitForBit);
}

// Decoded values agree bit for bit, or are both NaN.
void compare_decoded(const char* what, int num_codes, const std::vector<Decoded>& results,
                     float Decoded::*field, float (*ours)(int code)) {
  int failures = 0;
  for (int code = 0; code < num_codes; ++code) {
    const float cuda = results[code].*field;
    const float mine = ours(code);
    const bool ok = std::isnan(mine) ? std::isnan(cuda) : float_to_bits(cuda) == float_to_bits(mine);
    if (!ok && ++failures <= 10)
      ADD_FAILURE() << what << " code 0x" << std::hex << code << ": CUDA " << std::hexfloat << cuda << ", ours " << mine;
  }
  EXPECT_EQ(failures, 0) << what;
}

TEST_F(DtypeCuda, DecodeMatchesCudaConverters) {
  DeviceArray<Decoded> d_out(65536);
  ASSERT_NE(d_out.get(), nullptr);
  decode_kernel<<<65536 / 256, 256>>>(d_out.get());
  ASSERT_CUDA(cudaGetLastError());
  ASSERT_CUDA(cudaDeviceSynchronize());
  std::vector<Decoded> results(65536);
  ASSERT_CUDA(cudaMemcpy(results.data(), d_out.get(), d_out.num_bytes(), cudaMemcpyDeviceToHost));
  compare_decoded("f16", 65536, results, &Decoded::f16, [](int c) { return f16_to_float(static_cast<uint16_t>(c)); });
  compare_decoded("bf16", 65536, results, &Decoded::bf16, [](int c) { return bf16_to_float(static_cast<uint16_t>(c)); });
  compare_decoded("e4m3", 256, results, &Decoded::e4m3, [](int c) { return e4m3_to_float(static_cast<uint8_t>(c)); });
  compare_decoded("e5m2", 256, results, &Decoded::e5m2, [](int c) { return e5m2_to_float(static_cast<uint8_t>(c)); });
  compare_decoded("e8m0", 256, results, &Decoded::e8m0, [](int c) { return e8m0_to_float(static_cast<uint8_t>(c)); });
  compare_decoded("e2m1", 16, results, &Decoded::e2m1, [](int c) { return e2m1_to_float(static_cast<uint8_t>(c)); });
}

}  // namespace
}  // namespace moe
