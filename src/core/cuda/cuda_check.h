// CUDA error handling: cudaError_t into Status (run-time failures such as out
// of memory or a missing device), and CUDA_CHECK for calls that can only fail
// through a bug.
#pragma once

#include <cuda_runtime.h>

#include "core/check.h"
#include "core/status.h"

namespace moe {

inline Status cuda_status(cudaError_t error, const char* what) {
  if (error == cudaSuccess) return Status::ok();
  const StatusCode code = error == cudaErrorMemoryAllocation ? StatusCode::kResourceExhausted
                          : (error == cudaErrorNoDevice || error == cudaErrorInsufficientDriver)
                              ? StatusCode::kUnavailable
                              : StatusCode::kInternal;
  return Status(code, fmt::format("{}: {} ({})", what, cudaGetErrorString(error), cudaGetErrorName(error)));
}

}  // namespace moe

#define MOE_CUDA_RETURN_IF_ERROR(expr) MOE_RETURN_IF_ERROR(::moe::cuda_status((expr), #expr))
#define CUDA_CHECK(expr)                                                              \
  do {                                                                                \
    cudaError_t moe_cuda_error_ = (expr);                                             \
    CHECK(moe_cuda_error_ == cudaSuccess, "{}: {}", #expr, cudaGetErrorString(moe_cuda_error_)); \
  } while (0)
