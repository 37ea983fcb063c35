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
    : handle_(std::exchange(other.handle_, nullptr)), workspace_(std::move(other.workspace_)) {}

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

}  // namespace moe::ops::cuda
