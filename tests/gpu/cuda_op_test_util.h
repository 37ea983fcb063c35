// Shared by the CUDA op tests (ops_cuda_test.cc, fp8_cuda_test.cc; one
// binary): random bf16 inputs, device outputs with guard bytes, error
// measures, and the CudaOps fixture. Tolerances: inputs are rounded to bf16
// on both sides, so differences come from f32 summation order (1e-5) and from
// the bf16 rounding of outputs (2^-8 relative, ~4e-3); where the GPU rounds an
// intermediate to bf16 that the CPU keeps in f32 (MoE activations), 2e-2.
#pragma once

#include <cuda_runtime.h>
#include <gtest/gtest.h>

#include <cmath>
#include <cstdlib>
#include <cstring>
#include <random>
#include <string>
#include <vector>

#include "core/cuda/device_buffer.h"
#include "core/dtype.h"
#include "core/tensor.h"
#include "core/thread_pool.h"
#include "ops/cuda/kernels.h"
#include "ops/quant.h"

namespace moe::ops::cuda_test {

namespace k = moe::ops::cuda;
using bf16 = __nv_bfloat16;
constexpr int kGuard = 64;
constexpr uint8_t kSentinel = 0xA5;

inline bool have_gpu() {
  int count = 0;
  return cudaGetDeviceCount(&count) == cudaSuccess && count > 0;
}

// Random values already on the bf16 grid, in f32 and bf16 copies.
struct Host {
  Tensor f32, bf16;
};
inline Host random_bf16(Shape shape, std::mt19937& rng, float scale = 1.0f) {
  Host h{Tensor(DType::kF32, shape), Tensor(DType::kBF16, shape)};
  std::uniform_real_distribution<float> u(-scale, scale);
  for (int64_t i = 0; i < h.f32.num_elements(); ++i) {
    const uint16_t b = float_to_bf16(u(rng));
    h.bf16.data_as<uint16_t>()[i] = b;
    h.f32.data_as<float>()[i] = bf16_to_float(b);
  }
  return h;
}

// A device output with guard bytes after it.
struct Output {
  DeviceBuffer buffer;
  size_t bytes = 0;
  static Output make(size_t bytes) {
    Output o;
    o.bytes = bytes;
    o.buffer = std::move(DeviceBuffer::allocate(bytes + kGuard).value());
    cudaMemset(o.buffer.data(), kSentinel, bytes + kGuard);
    return o;
  }
  template <typename T>
  T* get() const {
    return buffer.data_as<T>();
  }
  std::vector<uint8_t> download() const {
    std::vector<uint8_t> host(bytes + kGuard);
    EXPECT_EQ(cudaMemcpy(host.data(), buffer.data(), host.size(), cudaMemcpyDeviceToHost), cudaSuccess);
    for (int i = 0; i < kGuard; ++i)
      EXPECT_EQ(host[bytes + i], kSentinel) << "guard byte " << i << " overwritten";
    host.resize(bytes);
    return host;
  }
};

inline DeviceTensor upload(const Tensor& t) {
  return std::move(DeviceTensor::upload(t.view()).value());
}
template <typename T>
DeviceTensor upload_vector(const std::vector<T>& v, DType dtype) {
  return upload(
      Tensor::copy_of(TensorView(const_cast<T*>(v.data()), dtype, {static_cast<int64_t>(v.size())})));
}

// max |a - b| / max |b| over all elements; NaN fails.
inline double scaled_error(const std::vector<float>& got, const float* ref, size_t n) {
  double max_diff = 0, max_ref = 1e-30;
  for (size_t i = 0; i < n; ++i) {
    EXPECT_FALSE(std::isnan(got[i])) << "NaN at " << i;
    max_diff = std::max(max_diff, std::fabs(double(got[i]) - ref[i]));
    max_ref = std::max(max_ref, std::fabs(double(ref[i])));
  }
  return max_diff / max_ref;
}

inline std::vector<float> as_floats(const std::vector<uint8_t>& bytes, DType dtype) {
  const size_t n = bytes.size() / (dtype == DType::kBF16 ? 2 : 4);
  std::vector<float> out(n);
  for (size_t i = 0; i < n; ++i) out[i] = load_as_float(dtype, bytes.data(), static_cast<int64_t>(i));
  return out;
}

// A down GEMM run with bf16_out must write its f32 rows rounded once (to
// nearest even), bit for bit; then the un-permute of those rows (bf16_rows)
// must match the reference as the f32 one does. `rerun` writes the bf16 rows
// into `bf16_rows` (as many rows as `f32_rows` holds).
template <typename Rerun>
void expect_bf16_rows(const std::vector<uint8_t>& f32_rows, const Output& bf16_rows, Rerun rerun,
                      const k::MoeUnpermuteParams& unpermute, const float* ref, double tolerance) {
  ASSERT_EQ(rerun(), cudaSuccess);
  const Output out =
      Output::make(static_cast<size_t>(unpermute.num_tokens) * unpermute.hidden * sizeof(float));
  k::MoeUnpermuteParams p = unpermute;
  p.rows = bf16_rows.get<void>(), p.bf16_rows = true, p.out = out.get<float>();
  ASSERT_EQ(k::moe_unpermute(p, nullptr), cudaSuccess);
  ASSERT_EQ(cudaDeviceSynchronize(), cudaSuccess);
  const std::vector<uint8_t> got = bf16_rows.download();
  const size_t count = f32_rows.size() / 4;
  ASSERT_EQ(got.size(), count * 2);
  size_t mismatches = 0, first = count;
  for (size_t i = 0; i < count; ++i) {
    float f;
    uint16_t b;
    std::memcpy(&f, f32_rows.data() + 4 * i, 4);
    std::memcpy(&b, got.data() + 2 * i, 2);
    if (float_to_bf16(f) != b && ++mismatches == 1) first = i;
  }
  EXPECT_EQ(mismatches, 0u) << "bf16 rows differ from the rounded f32 rows, first at element " << first;
  EXPECT_LT(scaled_error(as_floats(out.download(), DType::kF32), ref,
                         static_cast<size_t>(unpermute.num_tokens) * unpermute.hidden),
            tolerance);
}

// The SCOPED_TRACE of a MoE test case.
inline std::string moe_case(const char* name, int tokens, int experts, int hidden, int inter = 0) {
  return std::string(name) + ": " + std::to_string(tokens) + " tokens, " + std::to_string(experts) +
         " experts, hidden " + std::to_string(hidden) + (inter > 0 ? ", inter " + std::to_string(inter) : "");
}

// The end of every grouped-GEMM test: the down GEMM's f32 `rows` ([pairs,
// hidden], permuted) un-permuted with the routing weights into `out` must
// match `ref` ([tokens, hidden]); then `rerun_bf16(bf16_rows)` writes the same
// rows as bf16 (the GEMM's bf16_out) and expect_bf16_rows checks them.
template <typename RerunBf16>
void expect_unpermuted(const Output& rows, const Output& out, const int32_t* row_of, const float* weights,
                       int tokens, int topk, int hidden, const float* ref, double tolerance,
                       RerunBf16 rerun_bf16) {
  const k::MoeUnpermuteParams unpermute{
      rows.get<float>(), row_of, weights, out.get<float>(), tokens, topk, hidden};
  ASSERT_EQ(k::moe_unpermute(unpermute, nullptr), cudaSuccess);
  ASSERT_EQ(cudaDeviceSynchronize(), cudaSuccess);
  const std::vector<uint8_t> f32_rows = rows.download();
  EXPECT_LT(scaled_error(as_floats(out.download(), DType::kF32), ref, static_cast<size_t>(tokens) * hidden),
            tolerance);
  SCOPED_TRACE("bf16 rows");
  const Output bf16_rows = Output::make(f32_rows.size() / 2);
  expect_bf16_rows(
      f32_rows, bf16_rows, [&] { return rerun_bf16(bf16_rows.get<void>()); }, unpermute, ref, tolerance);
}

// The CPU quantizer's 1 x 128 groups of x [rows, cols], row by row: E4M3
// bytes and scales [rows, ceil(cols / 128)] or (by_group) [ceil(cols / 128), rows].
struct Fp8Groups {
  std::vector<uint8_t> values;
  std::vector<float> scales;
};
inline Fp8Groups cpu_fp8_groups(const float* x, int rows, int cols, bool by_group = false) {
  const int groups = (cols + 127) / 128;
  Fp8Groups q{std::vector<uint8_t>(static_cast<size_t>(rows) * cols),
              std::vector<float>(static_cast<size_t>(rows) * groups)};
  for (int r = 0; r < rows; ++r) {
    Tensor row_values(DType::kF8E4M3, {1, cols}),
        row_scales(DType::kF32, quant_scale_shape(QuantFormat::kFp8Block, 1, cols));
    quantize_matrix(x + int64_t{r} * cols,
                    QuantizedTensor{QuantFormat::kFp8Block, row_values.view(), row_scales.view(), TensorView(), 0});
    std::memcpy(q.values.data() + int64_t{r} * cols, row_values.data(), cols);
    for (int g = 0; g < groups; ++g)
      q.scales[by_group ? int64_t{g} * rows + r : int64_t{r} * groups + g] = row_scales.data_as<float>()[g];
  }
  return q;
}

class CudaOps : public testing::Test {
 protected:
  void SetUp() override {
    if (!have_gpu()) GTEST_SKIP() << "no CUDA device";
  }
  std::mt19937 rng_{2026};
  ThreadPool pool_;
};

// Sets environment variable `name` to `value` for one scope (nullptr: leaves
// it alone), then unsets it: the kernels' measuring switches, such as
// MOE_PREFILL_GEMM_CLUSTER (1 or 2) or MOE_PREFILL_STAGED_OUT (0), which
// their launchers read at every launch.
class ScopedEnv {
 public:
  ScopedEnv(const char* name, const char* value) : name_(value != nullptr ? name : nullptr) {
    if (name_ != nullptr) setenv(name_, value, 1);
  }
  ~ScopedEnv() {
    if (name_ != nullptr) unsetenv(name_);
  }
  ScopedEnv(const ScopedEnv&) = delete;
  ScopedEnv& operator=(const ScopedEnv&) = delete;

 private:
  const char* name_;
};

}  // namespace moe::ops::cuda_test
