#include "ops/linear.h"

#include <algorithm>
#include <vector>

namespace moe::ops::cpu {

float dot(const float* a, const float* b, int64_t n) {
  constexpr int kLanes = 16;
  float acc[kLanes] = {};
  int64_t i = 0;
  for (; i + kLanes <= n; i += kLanes)
    for (int l = 0; l < kLanes; ++l) acc[l] += a[i + l] * b[i + l];
  float tail = 0.0f;
  for (; i < n; ++i) tail += a[i] * b[i];
  for (int width = kLanes / 2; width > 0; width /= 2)
    for (int l = 0; l < width; ++l) acc[l] += acc[l + width];
  return acc[0] + tail;
}

void to_f32(DType dtype, const void* src, float* dst, int64_t n) {
  if (dtype == DType::kF32) {
    std::copy_n(static_cast<const float*>(src), n, dst);
  } else if (dtype == DType::kBF16) {
    const auto* bits = static_cast<const uint16_t*>(src);
    for (int64_t i = 0; i < n; ++i) dst[i] = bf16_to_float(bits[i]);
  } else {
    for (int64_t i = 0; i < n; ++i) dst[i] = load_as_float(dtype, src, i);
  }
}

void linear(ThreadPool& pool, TensorView x, TensorView w, TensorView out) {
  CHECK(x.rank() == 2 && w.rank() == 2 && out.rank() == 2, "linear wants rank-2 x, w, out");
  const int64_t num_tokens = x.dim(0), in_features = x.dim(1), out_features = w.dim(0);
  CHECK(w.dim(1) == in_features, "linear: x {} vs w {}", x.shape().to_string(), w.shape().to_string());
  CHECK(out.dim(0) == num_tokens && out.dim(1) == out_features, "linear: out {}",
        out.shape().to_string());
  CHECK(x.dtype() == DType::kF32 && out.dtype() == DType::kF32, "linear: x and out must be f32");
  const auto* w_bytes = static_cast<const char*>(w.data());
  const size_t w_row_bytes = dtype_bytes(w.dtype(), in_features);
  linear_rows(
      pool, x.data_as<float>(), num_tokens, in_features, out_features,
      [&](int64_t first, int64_t count, float* dst) {
        for (int64_t r = 0; r < count; ++r)
          to_f32(w.dtype(), w_bytes + (first + r) * w_row_bytes, dst + r * in_features, in_features);
      },
      out.data_as<float>());
}

void linear_rows(ThreadPool& pool, const float* x, int64_t num_tokens, int64_t in_features, int64_t out_features,
                 const LoadWeightRows& load_rows, float* out) {
  constexpr int64_t kRowsPerBlock = 16;
  const int64_t grain = std::max<int64_t>(kRowsPerBlock, 4096 / std::max<int64_t>(1, num_tokens));
  pool.parallel_for(0, out_features, grain, [&](int64_t begin, int64_t end) {
    std::vector<float> w_block(static_cast<size_t>(kRowsPerBlock * in_features));
    for (int64_t n0 = begin; n0 < end; n0 += kRowsPerBlock) {
      const int64_t rows = std::min(kRowsPerBlock, end - n0);
      load_rows(n0, rows, w_block.data());
      for (int64_t t = 0; t < num_tokens; ++t) {
        const float* xt = x + t * in_features;
        for (int64_t r = 0; r < rows; ++r)
          out[t * out_features + n0 + r] = dot(xt, &w_block[r * in_features], in_features);
      }
    }
  });
}

}  // namespace moe::ops::cpu
