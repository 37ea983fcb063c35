// Tensor maps for the bulk tensor copy engine (TMA) of Hopper and later.
// The encoder lives in the driver; it is looked up once through the runtime,
// so nothing links against libcuda.
#pragma once

#include <cstdint>
#include <cuda.h>
#include <cuda_runtime.h>

namespace moe::ops::cuda {

// A 2-D tensor of `rows` x `cols` elements of `element_bytes` (2: bf16, 1: a
// byte type such as FP8; cols contiguous, rows `row_pitch_bytes` apart, a
// multiple of 16), copied in boxes of box_rows x box_cols with the 128-byte
// swizzle (box_cols * element_bytes must be 128). Reads past the tensor's
// edges fill zeros.
cudaError_t make_tensor_map_2d(CUtensorMap* map, const void* base, int element_bytes, uint64_t rows, uint64_t cols,
                               uint64_t row_pitch_bytes, uint32_t box_rows, uint32_t box_cols);

}  // namespace moe::ops::cuda
