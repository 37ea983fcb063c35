#include "ops/norm.h"

#include <cmath>
#include <vector>

#include "ops/linear.h"

namespace moe::ops::cpu {
namespace {

void check_rows(TensorView x, TensorView weight, TensorView out) {
  CHECK(x.rank() == 2 && out.shape() == x.shape(), "rms_norm: x {} out {}", x.shape().to_string(),
        out.shape().to_string());
  CHECK(weight.rank() == 1 && weight.dim(0) == x.dim(1), "rms_norm: weight {} for rows of {}",
        weight.shape().to_string(), x.dim(1));
  CHECK(x.dtype() == DType::kF32 && out.dtype() == DType::kF32, "rms_norm: x/out must be f32");
}

void normalize_row(const float* x, const float* weight, float eps, int64_t dim, float* out) {
  float sum_squares = 0.0f;
  for (int64_t i = 0; i < dim; ++i) sum_squares += x[i] * x[i];
  const float inv_rms = 1.0f / std::sqrt(sum_squares / static_cast<float>(dim) + eps);
  for (int64_t i = 0; i < dim; ++i) out[i] = weight[i] * (x[i] * inv_rms);
}

}  // namespace

void rms_norm(ThreadPool& pool, TensorView x, TensorView weight, float eps, TensorView out) {
  check_rows(x, weight, out);
  const int64_t dim = x.dim(1);
  std::vector<float> w(static_cast<size_t>(dim));
  to_f32(weight.dtype(), weight.data(), w.data(), dim);
  pool.parallel_for(0, x.dim(0), 16, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r)
      normalize_row(x.data_as<float>() + r * dim, w.data(), eps, dim, out.data_as<float>() + r * dim);
  });
}

void add_rms_norm(ThreadPool& pool, TensorView residual, TensorView delta, TensorView weight,
                  float eps, TensorView out) {
  check_rows(residual, weight, out);
  CHECK(delta.shape() == residual.shape() && delta.dtype() == DType::kF32, "add_rms_norm: delta {}",
        delta.shape().to_string());
  const int64_t dim = residual.dim(1);
  std::vector<float> w(static_cast<size_t>(dim));
  to_f32(weight.dtype(), weight.data(), w.data(), dim);
  pool.parallel_for(0, residual.dim(0), 16, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      float* res = residual.data_as<float>() + r * dim;
      const float* d = delta.data_as<float>() + r * dim;
      for (int64_t i = 0; i < dim; ++i) res[i] += d[i];
      normalize_row(res, w.data(), eps, dim, out.data_as<float>() + r * dim);
    }
  });
}

}  // namespace moe::ops::cpu
