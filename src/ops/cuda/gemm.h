// Dense GEMMs through cuBLASLt: out[M, N] = x[M, K] . w[N, K]^T with bf16
// inputs, fp32 accumulation, and bf16 or f32 output (the HF Linear layout,
// row-major); and the same with E4M3 inputs and DeepSeek-style block scales
// (fp8-block). One Gemm per stream owner; not thread-safe.
#pragma once

#include <cublasLt.h>
#include <cuda_bf16.h>

#include <cstdint>
#include <map>
#include <tuple>

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

  // fp8-block: x [M, K] E4M3 with one f32 scale per row and 128 columns, laid
  // out [K / 128, M] (quantize_fp8_groups with scales_by_group); w [N, K]
  // E4M3 with one f32 scale per 128 x 128 block, [ceil(N / 128), K / 128]
  // (the checkpoints' weight_scale_inv). K a multiple of 512 (cuBLASLt wants
  // the weight scales' rows 16-byte aligned). cuBLASLt has these scale modes
  // from 12.9, on Hopper; has_fp8_block says whether it offers an algorithm
  // for the shape (a host-side query, cached per shape) and matmul_fp8_block
  // fails where it does not.
  bool has_fp8_block(int M, int N, int K, DType out_dtype);
  Status matmul_fp8_block(const uint8_t* x, const float* x_scales, const uint8_t* w, const float* w_scales,
                          void* out, DType out_dtype, int M, int N, int K, cudaStream_t stream);

 private:
  Gemm() = default;
  struct Fp8Plan {
    bool found = false;
    cublasLtMatmulAlgo_t algo{};
  };
  const Fp8Plan& fp8_plan(int M, int N, int K, DType out_dtype);
  cublasLtHandle_t handle_ = nullptr;
  DeviceBuffer workspace_;
  std::map<std::tuple<int, int, int, int>, Fp8Plan> fp8_plans_;
};

}  // namespace moe::ops::cuda
