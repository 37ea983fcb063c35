#include "ops/cuda/gemm.h"

#include <utility>

namespace moe::ops::cuda {
namespace {

constexpr size_t kWorkspaceBytes = 32 << 20;

Status cublas_status(cublasStatus_t status, const char* what) {
  if (status == CUBLAS_STATUS_SUCCESS) return Status::ok();
  return internal_error("{}: cuBLASLt status {}", what, static_cast<int>(status));
}

#define MOE_CUBLAS_RETURN_IF_ERROR(expr) MOE_RETURN_IF_ERROR(cublas_status((expr), #expr))

// RAII holders for the per-call descriptors.
struct Descriptors {
  cublasLtMatmulDesc_t op = nullptr;
  cublasLtMatrixLayout_t a = nullptr, b = nullptr, c = nullptr;
  cublasLtMatmulPreference_t preference = nullptr;
  ~Descriptors() {
    if (preference) cublasLtMatmulPreferenceDestroy(preference);
    if (c) cublasLtMatrixLayoutDestroy(c);
    if (b) cublasLtMatrixLayoutDestroy(b);
    if (a) cublasLtMatrixLayoutDestroy(a);
    if (op) cublasLtMatmulDescDestroy(op);
  }
};

}  // namespace

Expected<Gemm> Gemm::create() {
  Gemm gemm;
  MOE_CUBLAS_RETURN_IF_ERROR(cublasLtCreate(&gemm.handle_));
  MOE_ASSIGN_OR_RETURN(gemm.workspace_, DeviceBuffer::allocate(kWorkspaceBytes));
  return gemm;
}

Gemm::~Gemm() {
  if (handle_ != nullptr) cublasLtDestroy(handle_);
}

Gemm::Gemm(Gemm&& other) noexcept
    : handle_(std::exchange(other.handle_, nullptr)),
      workspace_(std::move(other.workspace_)),
      fp8_plans_(std::move(other.fp8_plans_)) {}

Status Gemm::matmul(const __nv_bfloat16* x, const __nv_bfloat16* w, void* out, DType out_dtype, int M, int N, int K,
                    cudaStream_t stream) {
  if (M == 0) return Status::ok();
  // Column-major view: out^T [N, M] = w [N, K] (stored as K x N, transposed) . x^T [K, M].
  Descriptors d;
  const cudaDataType_t out_type = out_dtype == DType::kF32 ? CUDA_R_32F : CUDA_R_16BF;
  MOE_CUBLAS_RETURN_IF_ERROR(cublasLtMatmulDescCreate(&d.op, CUBLAS_COMPUTE_32F, CUDA_R_32F));
  const cublasOperation_t transpose = CUBLAS_OP_T, none = CUBLAS_OP_N;
  MOE_CUBLAS_RETURN_IF_ERROR(
      cublasLtMatmulDescSetAttribute(d.op, CUBLASLT_MATMUL_DESC_TRANSA, &transpose, sizeof transpose));
  MOE_CUBLAS_RETURN_IF_ERROR(cublasLtMatmulDescSetAttribute(d.op, CUBLASLT_MATMUL_DESC_TRANSB, &none, sizeof none));
  MOE_CUBLAS_RETURN_IF_ERROR(cublasLtMatrixLayoutCreate(&d.a, CUDA_R_16BF, K, N, K));
  MOE_CUBLAS_RETURN_IF_ERROR(cublasLtMatrixLayoutCreate(&d.b, CUDA_R_16BF, K, M, K));
  MOE_CUBLAS_RETURN_IF_ERROR(cublasLtMatrixLayoutCreate(&d.c, out_type, N, M, N));
  MOE_CUBLAS_RETURN_IF_ERROR(cublasLtMatmulPreferenceCreate(&d.preference));
  const size_t workspace = workspace_.size();
  MOE_CUBLAS_RETURN_IF_ERROR(cublasLtMatmulPreferenceSetAttribute(
      d.preference, CUBLASLT_MATMUL_PREF_MAX_WORKSPACE_BYTES, &workspace, sizeof workspace));
  cublasLtMatmulHeuristicResult_t heuristic{};
  int found = 0;
  MOE_CUBLAS_RETURN_IF_ERROR(
      cublasLtMatmulAlgoGetHeuristic(handle_, d.op, d.a, d.b, d.c, d.c, d.preference, 1, &heuristic, &found));
  if (found == 0) return internal_error("cuBLASLt has no algorithm for a {}x{}x{} GEMM", M, N, K);
  const float alpha = 1.0f, beta = 0.0f;
  MOE_CUBLAS_RETURN_IF_ERROR(cublasLtMatmul(handle_, d.op, &alpha, w, d.a, x, d.b, &beta, out, d.c, out, d.c,
                                            &heuristic.algo, workspace_.data(), workspace, stream));
  return Status::ok();
}

namespace {

// The descriptors of an fp8-block GEMM (column-major view as in matmul: A =
// w, K x N transposed, with 128 x 128 block scales; B = x^T, K x M, with
// 1 x 128 ones). The scale pointers are set per call.
Status fp8_block_descriptors(Descriptors& d, DType out_dtype, int M, int N, int K) {
  const cudaDataType_t out_type = out_dtype == DType::kF32 ? CUDA_R_32F : CUDA_R_16BF;
  MOE_CUBLAS_RETURN_IF_ERROR(cublasLtMatmulDescCreate(&d.op, CUBLAS_COMPUTE_32F, CUDA_R_32F));
  const cublasOperation_t transpose = CUBLAS_OP_T, none = CUBLAS_OP_N;
  MOE_CUBLAS_RETURN_IF_ERROR(
      cublasLtMatmulDescSetAttribute(d.op, CUBLASLT_MATMUL_DESC_TRANSA, &transpose, sizeof transpose));
  MOE_CUBLAS_RETURN_IF_ERROR(
      cublasLtMatmulDescSetAttribute(d.op, CUBLASLT_MATMUL_DESC_TRANSB, &none, sizeof none));
#if CUBLAS_VERSION >= 120900
  const int32_t w_mode = CUBLASLT_MATMUL_MATRIX_SCALE_BLK128x128_32F,
                x_mode = CUBLASLT_MATMUL_MATRIX_SCALE_VEC128_32F;
  MOE_CUBLAS_RETURN_IF_ERROR(
      cublasLtMatmulDescSetAttribute(d.op, CUBLASLT_MATMUL_DESC_A_SCALE_MODE, &w_mode, sizeof w_mode));
  MOE_CUBLAS_RETURN_IF_ERROR(
      cublasLtMatmulDescSetAttribute(d.op, CUBLASLT_MATMUL_DESC_B_SCALE_MODE, &x_mode, sizeof x_mode));
#else
  return unimplemented("fp8-block GEMMs need cuBLASLt 12.9 or later");
#endif
  MOE_CUBLAS_RETURN_IF_ERROR(cublasLtMatrixLayoutCreate(&d.a, CUDA_R_8F_E4M3, K, N, K));
  MOE_CUBLAS_RETURN_IF_ERROR(cublasLtMatrixLayoutCreate(&d.b, CUDA_R_8F_E4M3, K, M, K));
  MOE_CUBLAS_RETURN_IF_ERROR(cublasLtMatrixLayoutCreate(&d.c, out_type, N, M, N));
  return Status::ok();
}

}  // namespace

const Gemm::Fp8Plan& Gemm::fp8_plan(int M, int N, int K, DType out_dtype) {
  const auto key = std::tuple{M, N, K, static_cast<int>(out_dtype)};
  auto it = fp8_plans_.find(key);
  if (it != fp8_plans_.end()) return it->second;
  Fp8Plan plan;
  Descriptors d;
  // The heuristic refuses block scaling (CUBLAS_STATUS_INVALID_VALUE) until
  // the scale pointers are set: any 16-byte aligned ones do for the query.
  const void* scales = workspace_.data();
  if (K % 512 == 0 && M > 0 && fp8_block_descriptors(d, out_dtype, M, N, K).is_ok() &&
      cublasLtMatmulDescSetAttribute(d.op, CUBLASLT_MATMUL_DESC_A_SCALE_POINTER, &scales, sizeof scales) ==
          CUBLAS_STATUS_SUCCESS &&
      cublasLtMatmulDescSetAttribute(d.op, CUBLASLT_MATMUL_DESC_B_SCALE_POINTER, &scales, sizeof scales) ==
          CUBLAS_STATUS_SUCCESS &&
      cublasLtMatmulPreferenceCreate(&d.preference) == CUBLAS_STATUS_SUCCESS) {
    const size_t workspace = workspace_.size();
    cublasLtMatmulHeuristicResult_t heuristic{};
    int found = 0;
    if (cublasLtMatmulPreferenceSetAttribute(d.preference, CUBLASLT_MATMUL_PREF_MAX_WORKSPACE_BYTES,
                                             &workspace, sizeof workspace) == CUBLAS_STATUS_SUCCESS &&
        cublasLtMatmulAlgoGetHeuristic(handle_, d.op, d.a, d.b, d.c, d.c, d.preference, 1, &heuristic,
                                       &found) == CUBLAS_STATUS_SUCCESS &&
        found > 0) {
      plan.found = true;
      plan.algo = heuristic.algo;
    }
  }
  if (fp8_plans_.size() >= 4096) fp8_plans_.clear();  // prefill sizes vary without bound
  return fp8_plans_.emplace(key, plan).first->second;
}

bool Gemm::has_fp8_block(int M, int N, int K, DType out_dtype) {
  return fp8_plan(M, N, K, out_dtype).found;
}

Status Gemm::matmul_fp8_block(const uint8_t* x, const float* x_scales, const uint8_t* w,
                              const float* w_scales, void* out, DType out_dtype, int M, int N, int K,
                              cudaStream_t stream) {
  if (M == 0) return Status::ok();
  const Fp8Plan& plan = fp8_plan(M, N, K, out_dtype);
  if (!plan.found) return unimplemented("cuBLASLt has no fp8-block algorithm for a {}x{}x{} GEMM", M, N, K);
  Descriptors d;
  MOE_RETURN_IF_ERROR(fp8_block_descriptors(d, out_dtype, M, N, K));
  MOE_CUBLAS_RETURN_IF_ERROR(
      cublasLtMatmulDescSetAttribute(d.op, CUBLASLT_MATMUL_DESC_A_SCALE_POINTER, &w_scales, sizeof w_scales));
  MOE_CUBLAS_RETURN_IF_ERROR(
      cublasLtMatmulDescSetAttribute(d.op, CUBLASLT_MATMUL_DESC_B_SCALE_POINTER, &x_scales, sizeof x_scales));
  const float alpha = 1.0f, beta = 0.0f;
  MOE_CUBLAS_RETURN_IF_ERROR(cublasLtMatmul(handle_, d.op, &alpha, w, d.a, x, d.b, &beta, out, d.c, out, d.c,
                                            &plan.algo, workspace_.data(), workspace_.size(), stream));
  return Status::ok();
}

}  // namespace moe::ops::cuda
