// Tensor maps for the bulk tensor copy engine (TMA) of Hopper and later.
// The encoder lives in the driver; it is looked up once through the runtime,
// so nothing links against libcuda.
#pragma once

#include <cstdint>
#include <cuda.h>
#include <cuda_runtime.h>

namespace moe::ops::cuda {

// A 2-D bf16 tensor of `rows` x `cols` (cols contiguous, rows `row_pitch_bytes`
// apart, a multiple of 16), copied in boxes of box_rows x box_cols with the
// 128-byte swizzle (box_cols * 2 must be 128). Reads past the tensor's edges
// fill zeros.
cudaError_t make_bf16_tensor_map_2d(CUtensorMap* map, const void* base, uint64_t rows, uint64_t cols,
                                    uint64_t row_pitch_bytes, uint32_t box_rows, uint32_t box_cols);

}  // namespace moe::ops::cuda
