// Dense GEMMs through cuBLASLt: out[M, N] = x[M, K] . w[N, K]^T with bf16
// inputs, fp32 accumulation, and bf16 or f32 output (the HF Linear layout,
// row-major). One Gemm per stream owner; not thread-safe.
#pragma once

#include <cublasLt.h>
#include <cuda_bf16.h>

#include "core/cuda/device_buffer.h"
#include "core/status.h"

namespace moe::ops::cuda {

class Gemm {
 public:
  static Expected<Gemm> create();
  ~Gemm();
  Gemm(Gemm&& other) noexcept;
  Gemm& operator=(Gemm&&) = delete;
  Gemm(const Gemm&) = delete;

  // out_dtype: kBF16 or kF32.
  Status matmul(const __nv_bfloat16* x, const __nv_bfloat16* w, void* out, DType out_dtype, int M, int N, int K,
                cudaStream_t stream);

 private:
  Gemm() = default;
  cublasLtHandle_t handle_ = nullptr;
  DeviceBuffer workspace_;
};

}  // namespace moe::ops::cuda
